/**
 * Paged attention over a quant-mode pool (f16 and quant pages), for kernels/attention-mixed.test.ts and the GPU-host
 * checks of the int8 prefill kernel (bench/attention-kernels.ts --check-int8): runMixed steps a sequence through
 * the runtime's own append, demotion and attention, checking the demoted rows bit for bit and every output against
 * the reference over what the pages hold.
 */

import type { GpuContext } from '../core/gpu/device.ts';
import { type PreparedDispatch, releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readFloat32, readUint32 } from '../core/gpu/readback.ts';
import {
  type AttentionProducts,
  poolKeysInt8Bytes,
  poolKeysInt8Capacity,
  prepareKeysInt8,
} from '../kernels/attention.ts';
import { keysInt8ByteAt } from '../kernels/attention-prefill-int8.wgsl.ts';
import { int8Codes } from '../kernels/reference/attention-int8.ts';
import { PagedKvAttention } from '../runtime/kv/paged-attention.ts';
import { decodePageEntry, KV_PAGE_KIND, KvPagePool, type KvPoolOptions, type KvSequence } from '../runtime/kv/pool.ts';
import { dequantizeRow, quantizeRow, roundToF16 } from '../runtime/kv/quant-format.ts';
import {
  ATTENTION_F32_TOLERANCE,
  type AttentionTolerance,
  expectedAttention,
  int8PrefillServes,
} from './attention-harness.ts';
import { maxToleranceRatio, randomFloats, seededRandom, withTies } from './random.ts';
import { mutateShaders, type ShaderMutation } from './shader-mutation.ts';

export interface MixedCase {
  layers: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  pool: Omit<KvPoolOptions, 'layers' | 'kvHeads' | 'headDim' | 'budgetBytes'>;
  chunks: number[];
}

function upload(gpu: GpuContext, buffer: GPUBuffer, data: Float32Array): void {
  gpu.device.queue.writeBuffer(buffer, 0, data.buffer as ArrayBuffer, data.byteOffset, data.byteLength);
}

/**
 * Runs `chunks` through a quant-mode pool (prefill graph for chunks > 1, decode graph for 1) and checks, after each
 * step: every quant row the demotion kernel wrote equals quantizeRow of the f16 row it came from, bit for bit, and
 * every layer's attention output equals the f64 reference over what the pages hold (f16 rows, and dequantizeRow of
 * the quant rows as read back).
 */
