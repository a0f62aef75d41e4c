/**
 * The engine against llama.cpp (the oracle, CPU build through node-llama-cpp) on random-weight models covering every
 * architecture and weight type: teacher-forced log-probabilities over the whole vocabulary at every position must
 * agree within a per-type tolerance, and greedy choices must agree wherever llama.cpp's top-1/top-2 margin exceeds it.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { seededRandom } from '../../test/random.ts';
import { LlamaReference } from '../../tools/fixtures/llama-reference.ts';
import { fixtureName, type ModelFixtureSpec, writeModelFixture } from '../../tools/fixtures/model-fixtures.ts';
import { Engine } from '../engine/engine.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { GgmlType } from '../gguf/types.ts';

/**
 * Max |Δ log p| allowed over every token of every position, per weight type. Our engine keeps activations in f32;
 * llama.cpp's CPU matmul converts them to the weight type's "vec_dot" type first, and its attention rounds q and
 * the softmax to f16 (K/V are f16 in both). Logits here have std ≈ 4, so a relative error ε in the hidden state
 * moves log-probs by ≈ 4ε (rms), and the max over 16 × ~300 values is ≈ 4 rms.
 * - F32: only the f16 rounding inside llama.cpp's attention (2^-11 relative) and summation order: 0.02.
 * - F16: activations rounded to f16 as well (rms 2^-12 relative per element): 0.02.
 * - BF16: activations rounded to bf16 (8-bit mantissa, rms ≈ 2^-9 relative per matmul input, 7 matmuls a layer): 0.1.
 * - Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: activations quantized to int8 per 32 values (Q8_0/Q8_1), rms error ≈ 0.5% of the
 *   activations' std per matmul: 0.25.
 * - Q4_K, Q5_K, Q6_K: activations quantized to int8 per 256 values (Q8_K), the scale set by a larger maximum, so
 *   ≈ 0.6% per matmul: 0.3.
 */
const TOLERANCE: Partial<Record<GgmlType, number>> = {
  [GgmlType.F32]: 0.02,
  [GgmlType.F16]: 0.02,
  [GgmlType.BF16]: 0.1,
  [GgmlType.Q8_0]: 0.25,
  [GgmlType.Q4_0]: 0.25,
  [GgmlType.Q4_1]: 0.25,
  [GgmlType.Q5_0]: 0.25,
  [GgmlType.Q5_1]: 0.25,
  [GgmlType.Q4_K]: 0.3,
  [GgmlType.Q5_K]: 0.3,
  [GgmlType.Q6_K]: 0.3,
};

type Shape = Omit<ModelFixtureSpec, 'weightType' | 'architecture' | 'seed'>;
const base = { layers: 2, vocab: 300, ropeFreqBase: 10000, llama3RopeFreqs: false, tiedOutput: false } as const;

/**
 * Every architecture and weight type at least once; head_dim 64 and 128; GQA 1:1, 2:1 and 4:1; tied and separate
 * output; Llama 3 rope_freqs; qwen3 with heads × head_dim ≠ dim; a K-quant model whose ffn_down rows (384) are not a
 * multiple of 256 and fall back to a 32-block type as llama.cpp's K-quant recipes do.
 */
