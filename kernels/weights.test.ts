import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { UnsupportedModelError } from '../core/errors.ts';
import { type ByteSource, GGML_TYPE_INFO, GgmlType, type GgufTensorInfo } from '../core/gguf-types.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import { readUint32 } from '../core/gpu/readback.ts';
import { withLimits, withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, seededRandom } from '../test/random.ts';
import { dequantize, f16ToF32, f32ToF16Bits, randomWeightBytes } from './reference/dequantize.ts';
import {
  packedRowWords,
  packRows,
  rawRowBytes,
  releaseWeight,
  uploadWeight,
  uploadWeightFromBytes,
} from './weights.ts';

const ctx = withTestGpu();

const ALL: [string, GgmlType, number][] = [
  ['F32', GgmlType.F32, 32],
  ['F16', GgmlType.F16, 32],
  ['BF16', GgmlType.BF16, 32],
  ['Q8_0', GgmlType.Q8_0, 32],
  ['Q4_0', GgmlType.Q4_0, 32],
  ['Q4_1', GgmlType.Q4_1, 32],
  ['Q5_0', GgmlType.Q5_0, 32],
  ['Q5_1', GgmlType.Q5_1, 32],
  ['Q4_K', GgmlType.Q4_K, 256],
  ['Q5_K', GgmlType.Q5_K, 256],
  ['Q6_K', GgmlType.Q6_K, 256],
  ['Q2_K', GgmlType.Q2_K, 256],
  ['Q3_K', GgmlType.Q3_K, 256],
  ['IQ4_NL', GgmlType.IQ4_NL, 32],
  ['IQ4_XS', GgmlType.IQ4_XS, 256],
];

describe('f16 conversion', () => {
  it('round-trips every finite half and rounds to nearest even', () => {
    const mismatches: number[] = [];
    for (let h = 0; h < 0x10000; h++) {
      if ((h & 0x7c00) !== 0x7c00 && f32ToF16Bits(f16ToF32(h)) !== h) mismatches.push(h);
    }
    expect(mismatches).toEqual([]);
    expect(f32ToF16Bits(1 + 2 ** -11)).toBe(0x3c00); // tie goes to even
    expect(f32ToF16Bits(1 + 3 * 2 ** -11)).toBe(0x3c02);
    expect(f32ToF16Bits(1e6)).toBe(0x7c00);
  });
});