export async function runMixed(
  gpu: GpuContext,
  c: MixedCase,
  seed: number,
  opts: {
    prefillProducts?: AttentionProducts;
    tolerance?: AttentionTolerance;
    /**
     * After each step, also run the int8 prefill attention's conversion pass (prepareKeysInt8) for every layer and
     * compare its codes and scales with int8Codes of what the pages hold (result `keysInt8`).
     */
    checkKeysInt8?: boolean;
    /**
     * K and V with ties (withTies): the demotion's choice among equal extremes (the first minimum, the last maximum
     * of quantizeRow's stable ranks) shows in the bits of its f16 parameters.
     */
    ties?: boolean;
    /** A broken attention kernel (the tests of the tests): the layers' attention compiles with it. */
    mutation?: ShaderMutation;
  } = {},
) {
  const tolerance = opts.tolerance ?? ATTENTION_F32_TOLERANCE;
  const before = gpu.allocator.snapshot().totalBuffers;
  const { layers, heads, kvHeads, headDim } = c;
  const width = kvHeads * headDim;
  const maxTokens = Math.max(...c.chunks);
  const pool = new KvPagePool(gpu, { layers, kvHeads, headDim, budgetBytes: 4 << 20, kv: 'quant', ...c.pool });
  const quant = pool.quant!;
  const int8 = opts.prefillProducts === 'int8' || opts.prefillProducts === 'int8-dot';
  // prepareAttention falls back to the f32 kernels where an int8 one does not serve this pool's formats: the check
  // would then run the wrong kernel.
  if (int8 && !int8PrefillServes(gpu, pool, maxTokens, opts.prefillProducts ?? 'f32')) {
    pool.destroy();
    throw new Error(`mixed attention: the ${opts.prefillProducts} prefill kernel does not serve this pool here`);
  }
  const attentionGpu = opts.mutation ? mutateShaders(gpu, opts.mutation).gpu : gpu;
  const backend = new PagedKvAttention(attentionGpu, pool, { heads, prefillProducts: opts.prefillProducts });
  const f32 = (n: number) => gpu.allocator.createStorage('test', 'scratch', n * 4);
  const q = f32(maxTokens * heads * headDim);
  const k = Array.from({ length: layers }, () => f32(maxTokens * width));
  const v = Array.from({ length: layers }, () => f32(maxTokens * width));
  const out = Array.from({ length: layers }, () => f32(maxTokens * heads * headDim));
  const graph = (t: number): PreparedDispatch[] =>
    Array.from({ length: layers }, (_, l) => {
      const p = backend.prepareLayer(l, { q, k: k[l], v: v[l], output: out[l] }, t, null);
      return [...p.append, ...p.attention];
    }).flat();
  const prefill = graph(maxTokens);
  const decode = graph(1);
  const keysInt8 = opts.checkKeysInt8
    ? Array.from({ length: layers }, (_, layer) => {
        const buffer = gpu.allocator.createStorage('test.keys_int8', 'scratch', poolKeysInt8Bytes(pool));
        const binding = { pool, layer, q, output: out[layer], heads, maxTokens, scale: 1, keysInt8: buffer };
        return { buffer, dispatch: prepareKeysInt8(gpu, `mixed.keys_int8.${layer}`, binding).dispatch };
      })
    : [];
  // Codes off by one (a rounding tie that f32 may round either way), off by more, and the scales' largest error.
  const keysChecked = { codes: 0, offByOne: 0, wrong: 0, worstScale: 0 };
  const random = seededRandom(seed);
  const seq: KvSequence = pool.createSequence();
  const history = {
    k: Array.from({ length: layers }, () => [] as number[]),
    v: Array.from({ length: layers }, () => [] as number[]),
  };
  let worst = 0;
  let values = 0;
  let mismatchedCodes = 0;
  let mismatchedParams = 0;
  const checked = new Set<string>();
  let quantPositions = 0;
  let lastStored: { k: number[][]; v: number[][] } | null = null;
  for (const tokens of c.chunks) {
    if (tokens < 0) {
      // Rollback: the kept part of a quant page is promoted to f16 on the next write, holding its dequantized values.
      const length = seq.length + tokens;
      const first = Math.floor(length / pool.pageTokens) * pool.pageTokens;
      const partial = seq.pages[Math.floor(length / pool.pageTokens)];
      if (length > first && decodePageEntry(partial).kind === KV_PAGE_KIND.quant && lastStored) {
        for (let l = 0; l < layers; l++) {
          for (const key of ['k', 'v'] as const) {
            const from = lastStored[key][l].slice(first * width, length * width);
            history[key][l].splice(first * width, from.length, ...from);
          }
        }
      }
      for (const rows of [...history.k, ...history.v]) rows.length = length * width;
      pool.truncate(seq, length);
      continue;
    }
    const position = seq.length;
    pool.writeStep(seq, position, tokens);
    pool.submitPending(); // page copies and promotions the step asked for
    const qs = randomFloats(random, tokens * heads * headDim, 2);
    upload(gpu, q, qs);
    for (let l = 0; l < layers; l++) {
      const ks = randomFloats(random, tokens * width, 2);
      const vs = randomFloats(random, tokens * width, 1);
      if (opts.ties) for (const rows of [ks, vs]) withTies(rows, width);
      upload(gpu, k[l], ks);
      upload(gpu, v[l], vs);
      history.k[l].push(...ks);
      history.v[l].push(...vs);
    }
    submitDispatches(gpu, 'mixed', tokens === 1 ? decode : prefill);
    const end = position + tokens;
    // What the pages hold, per layer, as the reference reads it.
    const stored = { k: history.k.map((h) => h.map(roundToF16)), v: history.v.map((h) => h.map(roundToF16)) };
    quantPositions = 0;
    for (const [i, entry] of seq.pages.entries()) {
      const { kind, slab, page } = decodePageEntry(entry);
      if (kind !== KV_PAGE_KIND.quant) continue;
      const words = await readUint32(gpu, pool.slabBindings()[slab], quant.pageWords, page * quant.pageWords);
      for (let l = 0; l < layers; l++) {
        for (const kv of [0, 1] as const) {
          const { format, rowWords: rowWordCount, codeWords } = quant.rows(l, kv);
          const perRow = quant.positionsPerRow;
          for (let r = 0; r < pool.pageTokens / perRow; r++) {
            const pos = i * pool.pageTokens + r * perRow; // the stored row's first position
            const offset = quant.layerOffsetWords(l, kv) + r * rowWordCount;
            const gpuRow = words.slice(offset, offset + rowWordCount);
            const source = (kv === 0 ? stored.k : stored.v)[l].slice(pos * width, (pos + perRow) * width);
            const cpuRow = quantizeRow(source, format);
            if (!checked.has(`${entry}:${pos}`)) {
              const perWord = 32 / format.bits;
              for (let w = 0; w < rowWordCount; w++) {
                if (w >= codeWords) mismatchedParams += gpuRow[w] === cpuRow[w] ? 0 : 1;
                else
                  for (let i = 0; i < perWord; i++)
                    if (((gpuRow[w] ^ cpuRow[w]) >>> (i * format.bits)) & ((1 << format.bits) - 1)) mismatchedCodes++;
              }
              values += source.length;
            }
            (kv === 0 ? stored.k : stored.v)[l].splice(pos * width, perRow * width, ...dequantizeRow(gpuRow, format));
          }
        }
      }
      quantPositions += pool.pageTokens;
      for (let t = 0; t < pool.pageTokens; t++) checked.add(`${entry}:${i * pool.pageTokens + t}`);
    }
    lastStored = stored;
    if (keysInt8.length > 0) {
      submitDispatches(
        gpu,
        'mixed.keys_int8',
        keysInt8.map((k) => k.dispatch),
      );
      const layout = { capacity: poolKeysInt8Capacity(pool), kvHeads, headDim };
      for (const [l, { buffer }] of keysInt8.entries()) {
        const words = await readUint32(gpu, buffer, buffer.size / 4);
        const found = keysInt8Mismatches(words, layout, [stored.k[l], stored.v[l]], end);
        keysChecked.codes += found.codes;
        keysChecked.offByOne += found.offByOne;
        keysChecked.wrong += found.wrong;
        keysChecked.worstScale = Math.max(keysChecked.worstScale, found.worstScale);
      }
    }
    for (let l = 0; l < layers; l++) {
      const actual = await readFloat32(gpu, out[l], tokens * heads * headDim);
      const input = {
        q: qs,
        k: Float32Array.from(stored.k[l]),
        v: Float32Array.from(stored.v[l]),
        position,
        tokens,
        heads,
        kvHeads,
        headDim,
        scale: 1 / Math.sqrt(headDim),
        stored: true,
      };
      // An int8 prefill step with the prefill graph's split settings (PagedKvAttention).
      const { splits, splitRows, minChunkKeys } = backend.plan(l, maxTokens);
      const split = { splits, splitRows, minChunkKeys };
      const expected = expectedAttention(input, int8 && tokens > 1 ? split : null);
      worst = Math.max(worst, maxToleranceRatio(actual, expected, tolerance.atol, tolerance.rtol));
    }
    if (seq.length !== end) throw new Error(`mixed attention: sequence length ${seq.length}, expected ${end}`);
    const problems = pool.audit();
    if (problems.length > 0) throw new Error(`mixed attention: pool audit: ${problems.join('; ')}`);
  }
  const { demotions, promotions } = pool;
  releaseDispatches(gpu, [...prefill, ...decode, ...keysInt8.map((k) => k.dispatch)]);
  for (const b of [q, ...k, ...v, ...out, ...keysInt8.map((k) => k.buffer)]) gpu.allocator.release(b);
  pool.destroy();
  const after = gpu.allocator.snapshot().totalBuffers;
  if (after !== before) throw new Error(`mixed attention: ${after - before} buffers left after release`);
  return {
    worst,
    values,
    mismatchedCodes,
    mismatchedParams,
    quantPositions,
    demotions,
    promotions,
    length: seq.length,
    keysInt8: keysChecked,
  };
}