const FIXTURES: ModelFixtureSpec[] = [
  fixture('llama', GgmlType.F32, {
    ...base,
    dim: 128,
    heads: 2,
    kvHeads: 2,
    headDim: 64,
    ffnDim: 256,
    llama3RopeFreqs: true,
  }),
  fixture('qwen2', GgmlType.F32, {
    ...base,
    dim: 256,
    heads: 4,
    kvHeads: 1,
    headDim: 64,
    ffnDim: 256,
    ropeFreqBase: 1e6,
  }),
  fixture('qwen3', GgmlType.F32, {
    ...base,
    dim: 256,
    heads: 4,
    kvHeads: 1,
    headDim: 128,
    ffnDim: 256,
    tiedOutput: true,
  }),
  fixture('qwen2', GgmlType.F16, {
    ...base,
    dim: 256,
    heads: 4,
    kvHeads: 1,
    headDim: 64,
    ffnDim: 512,
    tiedOutput: true,
    ropeFreqBase: 1e6,
  }),
  fixture('qwen3', GgmlType.BF16, {
    ...base,
    dim: 128,
    heads: 4,
    kvHeads: 1,
    headDim: 64,
    ffnDim: 256,
    tiedOutput: true,
  }),
  fixture('llama', GgmlType.Q8_0, { ...base, dim: 256, heads: 2, kvHeads: 2, headDim: 128, ffnDim: 512 }),
  fixture('qwen2', GgmlType.Q4_0, { ...base, dim: 256, heads: 4, kvHeads: 4, headDim: 64, ffnDim: 512 }),
  fixture('qwen3', GgmlType.Q4_1, { ...base, dim: 128, heads: 2, kvHeads: 2, headDim: 128, ffnDim: 256 }),
  fixture('llama', GgmlType.Q5_0, {
    ...base,
    dim: 256,
    heads: 4,
    kvHeads: 1,
    headDim: 64,
    ffnDim: 512,
    tiedOutput: true,
    llama3RopeFreqs: true,
  }),
  fixture('qwen2', GgmlType.Q5_1, { ...base, dim: 128, heads: 2, kvHeads: 1, headDim: 64, ffnDim: 256 }),
  fixture('llama', GgmlType.Q4_K, {
    ...base,
    dim: 256,
    heads: 4,
    kvHeads: 1,
    headDim: 64,
    ffnDim: 512,
    llama3RopeFreqs: true,
  }),
  fixture('qwen3', GgmlType.Q5_K, {
    ...base,
    dim: 256,
    heads: 4,
    kvHeads: 1,
    headDim: 128,
    ffnDim: 384,
    tiedOutput: true,
  }),
  fixture('qwen2', GgmlType.Q6_K, {
    ...base,
    dim: 256,
    heads: 2,
    kvHeads: 2,
    headDim: 128,
    ffnDim: 512,
    ropeFreqBase: 1e6,
  }),
];

function fixture(architecture: ModelFixtureSpec['architecture'], weightType: GgmlType, shape: Shape): ModelFixtureSpec {
  return { architecture, weightType, ...shape, seed: 1000 + weightType * 7 + architecture.length };
}

const TOKENS = 16;

/** BOS, then random ids from the whole vocabulary (specials, byte tokens and pieces alike). */
function tokenIds(vocab: number, seed: number): number[] {
  const random = seededRandom(seed);
  return [1, ...Array.from({ length: TOKENS - 1 }, () => Math.floor(random() * vocab))];
}

/** Row-wise log-softmax in f64. */
function logSoftmax(logits: Float32Array, vocab: number): Float64Array {
  const out = new Float64Array(logits.length);
  for (let r = 0; r < logits.length / vocab; r++) {
    const row = logits.subarray(r * vocab, (r + 1) * vocab);
    let max = Number.NEGATIVE_INFINITY;
    for (const v of row) max = Math.max(max, v);
    let sum = 0;
    for (const v of row) sum += Math.exp(v - max);
    const lse = max + Math.log(sum);
    for (let i = 0; i < vocab; i++) out[r * vocab + i] = row[i] - lse;
  }
  return out;
}

function topTwo(row: ArrayLike<number>): { first: number; margin: number } {
  let first = 0;
  for (let i = 1; i < row.length; i++) if (row[i] > row[first]) first = i;
  let second = first === 0 ? 1 : 0;
  for (let i = 0; i < row.length; i++) if (i !== first && row[i] > row[second]) second = i;
  return { first, margin: row[first] - row[second] };
}

interface Comparison {
  maxDiff: number;
  meanDiff: number;
  worst: { position: number; token: number; ours: number; llama: number };
  greedyChecked: number;
  greedyMismatches: { position: number; ours: number; llama: number; llamaMargin: number }[];
  medianMargin: number;
}

