import { describe, expect, it } from 'vitest';
import { GgmlType } from '../core/gguf-types.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readBuffer, readFloat32 } from '../core/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { INT8_MATMUL_TYPES, int8MatmulCasesFor, runInt8MatmulCase } from '../test/int8-matmul-case.ts';
import { randomFloats, seededRandom } from '../test/random.ts';
import { prepareSwiglu } from './elementwise.ts';
import {
  createInt8Activations,
  int8MatmulCompiles,
  pipelineCompiles,
  prepareQuantizeActivations,
  releaseInt8Activations,
} from './matmul-int8.ts';
import { INT8_MATMUL_TILES, INT8_TOKEN_PADDING, int8MatmulWgsl } from './matmul-int8.wgsl.ts';
import { gegluReference, swigluReference } from './reference/elementwise.ts';
import { quantizeActivationsReference } from './reference/matmul-int8.ts';

const ctx = withTestGpu();

// The quantizer is plain WGSL: it runs on every adapter.
describe('int8 activation quantizer', () => {
  it.each([
    [67, 288],
    [1, 2048],
    [130, 96],
  ])('tokens=%i, K=%i: codes and scales as the CPU quantizer, padded token rows zero', async (tokens, K) => {
    const { gpu } = ctx;
    const random = seededRandom(tokens * 131 + K);
    const x = randomFloats(random, tokens * K, 2);
    x[5] = 0; // a block's zero stays zero; a whole zero block gets d = 0
    x.fill(0, 32, 64);
    const input = gpu.allocator.createStorage('x', 'scratch', x);
    const activations = createInt8Activations(gpu, 'int8', tokens, K);
    // Stale codes and scales from an earlier, longer chunk must not survive in the padding.
    gpu.device.queue.writeBuffer(activations.codes, 0, new Uint8Array(activations.codes.size).fill(0x55));
    gpu.device.queue.writeBuffer(activations.scales, 0, new Float32Array(activations.scales.size / 4).fill(3.5));
    const dispatch = prepareQuantizeActivations(gpu, 'quantize', { input, activations, tokens, K });
    submitDispatches(gpu, 'quantize', [dispatch]);
    const padded = Math.ceil(tokens / INT8_TOKEN_PADDING) * INT8_TOKEN_PADDING;
    const codes = new Int8Array(await readBuffer(gpu, activations.codes, padded * K));
    const scales = await readFloat32(gpu, activations.scales, (padded * K) / 16);
    releaseDispatches(gpu, [dispatch]);
    releaseInt8Activations(gpu, activations);
    gpu.allocator.release(input);
    const expected = quantizeActivationsReference(x, tokens, K);
    let mismatches = 0;
    for (let i = 0; i < tokens * K; i++) {
      const d = Math.abs(codes[i] - expected.codes[i]);
      expect(d).toBeLessThanOrEqual(1);
      if (d) mismatches++;
    }
    expect(mismatches).toBeLessThanOrEqual(Math.ceil(tokens * K * 1e-3));
    for (let i = 0; i < expected.scales.length; i += 2) {
      expect(Math.abs(scales[i] - expected.scales[i])).toBeLessThanOrEqual(1e-6 * expected.scales[i]);
      // d·Σq from the GPU's own codes.
      let sum = 0;
      for (let e = 0; e < 32; e++) sum += codes[16 * i + e];
      expect(scales[i + 1]).toBeCloseTo(Math.fround(scales[i] * sum), 5);
    }
    expect(scales[2]).toBe(0); // the zero block
    expect(codes.subarray(tokens * K).every((c) => c === 0)).toBe(true);
    expect(scales.subarray((tokens * K) / 16).every((s) => s === 0)).toBe(true);
  });

  it.each(['swiglu', 'geglu'] as const)(
    'with `up`, quantizes %s(gate, up): the same codes and scales as its elementwise pass followed by the quantizer',
    async (activation) => {
      const { gpu } = ctx;
      const tokens = 37;
      const K = 320;
      const random = seededRandom(7);
      const gateValues = randomFloats(random, tokens * K, 4);
      const upValues = randomFloats(random, tokens * K, 2);
      const gate = gpu.allocator.createStorage('gate', 'scratch', gateValues);
      const up = gpu.allocator.createStorage('up', 'scratch', upValues);
      const hidden = gpu.allocator.createStorage('hidden', 'scratch', tokens * K * 4);
      const fused = createInt8Activations(gpu, 'fused', tokens, K);
      const separate = createInt8Activations(gpu, 'separate', tokens, K);
      const dispatches = [
        prepareQuantizeActivations(gpu, 'fused', { input: gate, up, activation, activations: fused, tokens, K }),
        prepareSwiglu(gpu, activation, { gate, up, output: hidden, count: tokens * K, activation }),
        prepareQuantizeActivations(gpu, 'separate', { input: hidden, activations: separate, tokens, K }),
      ];
      submitDispatches(gpu, 'swiglu-quantize', dispatches);
      const padded = Math.ceil(tokens / INT8_TOKEN_PADDING) * INT8_TOKEN_PADDING;
      const read = async (a: typeof fused) => ({
        codes: new Int8Array(await readBuffer(gpu, a.codes, padded * K)),
        scales: await readFloat32(gpu, a.scales, (padded * K) / 16),
      });
      const [f, s] = [await read(fused), await read(separate)];
      const values = await readFloat32(gpu, hidden, tokens * K);
      releaseDispatches(gpu, dispatches);
      for (const a of [fused, separate]) releaseInt8Activations(gpu, a);
      for (const b of [gate, up, hidden]) gpu.allocator.release(b);
      // The elementwise pass against the CPU (so the comparison below is not of two equally wrong results).
      const expected = (activation === 'geglu' ? gegluReference : swigluReference)(gateValues, upValues);
      for (let i = 0; i < tokens * K; i++) expect(values[i]).toBeCloseTo(expected[i], 4);
      expect(new Set(f.codes.subarray(0, tokens * K)).size).toBeGreaterThan(200);
      expect([...f.codes]).toEqual([...s.codes]);
      expect([...f.scales]).toEqual([...s.scales]);
    },
  );
});