/**
 * An int8 keys buffer's codes and scales (the conversion pass's output, read back) against int8Codes of the K and V
 * rows (`rows`: [key][kvHeads × headDim] each, as the pages hold them) of keys 0..keys-1: codes checked, codes off by
 * one (a rounding tie that f32 may round either way), off by more, and the scales' largest error.
 */
export function keysInt8Mismatches(
  words: Uint32Array,
  layout: { capacity: number; kvHeads: number; headDim: number },
  rows: [ArrayLike<number>, ArrayLike<number>],
  keys: number,
): { codes: number; offByOne: number; wrong: number; worstScale: number } {
  const { kvHeads, headDim } = layout;
  const bytes = new Int8Array(words.buffer, words.byteOffset, words.byteLength);
  const view = new DataView(words.buffer, words.byteOffset, words.byteLength);
  const found = { codes: 0, offByOne: 0, wrong: 0, worstScale: 0 };
  for (const kind of [0, 1] as const) {
    for (let key = 0; key < keys; key++) {
      for (let h = 0; h < kvHeads; h++) {
        const at = (key * kvHeads + h) * headDim;
        const expected = int8Codes(Array.from({ length: headDim }, (_, d) => rows[kind][at + d]));
        const byteAt = (d: number) => keysInt8ByteAt(kind, h, key, d, layout);
        const scale = view.getFloat32(byteAt(0).scale, true);
        found.worstScale = Math.max(found.worstScale, Math.abs(scale - expected.step));
        for (let d = 0; d < headDim; d++) {
          const off = Math.abs(bytes[byteAt(d).code] - expected.codes[d]);
          found.codes++;
          if (off === 1) found.offByOne++;
          else if (off > 1) found.wrong++;
        }
      }
    }
  }
  return found;
}