function compare(ours: Float64Array, llama: Float32Array, vocab: number, tolerance: number): Comparison {
  let maxDiff = -1;
  let sum = 0;
  let worst = { position: 0, token: 0, ours: 0, llama: 0 };
  const greedyMismatches: Comparison['greedyMismatches'] = [];
  const margins: number[] = [];
  let greedyChecked = 0;
  const positions = llama.length / vocab;
  for (let t = 0; t < positions; t++) {
    for (let i = 0; i < vocab; i++) {
      const a = ours[t * vocab + i];
      const b = llama[t * vocab + i];
      const d = Math.abs(a - b);
      sum += d;
      if (!(d <= maxDiff)) {
        maxDiff = Number.isNaN(d) ? Number.POSITIVE_INFINITY : d;
        worst = { position: t, token: i, ours: a, llama: b };
      }
    }
    const ref = topTwo(llama.subarray(t * vocab, (t + 1) * vocab));
    margins.push(ref.margin);
    if (ref.margin > tolerance) {
      greedyChecked++;
      const mine = topTwo(ours.subarray(t * vocab, (t + 1) * vocab));
      if (mine.first !== ref.first) {
        greedyMismatches.push({ position: t, ours: mine.first, llama: ref.first, llamaMargin: ref.margin });
      }
    }
  }
  margins.sort((x, y) => x - y);
  return {
    maxDiff,
    meanDiff: sum / llama.length,
    worst,
    greedyChecked,
    greedyMismatches,
    medianMargin: margins[Math.floor(margins.length / 2)],
  };
}

const ctx = withTestGpu();

describe('teacher-forced log-probabilities match llama.cpp', () => {
  let reference: LlamaReference;
  let dir: string;
  const report: string[] = [];

  beforeAll(async () => {
    reference = await LlamaReference.create();
    dir = await mkdtemp(join(tmpdir(), 'longtab-oracle-'));
  });
  afterAll(async () => {
    await reference?.dispose();
    if (dir) await rm(dir, { recursive: true });
    if (report.length) console.log(`llama.cpp oracle, max|Δ log p| / mean / tolerance:\n${report.join('\n')}`);
  });

  for (const spec of FIXTURES) {
    const tolerance = TOLERANCE[spec.weightType]!;
    it(`${fixtureName(spec)} within ${tolerance}`, async () => {
      const path = await writeModelFixture(spec, dir);
      const ids = tokenIds(spec.vocab, spec.seed);
      const llama = await reference.teacherForced(path, ids);
      expect(reference.errors).toEqual([]);
      expect(llama.vocab).toBe(spec.vocab);

      const baseline = ctx.gpu.allocator.snapshot().totalBuffers;
      const engine = new Engine(ctx.gpu);
      const source = await sourceFromPath(path);
      let logits: Float32Array;
      try {
        await engine.load(source, { kv: 'f16', kvBudgetBytes: 1 << 20 });
        logits = await engine.teacherForcedLogits(ids);
      } finally {
        engine.unload();
        await source.close?.();
      }
      expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline);
      expect(logits.length).toBe(ids.length * spec.vocab);

      const result = compare(logSoftmax(logits, spec.vocab), llama.logProbs, spec.vocab, tolerance);
      const w = result.worst;
      report.push(
        `  ${fixtureName(spec).padEnd(52)} ${result.maxDiff.toFixed(4)} / ${result.meanDiff.toFixed(4)} / ${tolerance}` +
          ` (worst: pos ${w.position} token ${w.token} ours ${w.ours.toFixed(3)} llama ${w.llama.toFixed(3)};` +
          ` greedy ${result.greedyChecked - result.greedyMismatches.length}/${result.greedyChecked}; median margin ${result.medianMargin.toFixed(2)})`,
      );
      // The fixture must be able to tell a wrong engine from a right one: logits are far from flat.
      expect(result.medianMargin).toBeGreaterThan(tolerance);
      expect(result.greedyMismatches).toEqual([]);
      expect(result.maxDiff).toBeLessThanOrEqual(tolerance);
    });
  }
});
