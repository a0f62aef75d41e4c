import { describe, expect, it } from 'vitest';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { Harness, runSteps, type Shape } from '../test/attention-harness.ts';
import type { AttentionSources } from '../test/attention-sources.ts';
import { withLimits, withTestGpu } from '../test/gpu.ts';
import { seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import {
  attentionDecodeShape,
  attentionPartialsBytes,
  attentionPrefillShapeFor,
  planAttentionKernel,
  prepareAttention,
  splitsOfStep,
} from './attention.ts';
import {
  ATTENTION_BLOCK_KEY_CHOICES,
  type AttentionBlockKeys,
  attentionMergeRowsSource,
  attentionMergeSource,
  attentionMergeWgsl,
  attentionPartialSource,
  attentionWorkgroupBytes,
} from './attention.wgsl.ts';
import { attentionDecodeSource, type DecodeQuantShape } from './attention-decode.wgsl.ts';
import {
  attentionPrefillShape,
  attentionPrefillSource,
  attentionPrefillWorkgroupBytes,
} from './attention-prefill.wgsl.ts';
import { attentionPrefillDotSource } from './attention-prefill-dot.wgsl.ts';
import { attentionPrefillInt8Source } from './attention-prefill-int8.wgsl.ts';
import { f16Bits, f16BitsToNumber } from './reference/attention.ts';

const ctx = withTestGpu();

/** Every tile size of the split kernel this device can run (the tests run each). */
function blockKeysToTest(gpu: GpuContext, headDim: number): AttentionBlockKeys[] {
  return ATTENTION_BLOCK_KEY_CHOICES.filter(
    (blockKeys) =>
      attentionWorkgroupBytes({ quant: false, blockKeys, headDim, rows: Math.min(16, 1024 / headDim) }) <=
      gpu.limits.maxComputeWorkgroupStorageSize,
  );
}

describe('paged attention', () => {
  it.each<[string, Shape, number[], number | undefined]>([
    ['hd 8, 1:1, pages of 4', { layers: 2, heads: 4, kvHeads: 4, headDim: 8, pageTokens: 4 }, [5, 3, 1, 1, 1, 1], 3],
    ['hd 64, 4:1, pages of 16', { layers: 2, heads: 8, kvHeads: 2, headDim: 64, pageTokens: 16 }, [20, 13, 1, 1], 16],
    ['hd 128, 4:1, pages of 8', { layers: 1, heads: 4, kvHeads: 1, headDim: 128, pageTokens: 8 }, [9, 1, 1, 7, 1], 5],
    [
      'hd 64, 3:1, tiles straddle tokens',
      { layers: 1, heads: 6, kvHeads: 2, headDim: 64, pageTokens: 8 },
      [11, 1, 6, 1],
      3,
    ],
    [
      'hd 8, 2:1, 70 splits (merge past 64)',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 8, pageTokens: 16 },
      [90, 1, 1],
      70,
    ],
    [
      'hd 64, 2:1, splits of one key, 140 to 151 used (the merge past the 128 it loads early)',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 64, pageTokens: 16 },
      [140, 10, 1],
      200,
    ],
    [
      'hd 8, 20:1, a group spans two tiles',
      { layers: 1, heads: 20, kvHeads: 1, headDim: 8, pageTokens: 4 },
      [7, 1, 1],
      2,
    ],
    [
      'hd 128, 1:1, decode only',
      { layers: 1, heads: 2, kvHeads: 2, headDim: 128, pageTokens: 4 },
      [1, 1, 1, 1, 1, 1],
      4,
    ],
    // Tiles of up to 64 keys filled from many pages of 4, with a chunk boundary inside a page.
    [
      'hd 64, 2:1, one split, tiles over 16 pages',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 64, pageTokens: 4 },
      [70, 1, 45, 1, 1],
      1,
    ],
    [
      'hd 128, 4:1, 3 splits, pages of 4',
      { layers: 1, heads: 4, kvHeads: 1, headDim: 128, pageTokens: 4 },
      [61, 1, 30, 1],
      3,
    ],
  ])('matches the CPU reference: %s', async (name, shape, chunks, splits) => {
    // Every tile size the device fits where a prefill is long enough to fill 64-key tiles; the default 16 elsewhere
    // (each size is a pipeline of its own, and compiling them all on a CPU driver costs minutes).
    const sizes = Math.max(...chunks) >= 45 ? blockKeysToTest(ctx.gpu, shape.headDim) : [16 as const];
    for (const blockKeys of sizes) {
      const { ratios } = await runSteps(ctx.gpu, shape, chunks, chunks.length * 31 + shape.headDim, splits, {
        blockKeys,
      });
      expect(Math.max(...ratios), `${name}, tiles of ${blockKeys} keys`).toBeLessThanOrEqual(1);
    }
  });

  it.each<[string, Shape, number[], number, { prefillSplits?: number; minChunkKeys: number }]>([
    // 8 decode splits of >= 5 keys: at 21..26 keys only 5 or 6 splits are used, the rest of the grid returns at once.
    [
      'decode, idle splits',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 64, pageTokens: 8 },
      [20, 1, 1, 1, 1, 1, 1],
      8,
      {
        minChunkKeys: 5,
      },
    ],
    // prefill split over keys too: query tiles whose causal end falls before a split's start leave it empty.
    [
      'prefill, 4 splits of >= 6 keys',
      { layers: 2, heads: 6, kvHeads: 2, headDim: 64, pageTokens: 4 },
      [9, 13, 1, 7, 1],
      3,
      {
        prefillSplits: 4,
        minChunkKeys: 6,
      },
    ],
    [
      'prefill, 3 splits, hd 128',
      { layers: 1, heads: 4, kvHeads: 1, headDim: 128, pageTokens: 8 },
      [17, 5, 1, 11],
      2,
      {
        prefillSplits: 3,
        minChunkKeys: 4,
      },
    ],
  ])('with a minimum chunk per split matches the CPU reference: %s', async (_name, shape, chunks, splits, more) => {
    const { ratios } = await runSteps(ctx.gpu, shape, chunks, chunks.length * 17 + shape.headDim, splits, more);
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  it('keeps working while the pool grows by slabs under prepared dispatches', async () => {
    const shape = { layers: 2, heads: 4, kvHeads: 2, headDim: 8, pageTokens: 4, slabPages: 2 };
    const { ratios, slabs } = await runSteps(ctx.gpu, shape, [6, 5, 1, 1, 1, 1], 7, 4);
    expect(slabs).toBeGreaterThan(1);
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  it('reads shared pages of forked sequences and copies them on write', async () => {
    const { gpu } = ctx;
    const shape = { layers: 2, heads: 4, kvHeads: 1, headDim: 64, pageTokens: 8 };
    const harness = new Harness(gpu, shape, 21, { decodeSplits: 4 });
    const random = seededRandom(99);
    const a = harness.sequence();
    const ratios = [await harness.step(a, 21, random)];
    const b = harness.fork(a);
    const usedAfterFork = harness.pool.stats().pagesUsed;
    expect(usedAfterFork).toBe(4); // a: 3 pages; b shares 2 full pages and copies the partial third
    ratios.push(await harness.step(b, 1, random), await harness.step(a, 1, random), await harness.step(b, 3, random));
    // Roll a back into a shared page and rewrite: a gets its own copy, b still reads the original.
    harness.truncate(a, 10);
    ratios.push(await harness.step(a, 4, random), await harness.step(b, 1, random), await harness.step(a, 1, random));
    const c = harness.fork(b);
    harness.pool.free(b);
    harness.history.delete(b);
    ratios.push(await harness.step(c, 1, random), await harness.step(a, 1, random));
    expect(harness.pool.audit()).toEqual([]);
    harness.release();
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  it('runs prefill with a split pass and merge too', async () => {
    const { gpu } = ctx;
    const harness = new Harness(gpu, { layers: 1, heads: 4, kvHeads: 2, headDim: 64, pageTokens: 4 }, 6, {
      prefillSplits: 3,
      decodeSplits: 1,
    });
    const random = seededRandom(5);
    const seq = harness.sequence();
    const ratios = [await harness.step(seq, 6, random), await harness.step(seq, 5, random)];
    ratios.push(await harness.step(seq, 1, random), await harness.step(seq, 1, random));
    harness.release();
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  // Prefill graphs merge with attentionMergeRowsSource where a workgroup holds whole rows and the grid fits; else
  // with the decode graphs' merge.
  it.each<[string, Shape, Partial<GpuContext['limits']>, string, number?]>([
    [
      'hd 64: the rows merge',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 64, pageTokens: 4 },
      {},
      'attention-merge-rows',
    ],
    [
      'hd 48 (does not divide 128): the decode merge',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 48, pageTokens: 4 },
      {},
      'attention-merge',
    ],
    [
      'hd 64, a grid over the workgroup limit: the decode merge',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 64, pageTokens: 4 },
      { maxComputeWorkgroupsPerDimension: 8 },
      'attention-merge',
    ],
    // splitRows 20: the 6-token step (24 rows) takes 1 split, the 5-token one (20 rows) 1, the 2-token one (8) 3.
    [
      'hd 64, a grid over the workgroup limit, splits by step: the decode merge',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 64, pageTokens: 4 },
      { maxComputeWorkgroupsPerDimension: 8 },
      'attention-merge',
      20,
    ],
    [
      'hd 256 (wider than the rows merge): the wide merge',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 256, pageTokens: 4 },
      {},
      'attention-merge-wide',
    ],
    [
      'hd 64, splits by step: the rows merge',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 64, pageTokens: 4 },
      {},
      'attention-merge-rows',
      20,
    ],
  ])('merges prefill splits: %s', async (_name, shape, limits, mergeLabel, prefillSplitRows = 0) => {
    const gpu = withLimits(ctx.gpu, limits);
    const harness = new Harness(gpu, shape, 6, {
      prefillSplits: 3,
      prefillSplitRows,
      minChunkKeys: 2,
      decodeSplits: 1,
    });
    expect(harness.prefill.filter((d) => d.label.endsWith('.merge')).map((d) => d.pipeline.label)).toEqual([
      mergeLabel,
    ]);
    const random = seededRandom(8);
    const seq = harness.sequence();
    const ratios = [];
    for (const tokens of [6, 5, 2]) ratios.push(await harness.step(seq, tokens, random));
    harness.release();
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  it('catches a broken rows merge: without the rescale', async () => {
    const original = attentionMergeRowsSource();
    const merge = original.replace('exp(partials[at] - best)', '1.0');
    expect(merge).not.toBe(original);
    const shape = { layers: 1, heads: 4, kvHeads: 2, headDim: 64, pageTokens: 4 };
    // Prefill steps only: the override would replace the decode graphs' merge too.
    const harness = new Harness(ctx.gpu, shape, 6, { prefillSplits: 3, minChunkKeys: 2, sources: { merge } });
    const random = seededRandom(9);
    const seq = harness.sequence();
    const ratios = [await harness.step(seq, 6, random), await harness.step(seq, 5, random)];
    harness.release();
    expect(Math.max(...ratios)).toBeGreaterThan(1);
  });

  it.each<[string, AttentionSources, number]>([
    [
      'causal mask off by one query',
      {
        partial: attentionPartialSource({ quant: false, blockKeys: 16, headDim: 8, rows: 16 }).replace(
          'block + j <= step.position + row / group',
          'block + j <= step.position',
        ),
      },
      1,
    ],
    [
      'merge without the rescale',
      {
        merge: attentionMergeWgsl.replace('exp(m - best)', '1.0'),
      },
      4,
    ],
  ])('catches a broken kernel: %s', async (_name, sources, decodeSplits) => {
    const { gpu } = ctx;
    const original = attentionPartialSource({ quant: false, blockKeys: 16, headDim: 8, rows: 16 });
    const changed = (sources.partial ?? original) + (sources.merge ?? attentionMergeWgsl);
    expect(changed).not.toBe(original + attentionMergeWgsl);
    const shape = { layers: 1, heads: 2, kvHeads: 1, headDim: 8, pageTokens: 4 };
    const harness = new Harness(gpu, shape, 6, { decodeSplits, sources, blockKeys: 16 });
    const random = seededRandom(3);
    const seq = harness.sequence();
    const ratios = [await harness.step(seq, 6, random), await harness.step(seq, 1, random)];
    harness.release();
    expect(Math.max(...ratios)).toBeGreaterThan(1);
  });
});

// Heads of 256 dims (Falcon3, Gemma): the split kernel with at most 4 rows a tile, the merge's wide build, and tiles of
// 8 keys on a device with WebGPU's default 16 KiB of workgroup memory.
describe('heads of 256 dims', () => {
  const hd256: Shape = { layers: 1, heads: 4, kvHeads: 2, headDim: 256, pageTokens: 8 };
  const small = { maxComputeWorkgroupStorageSize: 16384 };

  it.each<[string, Shape, number[], number, Partial<GpuContext['limits']>]>([
    ['2:1, decode and prefill over 3 splits (the wide merge)', hd256, [9, 1, 1, 7, 1], 3, {}],
    ['4:1, rows of two tiles, decode over 32 splits', { ...hd256, heads: 8 }, [21, 1, 1, 1], 32, {}],
    ['2:1, tiles of 8 keys on a 16 KiB device', hd256, [19, 1, 1, 6, 1], 3, small],
  ])('match the CPU reference: %s', async (_name, shape, chunks, splits, limits) => {
    const { ratios } = await runSteps(withLimits(ctx.gpu, limits), shape, chunks, 256 + chunks.length, splits);
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  it('take tiles of 16 keys, or of 8 where 16 do not fit the workgroup memory; the wide merge', () => {
    const graph = { maxTokens: 1, heads: 4, kvHeads: 2, headDim: 256, quant: null, keysInt8Bytes: 0 };
    const plan = planAttentionKernel(ctx.gpu, graph);
    expect(plan.kernel === 'split' && plan.shape).toMatchObject({ blockKeys: 16, headDim: 256, rows: 2 });
    const onSmall = planAttentionKernel(withLimits(ctx.gpu, small), graph);
    expect(onSmall.kernel === 'split' && onSmall.shape).toMatchObject({ blockKeys: 8, headDim: 256, rows: 2 });
    expect(attentionWorkgroupBytes({ quant: true, blockKeys: 8, headDim: 256, rows: 4 })).toBeLessThanOrEqual(16384);
    // The narrow build stays the one heads of up to 128 dims take; the wide one serves 256.
    expect(attentionMergeSource(false, true)).toContain('array<f32, 2048>');
    expect(attentionMergeSource(false)).toBe(attentionMergeWgsl);
  });

  // The rotated cache's decode output, un-rotated by the wide merge (rowProductWgsl with Rᵀ): the plain output times Rᵀ,
  // with matrices that are not symmetric (a symmetric one would hide a product with R instead).
  it('the wide merge un-rotates the decode output by each KV head’s matrix transposed', async () => {
    const { gpu } = ctx;
    const { heads, kvHeads, headDim: d } = hd256;
    const harness = new Harness(gpu, hd256, 9, { decodeSplits: 4 });
    const random = seededRandom(256);
    const matrices = Float32Array.from({ length: kvHeads * d * d }, () => random() * 2 - 1);
    const rotation = gpu.allocator.createStorage('test.rotation', 'scratch', matrices);
    const output = gpu.allocator.createStorage('test.rotated', 'scratch', heads * d * 4);
    const rotated = prepareAttention(gpu, 'rotated', {
      pool: harness.pool,
      layer: 0,
      q: harness.q,
      output,
      heads,
      scale: 1 / Math.sqrt(d),
      maxTokens: 1,
      splits: 4,
      outputRotation: { matrices: rotation, firstMatrix: 0, headsPerMatrix: heads / kvHeads },
    });
    expect(rotated.at(-1)?.pipeline.label).toBe('attention-merge-rotated-wide');
    const seq = harness.sequence();
    const ratios = [await harness.step(seq, 9, random), await harness.step(seq, 1, random)];
    submitDispatches(gpu, 'rotated', rotated);
    const plain = await readFloat32(gpu, harness.out[0], heads * d);
    const actual = await readFloat32(gpu, output, heads * d);
    let worst = 0;
    for (let h = 0; h < heads; h++) {
      const m = Math.floor(h / (heads / kvHeads)) * d * d;
      for (let j = 0; j < d; j++) {
        let expected = 0;
        for (let i = 0; i < d; i++) expected += plain[h * d + i] * matrices[m + j * d + i];
        worst = Math.max(worst, Math.abs(actual[h * d + j] - expected) / (1e-4 + 1e-4 * Math.abs(expected)));
      }
    }
    releaseDispatches(gpu, rotated);
    for (const b of [rotation, output]) gpu.allocator.release(b);
    harness.release();
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
    expect(worst).toBeLessThanOrEqual(1);
  });

  it('catches a broken wide merge: the narrow one (4 dims an invocation)', async () => {
    const sources = { merge: attentionMergeSource(false, true).replaceAll('k < 8u', 'k < 4u') };
    expect(sources.merge).not.toBe(attentionMergeSource(false, true));
    const harness = new Harness(ctx.gpu, hd256, 6, { decodeSplits: 4, sources });
    const random = seededRandom(3);
    const seq = harness.sequence();
    const ratios = [await harness.step(seq, 6, random), await harness.step(seq, 1, random)];
    harness.release();
    expect(Math.max(...ratios)).toBeGreaterThan(1);
  });
});

describe('decode kernel', () => {
  // Decode graphs of these shapes run attention-decode.wgsl.ts; each case checks that they do. One split makes a
  // workgroup walk every key in passes of 256 (128 for 16 rows), so the running max and the rescale between passes
  // are exercised; several splits go through the merge pass.
  const cases: Array<[string, Shape, number[], number]> = [
    [
      'hd 64, 7:1 (Qwen2.5-0.5B), one split, 2 passes',
      { layers: 1, heads: 14, kvHeads: 2, headDim: 64, pageTokens: 16 },
      [300, 1, 1],
      1,
    ],
    ['hd 64, 7:1, 3 splits', { layers: 1, heads: 14, kvHeads: 2, headDim: 64, pageTokens: 16 }, [300, 1, 1], 3],
    [
      'hd 32, 12:1, one split, passes of 128',
      { layers: 1, heads: 12, kvHeads: 1, headDim: 32, pageTokens: 4 },
      [150, 1],
      1,
    ],
    [
      'hd 128, 8:1, 2 splits, pages of 8',
      { layers: 2, heads: 8, kvHeads: 1, headDim: 128, pageTokens: 8 },
      [150, 1, 1],
      2,
    ],
  ];
  it.each(cases)('matches the CPU reference: %s', async (_name, shape, chunks, splits) => {
    const pool = { headDim: shape.headDim, kvHeads: shape.kvHeads, quant: null } as never;
    expect(attentionDecodeShape(ctx.gpu, { pool, layer: 0, heads: shape.heads, maxTokens: 1 })).not.toBeNull();
    const { ratios } = await runSteps(ctx.gpu, shape, chunks, 77 + shape.headDim, splits);
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  it.each<[string, (code: string) => string]>([
    // Without the rescale, a pass whose max exceeds the earlier passes' keeps their terms at the old scale.
    ['no rescale between passes', (code) => code.replace(/sum0 \*= c;[^\n]*/, '')],
    [
      'key slices not summed',
      (code) =>
        code.replace(
          'for (var first = 1u; first < KS; first += SPR) {',
          'for (var first = 1u; first < 1u; first += SPR) {',
        ),
    ],
  ])('catches a broken kernel: %s', async (_name, edit) => {
    const { gpu } = ctx;
    const shape = cases[0][1];
    const original = attentionDecodeSource({
      headDim: 64,
      rows: 7,
      quant: null,
      unrolled: !gpu.adapter.isFallbackAdapter,
      passKeys: 256,
    });
    const decode = edit(original);
    expect(decode).not.toBe(original);
    const harness = new Harness(gpu, shape, 300, { decodeSplits: 1, sources: { decode } });
    const random = seededRandom(77 + 64);
    const seq = harness.sequence();
    const ratios = [await harness.step(seq, 300, random), await harness.step(seq, 1, random)];
    harness.release();
    expect(Math.max(...ratios)).toBeGreaterThan(1);
  });
});

describe('prefill kernel', () => {
  // Prefill graphs of these shapes run attention-prefill.wgsl.ts (each case checks that they do): query tiles that cut
  // a GQA group, partial key tiles, causal ends inside a tile, several pages per tile, splits with empty ones.
  const cases: Array<
    [
      string,
      Shape,
      number[],
      { prefillSplits?: number; prefillSplitRows?: number; minChunkKeys?: number; prefillStorageBytes?: number },
    ]
  > = [
    [
      'hd 64, 4:1, pages of 16, one split',
      { layers: 1, heads: 8, kvHeads: 2, headDim: 64, pageTokens: 16 },
      [70, 45, 1],
      {},
    ],
    [
      'hd 64, 7:1 (Qwen2.5-0.5B), pages of 4, 3 splits of >= 16 keys',
      { layers: 1, heads: 14, kvHeads: 2, headDim: 64, pageTokens: 4 },
      [37, 29, 1],
      { prefillSplits: 3, minChunkKeys: 16 },
    ],
    // WebGPU's default 16 KiB: 16 rows, tiles of 16 keys, half the invocations loading a tile.
    [
      'hd 64, 4:1, the 16-row build, 2 splits',
      { layers: 1, heads: 8, kvHeads: 2, headDim: 64, pageTokens: 16 },
      [37, 45, 1],
      { prefillSplits: 2, minChunkKeys: 16, prefillStorageBytes: 16384 },
    ],
    [
      'hd 128, 8:1, pages of 8, 2 splits',
      { layers: 1, heads: 8, kvHeads: 1, headDim: 128, pageTokens: 8 },
      [41, 23, 1],
      { prefillSplits: 2, minChunkKeys: 8 },
    ],
    // Steps of 70, 20 and 5 tokens of 8 heads take 1, 2 and 4 splits (splitRows 320): records as many apart.
    [
      'hd 64, 4:1, pages of 8, splits by step (1, 2, 4) of >= 16 keys',
      { layers: 1, heads: 8, kvHeads: 2, headDim: 64, pageTokens: 8 },
      [70, 20, 5, 1],
      { prefillSplits: 4, prefillSplitRows: 320, minChunkKeys: 16 },
    ],
  ];
  it.each(cases)('matches the CPU reference: %s', async (_name, shape, chunks, more) => {
    const pool = { headDim: shape.headDim, kvHeads: shape.kvHeads, quant: null } as never;
    const built = attentionPrefillShapeFor(ctx.gpu, { pool, layer: 0, maxTokens: 2, ...more });
    expect(built).not.toBeNull();
    if (more.prefillStorageBytes) expect(built?.rows).toBe(16);
    const { ratios } = await runSteps(ctx.gpu, shape, chunks, 91 + shape.headDim, 4, more);
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  it('takes the largest build the workgroup storage holds, or leaves the step to the split kernel', () => {
    const shape = (headDim: number, bytes: number, quant: DecodeQuantShape | null = null) => {
      const s = attentionPrefillShape(headDim, quant, bytes);
      return s && { rows: s.rows, blockKeys: s.blockKeys, bytes: attentionPrefillWorkgroupBytes(s) };
    };
    expect(shape(64, 49152)).toEqual({ rows: 64, blockKeys: 32, bytes: 46976 }); // H200
    expect(shape(64, 32768)).toEqual({ rows: 32, blockKeys: 32, bytes: 32000 }); // lavapipe, SwiftShader
    expect(shape(64, 16384)).toEqual({ rows: 16, blockKeys: 16, bytes: 14976 }); // WebGPU's default limit
    expect(shape(128, 49152)).toEqual({ rows: 32, blockKeys: 16, bytes: 37824 });
    expect(shape(128, 32768)).toEqual({ rows: 16, blockKeys: 16, bytes: 27264 });
    expect(shape(128, 16384)).toBeNull();
    expect(shape(96, 49152)).toBeNull();
    expect(shape(64, 49152, { kBits: 2, kGroup: 48, vBits: 2, vGroup: 64, rowTokens: 1 })).toBeNull();
  });

  it.each([1, 4])(
    'leaves the split kernel it replaces matching the reference on the same steps (prefillKernel: false): case %i',
    async (at) => {
      const [, shape, chunks, more] = cases[at];
      const split = await runSteps(ctx.gpu, shape, chunks, 5, 4, { ...more, prefillKernel: false });
      expect(Math.max(...split.ratios)).toBeLessThanOrEqual(1);
    },
  );

  it('sizes the partials for the largest step of each split count (splitRows)', () => {
    // 32 heads, up to 8 splits, 8192 split rows: a step of 256 tokens or more takes one split, 255 take two, 32 take
    // all 8. The most records: 1024 tokens' one split each (255 tokens' two are fewer), not 8 splits' worth.
    expect(splitsOfStep(8, 8192, 1024 * 32)).toBe(1);
    expect(splitsOfStep(8, 8192, 256 * 32)).toBe(1);
    expect(splitsOfStep(8, 8192, 255 * 32)).toBe(2);
    expect(splitsOfStep(8, 8192, 32 * 32)).toBe(8);
    expect(splitsOfStep(8, 0, 1024 * 32)).toBe(8);
    const record = 130 * 4;
    expect(attentionPartialsBytes(1024, 32, 8, 128)).toBe(1024 * 32 * 8 * record);
    expect(attentionPartialsBytes(1024, 32, 8, 128, 8192)).toBe(1024 * 32 * record);
    expect(attentionPartialsBytes(200, 32, 8, 128, 8192)).toBe(200 * 32 * 2 * record);
  });

  it.each<[string, (code: string) => string]>([
    ['causal mask one key late', (code) => code.replace('>= limit0)', '> limit0)')],
    ['no rescale between tiles', (code) => code.replace('acc0_0 *= correction;', '')],
    ['row sums of one column only', (code) => code.replaceAll('i < 16u; i++) { total', 'i < 1u; i++) { total')],
  ])('catches a broken kernel: %s', async (_name, edit) => {
    const { gpu } = ctx;
    const [, shape, chunks] = cases[0];
    const prefillShape = attentionPrefillShape(64, null, gpu.limits.maxComputeWorkgroupStorageSize)!;
    const original = attentionPrefillSource(prefillShape);
    const prefill = edit(original);
    expect(prefill).not.toBe(original);
    const harness = new Harness(gpu, shape, Math.max(...chunks), { sources: { prefill } });
    const random = seededRandom(13);
    const seq = harness.sequence();
    const ratios = [await harness.step(seq, chunks[0], random), await harness.step(seq, chunks[1], random)];
    harness.release();
    expect(Math.max(...ratios)).toBeGreaterThan(1);
  });
});

/**
 * Sliding-window layers (Gemma 3's local layers): the query at p sees keys p − window + 1 .. p. Each kernel raises the
 * first key of its split or tile to the window of the tile's first query and masks the rest per row; a split the
 * window leaves empty still writes its record for the merge. Contexts run well past the window, with chunks that
 * straddle it and windows smaller than a page.
 */
describe('sliding window', () => {
  type WindowCase = [string, Shape, number[], number, { window: number } & Parameters<typeof runSteps>[5]];
  const cases: WindowCase[] = [
    [
      'split kernel (decode and prefill), hd 64, 2:1, pages of 4, window 13',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 64, pageTokens: 4 },
      [30, 1, 1, 20, 1],
      3,
      { window: 13, prefillKernel: false, decodeKernel: false, prefillSplits: 3, minChunkKeys: 4 },
    ],
    [
      'decode and prefill kernels, hd 64, 4:1, pages of 16, window 37, prefill over 4 splits',
      { layers: 2, heads: 8, kvHeads: 2, headDim: 64, pageTokens: 16 },
      [70, 1, 45, 1, 1],
      16,
      { window: 37, prefillSplits: 4, minChunkKeys: 8 },
    ],
    [
      'decode and prefill kernels, hd 128, 8:1, window 8 within a page of 16',
      { layers: 1, heads: 8, kvHeads: 1, headDim: 128, pageTokens: 16 },
      [40, 1, 1, 9, 1],
      4,
      { window: 8 },
    ],
    [
      'hd 256 (Gemma 3), 2:1, window 20, decode over 5 splits (the wide merge)',
      { layers: 1, heads: 4, kvHeads: 2, headDim: 256, pageTokens: 8 },
      [50, 1, 1, 13, 1],
      5,
      { window: 20 },
    ],
    [
      'hd 8, 1:1, window 1: each query sees only its own key',
      { layers: 1, heads: 2, kvHeads: 2, headDim: 8, pageTokens: 4 },
      [9, 1, 1, 5],
      2,
      { window: 1 },
    ],
  ];

  it.each(cases)('matches the CPU reference: %s', async (_name, shape, chunks, splits, more) => {
    const { ratios } = await runSteps(ctx.gpu, shape, chunks, 91 + shape.headDim + more.window, splits, more);
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  it('only the windowed builds read a window: without it, every kernel is the WGSL it was before windows', () => {
    const int2 = { kBits: 2, kGroup: 64, vBits: 2, vGroup: 64, rowTokens: 1 } as const;
    const builds: [string, (windowed: boolean) => string][] = [
      ['split', (windowed) => attentionPartialSource({ quant: true, blockKeys: 16, headDim: 64, rows: 4, windowed })],
      [
        'decode',
        (windowed) =>
          attentionDecodeSource({ headDim: 64, rows: 4, quant: int2, unrolled: false, passKeys: 256, windowed }),
      ],
      [
        'prefill',
        (windowed) => attentionPrefillSource({ headDim: 64, rows: 32, blockKeys: 32, quant: null, windowed }),
      ],
      ['prefill-dot', (windowed) => attentionPrefillDotSource({ headDim: 64, quant: int2, unrolled: false, windowed })],
      [
        'prefill-int8',
        (windowed) => attentionPrefillInt8Source({ headDim: 128, quant: null, converted: true, windowed }),
      ],
    ];
    for (const [name, source] of builds) {
      expect([name, source(false).includes('window')]).toEqual([name, false]);
      expect([name, source(true).includes('windowStart(')]).toEqual([name, true]);
    }
  });

  it('the window matters in these cases: the reference without it differs', async () => {
    // The same steps against whole-sequence attention: a window that changed nothing would test nothing.
    const [, shape, chunks, splits, more] = cases[1];
    const harness = new Harness(ctx.gpu, shape, Math.max(...chunks), { decodeSplits: splits, ...more });
    const unwindowed = Object.assign(harness, { window: undefined });
    const random = seededRandom(5);
    const seq = unwindowed.sequence();
    const ratios: number[] = [];
    for (const n of chunks) ratios.push(await unwindowed.step(seq, n, random));
    unwindowed.release();
    expect(Math.max(...ratios)).toBeGreaterThan(1);
  });

  // Each kernel without its per-row window mask (or, in decode, without the raised first key) must fail.
  it.each<[string, RegExp, (code: string) => string, number]>([
    [
      'split kernel: no per-row mask',
      /^attention-partial-/,
      (c) => c.replace(' && block + j >= windowStart(rowPosition)', ''),
      0,
    ],
    [
      'decode kernel: keys before the window',
      /^attention-decode-/,
      (c) => c.replace('max(splitStart, windowStart(step.position))', 'splitStart'),
      1,
    ],
    [
      'prefill kernel: no per-row mask',
      /^attention-prefill-hd/,
      (c) => c.replaceAll(/ \|\| block \+ tc \+ \d+u < first\d+/g, ''),
      1,
    ],
  ])('catches a broken kernel: %s', async (_name, label, edit, at) => {
    const [, shape, chunks, splits, more] = cases[at];
    const broken = mutateShaders(ctx.gpu, { label, edit });
    const { ratios } = await runSteps(broken.gpu, shape, chunks, 91 + shape.headDim + more.window, splits, more);
    expect(broken.mutated.length).toBeGreaterThan(0);
    expect(Math.max(...ratios)).toBeGreaterThan(1);
  });
});

describe('f16 rounding of the reference', () => {
  it.each([
    [1, 0x3c00],
    [-2, 0xc000],
    [65504, 0x7bff],
    [65519, 0x7bff],
    [65520, 0x7c00], // rounds up past the largest half: +Inf
    [1 + 2 ** -11, 0x3c00], // tie: to even
    [1 + 3 * 2 ** -11, 0x3c02], // tie: to even (up)
    [2 ** -14, 0x0400], // smallest normal
    [2 ** -24, 0x0001], // smallest subnormal
    [2 ** -25, 0x0000], // tie: to even (zero)
    [3 * 2 ** -25, 0x0002],
    [-0, 0x8000],
    [Number.POSITIVE_INFINITY, 0x7c00],
  ])('rounds %d to half bits %i', (value, bits) => {
    expect(f16Bits(value)).toBe(bits);
  });

  it('maps every finite half to its own bits', () => {
    let wrong = 0;
    for (let h = 0; h < 0x10000; h++) {
      if ((h & 0x7c00) !== 0x7c00 && f16Bits(f16BitsToNumber(h)) !== h) wrong++;
    }
    expect(wrong).toBe(0);
  });
});