/** Two layers of hd 64, 4:1 (a GQA group per KV head), group 128 spans both heads, pages of 8. */
export const MIXED_HD64_GQA: MixedCase = {
  layers: 2,
  heads: 8,
  kvHeads: 2,
  headDim: 64,
  pool: { pageTokens: 8, sink: 8, window: 8 },
  chunks: [20, 13, 1, 1, 9, 1, 1],
};

/** hd 128, 4:1, K 2-bit group 64 clipped 0.96, V 4-bit clipped 0.9, no sink. */
export const MIXED_HD128_K2_V4: MixedCase = {
  layers: 1,
  heads: 4,
  kvHeads: 1,
  headDim: 128,
  pool: {
    pageTokens: 8,
    sink: 0,
    window: 16,
    keyFormat: { groupSize: 64, clipQuantile: 0.96 },
    valueFormat: { bits: 4, clipQuantile: 0.9 },
  },
  chunks: [30, 1, 1, 17, 1, 1],
};

/** hd 64, 1:1, 1-bit keys, a sink that is not a whole page (rounded up). */
export const MIXED_ONE_BIT_KEYS: MixedCase = {
  layers: 1,
  heads: 2,
  kvHeads: 2,
  headDim: 64,
  pool: { pageTokens: 4, sink: 5, window: 4, keyFormat: { bits: 1, groupSize: 64 } },
  chunks: [16, 1, 1, 1, 1, 5, 1],
};

/** hd 64, 2:1, a prefill chunk over 320 keys: two prefill splits, each over quant pages and the step's f16 pages. */
export const MIXED_TWO_SPLIT_PREFILL: MixedCase = {
  layers: 1,
  heads: 4,
  kvHeads: 2,
  headDim: 64,
  pool: { pageTokens: 16, sink: 16, window: 32 },
  chunks: [200, 120, 1, 1],
};

/**
 * Quant-pool steps for the int8 prefill kernels (headDim 64 and 128): 2-, 1- and 4-bit rows, groups inside a head
 * and spanning heads, boosted layers, a prefill chunk split in two over quant and f16 pages.
 */
export const INT8_MIXED_CASES: [string, MixedCase][] = [
  [
    'hd 64, 4:1, group 128 spans both heads, layer 1 boosted to 4 bits, pages of 8',
    { ...MIXED_HD64_GQA, pool: { ...MIXED_HD64_GQA.pool, boostLayers: [1] } },
  ],
  ['hd 128, 4:1, K 2-bit group 64 clipped 0.96, V 4-bit clipped 0.9, no sink', MIXED_HD128_K2_V4],
  ['hd 64, 1:1, 1-bit keys', MIXED_ONE_BIT_KEYS],
  ['hd 64, 2:1, a prefill chunk over 320 keys (2 splits)', MIXED_TWO_SPLIT_PREFILL],
];