// The tensor-core tiles need i8 subgroup matrices: CI's lavapipe has none, so their cases skip there and run on a GPU
// that has them through bench/int8-matmul.ts (BENCH.md), which executes the same list. The dot4I8Packed kernel's
// cases run everywhere.
describe.each(INT8_MATMUL_TYPES)('int8 matmul over %s weights', (name, type, K) => {
  it.for(int8MatmulCasesFor(type))(
    `${name}: K=${K}, N=$rows, tokens=$tokens, bias=$bias, $variant`,
    async (c, context) => {
      if (c.variant !== 'dot4' && !ctx.gpu.features.subgroupMatrixI8) {
        console.warn(`SKIPPED: ${ctx.gpu.adapter.description} has no i8 subgroup matrices (run bench/int8-matmul.ts)`);
        context.skip();
      }
      const result = await runInt8MatmulCase(ctx.gpu, type, K, c);
      expect(result.codeDistance).toBeLessThanOrEqual(1);
      expect(result.error).toBeLessThanOrEqual(1);
    },
  );
});

describe('int8 matmul availability', () => {
  it('a pipeline probe reports WGSL that does not compile, without an uncaptured error', async () => {
    const { gpu } = ctx;
    const good = '@compute @workgroup_size(1) fn main() {}';
    expect(await pipelineCompiles(gpu, good)).toBe(true);
    expect(await pipelineCompiles(gpu, good.replace('fn main() {}', 'fn main() { let x: u32 = -1.5; }'))).toBe(false);
    expect(gpu.errors).toEqual([]);
  });

  it('the tensor-core kernel compiles exactly where the device has i8 subgroup matrices, dot4 everywhere', async () => {
    const { gpu } = ctx;
    const types = [GgmlType.Q6_K, GgmlType.Q4_K];
    expect(await int8MatmulCompiles(gpu, types)).toBe(gpu.features.subgroupMatrixI8);
    // Without the feature the kernel's WGSL is rejected: the probe, not the first prefill, finds that out.
    expect(await pipelineCompiles(gpu, int8MatmulWgsl(GgmlType.Q4_K, false, INT8_MATMUL_TILES['32x32']))).toBe(
      gpu.features.subgroupMatrixI8,
    );
    expect(await int8MatmulCompiles(gpu, [GgmlType.Q6_K, GgmlType.F32])).toBe(false);
    // The dot4I8Packed kernel and the quantizer need only WGSL's packed 8-bit dot product; it reads Q6_K too.
    expect(await int8MatmulCompiles(gpu, types, 'dot4')).toBe(true);
    expect(await int8MatmulCompiles(gpu, [GgmlType.Q6_K], 'dot4')).toBe(true);
    expect(await int8MatmulCompiles(gpu, [GgmlType.F32, GgmlType.F16], 'dot4')).toBe(false);
  });

  it('tiles the staging cannot feed, and half-block scales on tensor cores, are refused', () => {
    expect(() => int8MatmulWgsl(GgmlType.Q6_K, false, INT8_MATMUL_TILES['32x32'])).toThrow(/half blocks/);
    // 128 tokens per workgroup: past the 64-token padding of the activation rows.
    expect(() =>
      int8MatmulWgsl(GgmlType.Q4_0, false, { subgroupsAlongRows: 1, tilesAlongRows: 1, tilesAlongTokens: 2 }),
    ).toThrow(/does not fit/);
  });
});