describe('reference dequantizers', () => {
  it('Q4_0: low nibbles are elements 0..15, high nibbles 16..31, value (q - 8)·d', () => {
    const block = new Uint8Array(18);
    new DataView(block.buffer).setUint16(0, f32ToF16Bits(0.5), true);
    for (let j = 0; j < 16; j++) block[2 + j] = (j & 0xf) | ((15 - j) << 4);
    const y = dequantize(GgmlType.Q4_0, block, 32);
    for (let j = 0; j < 16; j++) {
      expect(y[j]).toBe((j - 8) * 0.5);
      expect(y[16 + j]).toBe((7 - j) * 0.5);
    }
  });

  it('Q5_0: bit e of qh is the fifth bit of element e', () => {
    const block = new Uint8Array(22);
    const view = new DataView(block.buffer);
    view.setUint16(0, f32ToF16Bits(1), true);
    view.setUint32(2, 0x80000001, true); // elements 0 and 31
    const y = dequantize(GgmlType.Q5_0, block, 32);
    expect(y[0]).toBe(0);
    expect(y[31]).toBe(0);
    expect(y[1]).toBe(-16);
    expect(y[16]).toBe(-16);
  });

  it('Q4_K: sub-blocks 4..7 take their scale/min high bits from the top bits of bytes 0..7', () => {
    const block = new Uint8Array(144);
    const view = new DataView(block.buffer);
    view.setUint16(0, f32ToF16Bits(1), true); // d
    view.setUint16(2, f32ToF16Bits(1), true); // dmin
    const scales = block.subarray(4, 16);
    scales[0] = 0xc0 | 5; // sub-block 0 scale 5; top bits -> scale of sub-block 4 (bits 4..5)
    scales[4] = 0x40 | 7; // sub-block 0 min 7; top bit 6 -> min of sub-block 4 gets bit 4
    scales[8] = 0x21; // sub-block 4: scale low 1, min low 2
    block.fill(0x11, 16); // every quant 1
    const y = dequantize(GgmlType.Q4_K, block, 256);
    expect(y[0]).toBe(5 * 1 - 7);
    expect(y[128]).toBe((1 | (3 << 4)) * 1 - (2 | (1 << 4)));
  });

  // ggml's own dequantizers (libggml-base from node-llama-cpp's prebuilt binaries, called through Python ctypes)
  // are the independent check of ours: same random blocks, compared element by element.
  const lib = join(import.meta.dirname, '../node_modules/@node-llama-cpp/linux-x64/bins/linux-x64/libggml-base.so');
  const python = spawnSync('python3', ['-c', 'import ctypes'], { encoding: 'utf8' });
  const canCrossCheck = existsSync(lib) && python.status === 0;
  it.runIf(canCrossCheck).each(ALL)('%s agrees with ggml (libggml-base) on random blocks', (name, type, block) => {
    const count = block * 24;
    const raw = randomWeightBytes(type, count, seededRandom(type + 1000), 0.05);
    const dir = mkdtempSync(join(tmpdir(), 'longtab-dq-'));
    try {
      writeFileSync(join(dir, 'in.bin'), raw);
      const fn =
        type === GgmlType.F16
          ? 'ggml_fp16_to_fp32_row'
          : type === GgmlType.BF16
            ? 'ggml_bf16_to_fp32_row'
            : `dequantize_row_${name.toLowerCase().replace('_k', '_K')}`;
      const script = [
        'import ctypes, sys',
        `lib = ctypes.CDLL(${JSON.stringify(lib)})`,
        `data = open(${JSON.stringify(join(dir, 'in.bin'))}, 'rb').read()`,
        `out = (ctypes.c_float * ${count})()`,
        name === 'F32'
          ? 'ctypes.memmove(out, data, len(data))'
          : `lib.${fn}(ctypes.c_char_p(data), out, ctypes.c_int64(${count}))`,
        `open(${JSON.stringify(join(dir, 'out.bin'))}, 'wb').write(bytes(out))`,
      ].join('\n');
      const run = spawnSync('python3', ['-c', script], { encoding: 'utf8' });
      expect(run.stderr).toBe('');
      const theirs = new Float32Array(new Uint8Array(readFileSync(join(dir, 'out.bin'))).buffer);
      const ours = dequantize(type, raw, count);
      // ggml multiplies in f32, we in f64 rounded once: a few ulps of the largest term (|d·sc·q| < 100).
      expect(maxToleranceRatio(ours, theirs, 3e-5, 1e-6)).toBeLessThanOrEqual(1);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('weight packing', () => {
  it('pads Q4_0 blocks to 5 words with d alone in word 0', () => {
    const raw = randomWeightBytes(GgmlType.Q4_0, 64, seededRandom(3));
    const packed = packRows(GgmlType.Q4_0, 64, raw, 1);
    expect(packed.length).toBe(10);
    const bytes = new Uint8Array(packed.buffer);
    for (let b = 0; b < 2; b++) {
      expect([...bytes.subarray(b * 20, b * 20 + 2)]).toEqual([...raw.subarray(b * 18, b * 18 + 2)]);
      expect([...bytes.subarray(b * 20 + 2, b * 20 + 4)]).toEqual([0, 0]);
      expect([...bytes.subarray(b * 20 + 4, b * 20 + 20)]).toEqual([...raw.subarray(b * 18 + 2, b * 18 + 18)]);
    }
  });

  it('keeps Q6_K blocks byte for byte and appends the pad after d', () => {
    const raw = randomWeightBytes(GgmlType.Q6_K, 256, seededRandom(4));
    const bytes = new Uint8Array(packRows(GgmlType.Q6_K, 256, raw, 1).buffer);
    expect(bytes.length).toBe(212);
    expect([...bytes.subarray(0, 210)]).toEqual([...raw]);
  });

  it('starts every F16 row on a word when K is odd', () => {
    const raw = randomWeightBytes(GgmlType.F16, 3 * 5, seededRandom(5));
    const packed = packRows(GgmlType.F16, 5, raw, 3);
    expect(packedRowWords(GgmlType.F16, 5)).toBe(3);
    const halves = new Uint16Array(packed.buffer);
    const src = new Uint16Array(raw.buffer);
    for (let r = 0; r < 3; r++) {
      expect([...halves.subarray(r * 6, r * 6 + 5)]).toEqual([...src.subarray(r * 5, r * 5 + 5)]);
      expect(halves[r * 6 + 5]).toBe(0);
    }
  });
});

function memorySource(bytes: Uint8Array, reads: [number, number][]): ByteSource {
  return {
    name: 'memory',
    size: bytes.byteLength,
    async read(offset, length) {
      reads.push([offset, length]);
      return bytes.slice(offset, offset + length);
    },
  };
}

async function readParts(
  gpu: GpuContext,
  weight: { parts: { buffer: GPUBuffer; rowCount: number }[] },
  rowWords: number,
) {
  const words: number[] = [];
  for (const p of weight.parts) words.push(...(await readUint32(gpu, p.buffer, p.rowCount * rowWords)));
  return new Uint32Array(words);
}

describe('uploadWeight', () => {
  it.each(ALL)('%s: streams row-aligned chunks into split parts, byte-exact with packRows', async (_n, type, block) => {
    const { gpu } = ctx;
    const K = block * 3;
    const N = 11;
    const raw = randomWeightBytes(type, K * N, seededRandom(type + 77));
    const header = 96; // the tensor starts mid-file
    const file = new Uint8Array(header + raw.length + 8);
    file.set(raw, header);
    const tensor: GgufTensorInfo = { name: 'blk.0.w', shape: [K, N], type, offset: header, byteLength: raw.length };
    const reads: [number, number][] = [];
    const rawRow = rawRowBytes(type, K);
    const before = gpu.allocator.snapshot();
    const weight = await uploadWeight(gpu, tensor, memorySource(file, reads), {
      maxRowsPerPart: 4,
      maxChunkBytes: rawRow * 3 + 1,
    });
    expect(weight.parts.map((p) => [p.firstRow, p.rowCount])).toEqual([
      [0, 4],
      [4, 4],
      [8, 3],
    ]);
    for (const [offset, length] of reads) {
      expect(length).toBeLessThanOrEqual(rawRow * 3 + 1);
      expect((offset - header) % rawRow).toBe(0);
      expect(length % rawRow).toBe(0);
    }
    expect(reads.reduce((s, [, l]) => s + l, 0)).toBe(raw.length);
    const rowWords = packedRowWords(type, K);
    expect(weight.byteLength).toBe(N * rowWords * 4);
    expect(gpu.allocator.snapshot().bytes.weights - before.bytes.weights).toBe(weight.byteLength);
    expect([...(await readParts(gpu, weight, rowWords))]).toEqual([...packRows(type, K, raw, N)]);
    releaseWeight(gpu, weight);
    expect(gpu.allocator.snapshot().totalBuffers).toBe(before.totalBuffers);
  });

  it('splits by the storage binding limit when no row cap is given', () => {
    const { gpu } = ctx;
    const rowBytes = packedRowWords(GgmlType.Q8_0, 64) * 4; // 72 bytes
    const limited = withLimits(gpu, { maxStorageBufferBindingSize: rowBytes * 5 + 10 });
    const raw = randomWeightBytes(GgmlType.Q8_0, 64 * 12, seededRandom(9));
    const weight = uploadWeightFromBytes(limited, 'w', GgmlType.Q8_0, [64, 12], raw);
    expect(weight.parts.map((p) => p.rowCount)).toEqual([5, 5, 2]);
    releaseWeight(gpu, weight);
  });

  it('rejects types, shapes and sizes it cannot hold, with actionable errors', () => {
    const { gpu } = ctx;
    const before = gpu.allocator.snapshot().totalBuffers;
    const iq3 = GGML_TYPE_INFO[GgmlType.IQ3_XXS]!;
    expect(() =>
      uploadWeightFromBytes(gpu, 'w', GgmlType.IQ3_XXS, [256, 2], new Uint8Array(iq3.blockBytes * 2)),
    ).toThrow(UnsupportedModelError);
    expect(() =>
      uploadWeightFromBytes(gpu, 'w', GgmlType.IQ3_XXS, [256, 2], new Uint8Array(iq3.blockBytes * 2)),
    ).toThrow('Weights of type IQ3_XXS are not supported; use a Q3_K_M or Q4_K_M file.');
    expect(() => uploadWeightFromBytes(gpu, 'w', GgmlType.Q4_0, [48, 2], new Uint8Array(100))).toThrow(/multiple/);
    expect(() => uploadWeightFromBytes(gpu, 'w', GgmlType.Q4_0, [64, 2], new Uint8Array(70))).toThrow(/72 bytes/);
    expect(() => uploadWeightFromBytes(gpu, 'w', GgmlType.F32, [4, 2, 3], new Uint8Array(96))).toThrow(/2-D/);
    expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
  });
});
