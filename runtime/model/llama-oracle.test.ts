/**
 * The engine against llama.cpp (the oracle, CPU build through node-llama-cpp) on random-weight models covering every
 * architecture and weight type: teacher-forced log-probabilities over the whole vocabulary at every position must
 * agree within a per-type tolerance, and greedy choices must agree wherever llama.cpp's top-1/top-2 margin exceeds it.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { InvalidRequestError } from '../../core/errors.ts';
import { GGML_TYPE_INFO, GgmlType } from '../../core/gguf-types.ts';
import { dequantize } from '../../kernels/reference/dequantize.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { referenceLogProbs } from '../../test/model-reference.ts';
import { seededRandom } from '../../test/random.ts';
import { LlamaReference } from '../../tools/fixtures/llama-reference.ts';
import {
  fixtureName,
  type ModelFixtureSpec,
  matrixTypeFor,
  randomMatrixBytes,
  writeModelFixture,
} from '../../tools/fixtures/model-fixtures.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';

/**
 * Three comparisons per fixture, each the max |Δ log p| over every token of every position.
 *
 * 1. ModelRunner vs the exact CPU reference (test/model-reference.ts: f64 over the dequantized weights, K/V rounded to f16
 *    as our cache stores them): ENGINE_TOLERANCE, one number for all types, since both compute the same math and
 *    differ only by f32 vs f64 arithmetic on the GPU (measured ≤ 0.001 on every type that runs).
 * 2. ModelRunner vs llama.cpp: LLAMA_TOLERANCE per type, plus the greedy choice wherever llama.cpp's top-1/top-2 margin
 *    exceeds it. llama.cpp's CPU matmul first converts the f32 activations to the weight type's vec_dot type (f16 for
 *    F16, bf16 for BF16, int8 per 32 values for Q4_0..Q8_0, int8 per 256 values for K-quants) and its attention
 *    rounds q and the softmax to f16, so its logits carry that rounding and ours do not. Logits here have std ≈ 4:
 *    an rms relative error ε in the final hidden state moves log-probs by ≈ 4ε rms, the max over 16 × 300 values is
 *    ≈ 4-5× the mean. Each number is the measured exact-reference-vs-llama.cpp difference (the part that is
 *    llama.cpp's own rounding, listed in the report this test logs) with about 1.5× headroom:
 *    F32 ≤ 0.008 measured → 0.02 (only attention's f16 q/softmax); F16 0.014 → 0.03 (f16 activations, 2^-11);
 *    BF16 0.086 → 0.15 (bf16 activations, 2^-8); Q8_0 0.20, Q4_0 0.11, Q4_1 0.20, Q5_0 0.30, Q5_1 0.18 → 0.5 (int8
 *    per 32: ≈ 0.5% of the activations' std per matmul), IQ4_NL 0.23 → 0.5 (int8 per 32); Q4_K 0.41, Q5_K 0.49,
 *    Q6_K 0.55, Q2_K 0.36, Q3_K 0.58, IQ4_XS 0.36 → 0.8 (int8 per 256, the scale set by the largest of 256 values,
 *    K-quant models here also have larger logit margins).
 * 3. The CPU reference with llama.cpp's activation rounding emulated (f16/bf16/Q8_0/Q8_1 with its f16 block sum/Q8_K,
 *    f16 q and softmax in attention) vs llama.cpp. Asserted for F32, F16 and BF16 (EMULATION_TOLERANCE), where it
 *    shows that (2)'s differences are llama.cpp's rounding and not a mistake our reference and engine share. For the
 *    quantized types it is reported only: it reproduces llama.cpp bit for bit at most positions (Q8_0, Q6_K, Q3_K,
 *    IQ4_NL and IQ4_XS here at all of them), but from isolated positions on llama.cpp differs by up to ~0.2 (up to 0.4 for the Q5_K model).
 *    The cause is not identified: one dot product with ggml's own quantize_row_q8_* and vec_dot (called directly)
 *    matches the emulation exactly, so it is a kernel-path difference inside llama.cpp's matmuls (repacked or tiled
 *    x86 kernels), and which kernels run depends on the CPU.
 */
const ENGINE_TOLERANCE = 0.005;

const LLAMA_TOLERANCE: Partial<Record<GgmlType, number>> = {
  [GgmlType.F32]: 0.02,
  [GgmlType.F16]: 0.03,
  [GgmlType.BF16]: 0.15,
  [GgmlType.Q8_0]: 0.5,
  [GgmlType.Q4_0]: 0.5,
  [GgmlType.Q4_1]: 0.5,
  [GgmlType.Q5_0]: 0.5,
  [GgmlType.Q5_1]: 0.5,
  [GgmlType.Q4_K]: 0.8,
  [GgmlType.Q5_K]: 0.8,
  [GgmlType.Q6_K]: 0.8,
  [GgmlType.Q2_K]: 0.8,
  [GgmlType.Q3_K]: 0.8,
  [GgmlType.IQ4_NL]: 0.5,
  [GgmlType.IQ4_XS]: 0.8,
};

/** Measured: F32 ≤ 0.0044, F16 0.0062, BF16 0.032 (single positions; means ≤ 0.0015). */
const EMULATION_TOLERANCE: Partial<Record<GgmlType, number>> = {
  [GgmlType.F32]: 0.01,
  [GgmlType.F16]: 0.015,
  [GgmlType.BF16]: 0.05,
};

type Shape = Omit<ModelFixtureSpec, 'weightType' | 'architecture' | 'seed'>;
const base = { layers: 2, vocab: 300, ropeFreqBase: 10000, llama3RopeFreqs: false, tiedOutput: false } as const;

/** The variant fixtures' shared shape. */
const variant = { ...base, dim: 128, heads: 2, headDim: 64, ffnDim: 256 } as const;
/** RoPE scaling (linear, the older scale_linear key, YaRN) on each architecture, and the biases llama.cpp reads. */
const VARIANT_FIXTURES: ModelFixtureSpec[] = [
  fixture('llama', GgmlType.F32, {
    ...variant,
    kvHeads: 1,
    ropeScaling: { type: 'linear', factor: 4, legacyKey: true },
    biases: ['q', 'k', 'v', 'o', 'gate', 'up', 'down'],
  }),
  fixture('llama', GgmlType.F32, {
    ...variant,
    kvHeads: 2,
    tiedOutput: true,
    ropeScaling: { type: 'yarn', factor: 8, originalContext: 256, attnFactor: 0.9 },
  }),
  fixture('qwen2', GgmlType.F32, {
    ...variant,
    kvHeads: 1,
    ropeScaling: { type: 'linear', factor: 2 },
    biases: ['output'],
  }),
  // No original context: YaRN's is the context length (256), as in llama.cpp.
  fixture('qwen2', GgmlType.F32, {
    ...variant,
    kvHeads: 2,
    ropeScaling: { type: 'yarn', factor: 4 },
  }),
  fixture('qwen3', GgmlType.F32, {
    ...variant,
    kvHeads: 1,
    tiedOutput: true,
    ropeScaling: { type: 'yarn', factor: 4, originalContext: 512, attnFactor: 1.2 },
    biases: ['q', 'k', 'v'],
  }),
  fixture('qwen3', GgmlType.F32, {
    ...variant,
    kvHeads: 1,
    ropeScaling: { type: 'linear', factor: 8 },
  }),
].map((spec, i) => ({ ...spec, seed: spec.seed + 100 * (i + 1) }));

/**
 * Every architecture and weight type at least once; head_dim 64, 128 and 256; GQA 1:1, 2:1 and 4:1; tied and separate
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
  // The low-bit files users download (issue 43): Q2_K and IQ4_XS models whose ffn_down rows (384) fall back to Q4_0
  // and IQ4_NL as llama.cpp's recipes do for Qwen2.5-0.5B's 896-wide rows.
  fixture('llama', GgmlType.Q2_K, { ...base, dim: 256, heads: 2, kvHeads: 2, headDim: 128, ffnDim: 384 }),
  fixture('qwen3', GgmlType.Q3_K, { ...base, dim: 256, heads: 4, kvHeads: 1, headDim: 64, ffnDim: 512 }),
  fixture('llama', GgmlType.IQ4_NL, { ...base, dim: 128, heads: 2, kvHeads: 1, headDim: 64, ffnDim: 256 }),
  fixture('qwen2', GgmlType.IQ4_XS, { ...base, dim: 256, heads: 4, kvHeads: 2, headDim: 64, ffnDim: 384 }),
  // Heads of 256 dims (issue 43): Falcon3's llama files (its RoPE base too), and qwen3's q/k norms over such heads.
  fixture('llama', GgmlType.Q8_0, {
    ...base,
    dim: 512,
    heads: 2,
    kvHeads: 1,
    headDim: 256,
    ffnDim: 512,
    ropeFreqBase: 1000042,
  }),
  fixture('qwen3', GgmlType.F16, {
    ...base,
    dim: 256,
    heads: 2,
    kvHeads: 1,
    headDim: 256,
    ffnDim: 256,
    tiedOutput: true,
  }),
  // RoPE scaling and optional biases (issue 43): F32 and tiny, so only the variant is measured. YaRN's original
  // contexts are short, so its ramp between kept and interpolated pairs falls inside the head and within 16 tokens.
  ...VARIANT_FIXTURES,
];

/**
 * Gemma 3 (issue 43, point 4): sliding-window local layers between global ones, q/k norms, post-norms, GeGLU, scaled
 * embeddings, heads × head_dim ≠ dim. Contexts run past the window (3-4 windows), so a local layer that saw the whole
 * sequence would answer otherwise (checked: the reference without windows is far from llama.cpp). Each prefills
 * differently: one chunk; chunks of 5 (windows straddle chunks, the last chunk a decode step); every token a decode
 * step. Head sizes 64, 128 and Gemma's 256 (the split kernel), the 1B's one KV head, the 4B's linear RoPE scaling on
 * the global layers only.
 */
const GEMMA_FIXTURES: { spec: ModelFixtureSpec; tokens: number; prefillChunk: number }[] = [
  {
    spec: fixture('gemma3', GgmlType.F32, {
      ...base,
      layers: 3,
      dim: 128,
      heads: 2,
      kvHeads: 1,
      headDim: 64,
      ffnDim: 256,
      slidingWindow: { size: 24, period: 3 },
    }),
    tokens: 80,
    prefillChunk: 128,
  },
  {
    spec: fixture('gemma3', GgmlType.Q8_0, {
      ...base,
      layers: 6,
      dim: 256,
      heads: 4,
      kvHeads: 1,
      headDim: 256,
      ffnDim: 512,
      ropeFreqBase: 1e6,
      ropeScaling: { type: 'linear', factor: 8 },
      slidingWindow: { size: 32 },
    }),
    tokens: 96,
    prefillChunk: 5,
  },
  {
    spec: fixture('gemma3', GgmlType.F16, {
      ...base,
      layers: 2,
      dim: 128,
      heads: 4,
      kvHeads: 2,
      headDim: 128,
      ffnDim: 256,
      tiedOutput: true,
      slidingWindow: { size: 16, period: 2, ropeBase: 20000 },
    }),
    tokens: 48,
    prefillChunk: 1,
  },
];

/**
 * SmolLM3 (issue 43, point 4): llama's layers, but every 4th (3, 7, …) attends without RoPE (llama.cpp's smollm3 graph,
 * n_no_rope_layer_step = 4). Eight layers, so two of them skip it, one of them the last; 48 tokens, so the
 * positions RoPE would give the no-RoPE layers' q and k move the logits (checked: the reference with RoPE in every
 * layer is far from llama.cpp). Prefilled in one chunk, in chunks of 5, and one decode step at a time; GQA 4:1 and
 * 1:1, f32 and quantized weights, tied and separate output, and the q/k/v biases llama.cpp's loader reads.
 */
const SMOLLM3_FIXTURES: { spec: ModelFixtureSpec; tokens: number; prefillChunk: number }[] = [
  {
    spec: fixture('smollm3', GgmlType.F32, {
      ...base,
      layers: 8,
      dim: 128,
      heads: 4,
      kvHeads: 1,
      headDim: 32,
      ffnDim: 256,
      tiedOutput: true,
      ropeFreqBase: 5e6,
    }),
    tokens: 48,
    prefillChunk: 128,
  },
  {
    spec: fixture('smollm3', GgmlType.Q8_0, {
      ...base,
      layers: 4,
      dim: 256,
      heads: 4,
      kvHeads: 1,
      headDim: 64,
      ffnDim: 512,
    }),
    tokens: 48,
    prefillChunk: 5,
  },
  {
    spec: fixture('smollm3', GgmlType.F16, {
      ...base,
      layers: 4,
      dim: 128,
      heads: 2,
      kvHeads: 2,
      headDim: 64,
      ffnDim: 256,
      biases: ['q', 'k', 'v'],
    }),
    tokens: 32,
    prefillChunk: 1,
  },
];

/**
 * Phi-3 / Phi-4-mini (issue 43, point 4): q, k, v fused in attn_qkv and gate, up in ffn_up (split by rows at load),
 * NEOX RoPE on part of each head (Phi-4-mini rotates 96 of 128 dims), LongRoPE factors: the long set where the
 * context exceeds the original one (here 4096 > 32, in llama.cpp and in the engine), the short set where it does not
 * (original 4096), with the converter's attention factor; one model without factors and with a sliding-window key
 * llama.cpp ignores. 48 tokens, so angles that wrong factors or wrongly rotated dims give move the logits (the test
 * asserts the reference with the other set, with no factors and rotating every dim is far from llama.cpp). One chunk,
 * chunks of 5, one decode step at a time.
 */
const PHI3_FIXTURES: { spec: ModelFixtureSpec; tokens: number; prefillChunk: number }[] = [
  {
    spec: fixture('phi3', GgmlType.F32, {
      ...base,
      layers: 3,
      dim: 128,
      heads: 2,
      kvHeads: 2,
      headDim: 64,
      ropeDim: 48,
      ffnDim: 256,
      contextLength: 4096,
      longRope: { originalContext: 32, attnFactor: 1.19 },
    }),
    tokens: 48,
    prefillChunk: 128,
  },
  {
    spec: fixture('phi3', GgmlType.Q8_0, {
      ...base,
      layers: 2,
      dim: 256,
      heads: 4,
      kvHeads: 1,
      headDim: 64,
      ropeDim: 32,
      ffnDim: 512,
      tiedOutput: true,
      contextLength: 4096,
      longRope: { originalContext: 4096, attnFactor: 1.1 },
    }),
    tokens: 48,
    prefillChunk: 5,
  },
  {
    spec: fixture('phi3', GgmlType.F16, {
      ...base,
      layers: 2,
      dim: 128,
      heads: 4,
      kvHeads: 2,
      headDim: 32,
      ropeDim: 24,
      ffnDim: 256,
      slidingWindow: { size: 16 },
    }),
    tokens: 32,
    prefillChunk: 1,
  },
];

function fixture(architecture: ModelFixtureSpec['architecture'], weightType: GgmlType, shape: Shape): ModelFixtureSpec {
  return { architecture, weightType, ...shape, seed: 1000 + weightType * 7 + architecture.length };
}

const TOKENS = 16;

/** BOS, then random ids from the whole vocabulary (specials, byte tokens and pieces alike). */
function tokenIds(vocab: number, seed: number, tokens = TOKENS): number[] {
  const random = seededRandom(seed);
  return [1, ...Array.from({ length: tokens - 1 }, () => Math.floor(random() * vocab))];
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

function compare(ours: ArrayLike<number>, llama: ArrayLike<number>, vocab: number, tolerance: number): Comparison {
  let maxDiff = -1;
  let sum = 0;
  let worst = { position: 0, token: 0, ours: 0, llama: 0 };
  const greedyMismatches: Comparison['greedyMismatches'] = [];
  const margins: number[] = [];
  let greedyChecked = 0;
  const positions = llama.length / vocab;
  const row = (values: ArrayLike<number>, t: number) => Array.from({ length: vocab }, (_, i) => values[t * vocab + i]);
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
    const ref = topTwo(row(llama, t));
    margins.push(ref.margin);
    if (ref.margin > tolerance) {
      greedyChecked++;
      const mine = topTwo(row(ours, t));
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

function describeWorst(c: Comparison): string {
  const w = c.worst;
  return `${c.maxDiff.toFixed(4)} (mean ${c.meanDiff.toFixed(4)}; pos ${w.position} token ${w.token}: ${w.ours.toFixed(3)} vs ${w.llama.toFixed(3)})`;
}

const ctx = withTestGpu();

describe('model fixtures', () => {
  it('dequantize to the intended scale in every type, K-quant rows of 384 falling back to a 32-block type', () => {
    const random = seededRandom(7);
    for (const type of Object.keys(LLAMA_TOLERANCE).map(Number) as GgmlType[]) {
      const k = 256;
      const values = dequantize(type, randomMatrixBytes(type, k, 64, 1 / 16, random), k * 64);
      let sum = 0;
      let squares = 0;
      for (const v of values) {
        sum += v;
        squares += v * v;
      }
      const mean = sum / values.length;
      const std = Math.sqrt(squares / values.length - mean * mean);
      expect(std * 16, GGML_TYPE_INFO[type]?.name).toBeGreaterThan(0.9);
      expect(std * 16, GGML_TYPE_INFO[type]?.name).toBeLessThan(1.1);
      expect(values.every(Number.isFinite)).toBe(true);
    }
    expect(matrixTypeFor(GgmlType.Q4_K, 384)).toBe(GgmlType.Q5_0);
    expect(matrixTypeFor(GgmlType.Q5_K, 384)).toBe(GgmlType.Q5_1);
    expect(matrixTypeFor(GgmlType.Q6_K, 384)).toBe(GgmlType.Q8_0);
    expect(matrixTypeFor(GgmlType.Q2_K, 384)).toBe(GgmlType.Q4_0);
    expect(matrixTypeFor(GgmlType.Q3_K, 384)).toBe(GgmlType.Q4_0);
    expect(matrixTypeFor(GgmlType.IQ4_XS, 384)).toBe(GgmlType.IQ4_NL);
    expect(matrixTypeFor(GgmlType.Q4_K, 512)).toBe(GgmlType.Q4_K);
    expect(() => matrixTypeFor(GgmlType.Q8_0, 48)).toThrow(InvalidRequestError);
  });
});

describe('teacher-forced log-probabilities match llama.cpp', () => {
  let llamaCpp: LlamaReference;
  let dir: string;
  const report: string[] = [];

  beforeAll(async () => {
    llamaCpp = await LlamaReference.create();
    dir = await mkdtemp(join(tmpdir(), 'longtab-oracle-'));
  });
  afterAll(async () => {
    await llamaCpp?.dispose();
    if (dir) await rm(dir, { recursive: true });
    if (report.length) console.log(`llama.cpp oracle, max |Δ log p|:\n${report.join('\n')}`);
  });

  /**
   * The fixture's three comparisons (the file's head comment). `windowless`: also the reference with every layer
   * attending to the whole sequence, which must be far from llama.cpp (the sliding window matters in the fixture);
   * `ropeEveryLayer`, likewise the reference with RoPE in SmolLM3's no-RoPE layers.
   */
  async function check(
    spec: ModelFixtureSpec,
    prefillChunk: number,
    tokens = TOKENS,
    { windowless = false, ropeEveryLayer = false, phi3Rope = false } = {},
  ) {
    const llamaTolerance = LLAMA_TOLERANCE[spec.weightType]!;
    const emulationTolerance = EMULATION_TOLERANCE[spec.weightType];
    const path = await writeModelFixture(spec, dir);
    const ids = tokenIds(spec.vocab, spec.seed, tokens);
    const llama = await llamaCpp.teacherForced(path, ids);
    expect(llamaCpp.errors).toEqual([]);
    expect(llama.vocab).toBe(spec.vocab);
    const exact = await referenceLogProbs(path, ids, { emulateLlamaCpp: false });
    const emulated = await referenceLogProbs(path, ids, { emulateLlamaCpp: true });
    const lines = [`  ${fixtureName(spec)}, ${tokens} tokens, prefill chunk ${prefillChunk}`];
    const emulation = compare(emulated, llama.logProbs, spec.vocab, llamaTolerance);
    const inherent = compare(exact, llama.logProbs, spec.vocab, llamaTolerance);
    lines.push(
      `    reference (llama.cpp rounding) vs llama.cpp: ${describeWorst(emulation)} / ${emulationTolerance ?? 'reported only'}`,
    );
    lines.push(`    exact reference vs llama.cpp:                ${describeWorst(inherent)}`);
    const unwindowed = windowless
      ? compare(
          await referenceLogProbs(path, ids, { emulateLlamaCpp: false, ignoreSlidingWindow: true }),
          llama.logProbs,
          spec.vocab,
          llamaTolerance,
        )
      : null;
    if (unwindowed) {
      lines.push(
        `    reference without windows vs llama.cpp:      ${describeWorst(unwindowed)}; greedy ${unwindowed.greedyChecked - unwindowed.greedyMismatches.length}/${unwindowed.greedyChecked}`,
      );
    }
    const allRoped = ropeEveryLayer
      ? compare(
          await referenceLogProbs(path, ids, { emulateLlamaCpp: false, ropeEveryLayer: true }),
          llama.logProbs,
          spec.vocab,
          llamaTolerance,
        )
      : null;
    if (allRoped) {
      lines.push(
        `    reference with RoPE in every layer vs llama.cpp: ${describeWorst(allRoped)}; greedy ${allRoped.greedyChecked - allRoped.greedyMismatches.length}/${allRoped.greedyChecked}`,
      );
    }
    // phi3: the reference with the LongRoPE set llama.cpp does not pick (or none where the file has none, then the
    // short set's absence is moot) and the one rotating every dim of the head.
    const otherFactors = spec.longRope
      ? spec.longRope.originalContext < (spec.contextLength ?? 256)
        ? 'short'
        : 'long'
      : null;
    const contrasts = phi3Rope
      ? [
          ...(otherFactors
            ? [
                { name: `the ${otherFactors} LongRoPE factors`, options: { longRopeFactors: otherFactors } as const },
                { name: 'no LongRoPE factors', options: { longRopeFactors: 'none' } as const },
              ]
            : []),
          { name: 'every dim rotated', options: { rotateAllDims: true } },
        ]
      : [];
    const wrongRope: Comparison[] = [];
    for (const { name, options } of contrasts) {
      const c = compare(
        await referenceLogProbs(path, ids, { emulateLlamaCpp: false, ...options }),
        llama.logProbs,
        spec.vocab,
        llamaTolerance,
      );
      wrongRope.push(c);
      lines.push(
        `    reference with ${name} vs llama.cpp: ${describeWorst(c)}; greedy ${c.greedyChecked - c.greedyMismatches.length}/${c.greedyChecked}`,
      );
    }
    report.push(...lines);

    const baseline = ctx.gpu.allocator.snapshot().totalBuffers;
    const engine = new ModelRunner(ctx.gpu);
    const source = await sourceFromPath(path);
    let logits: Float32Array;
    try {
      await engine.load(source, { kv: 'f16', kvBudgetBytes: 1 << 20, prefillChunk });
      logits = await engine.teacherForcedLogits(ids);
    } catch (error) {
      report.push(`    engine failed: ${String(error).split('\n')[0]}`);
      throw error;
    } finally {
      engine.unload();
      await source.close?.();
    }
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline);
    expect(logits.length).toBe(ids.length * spec.vocab);
    const ours = logSoftmax(logits, spec.vocab);
    const toExact = compare(ours, exact, spec.vocab, ENGINE_TOLERANCE);
    const toLlama = compare(ours, llama.logProbs, spec.vocab, llamaTolerance);
    report.push(
      `    engine vs exact reference:                   ${describeWorst(toExact)} / ${ENGINE_TOLERANCE}`,
      `    engine vs llama.cpp:                         ${describeWorst(toLlama)} / ${llamaTolerance}; greedy ${toLlama.greedyChecked - toLlama.greedyMismatches.length}/${toLlama.greedyChecked}, median llama.cpp margin ${toLlama.medianMargin.toFixed(2)}`,
    );

    // The fixture must be able to tell a wrong engine from a right one: llama.cpp's logits are far from flat.
    expect(toLlama.medianMargin).toBeGreaterThan(llamaTolerance);
    if (emulationTolerance !== undefined) expect(emulation.maxDiff).toBeLessThanOrEqual(emulationTolerance);
    expect(toExact.maxDiff).toBeLessThanOrEqual(ENGINE_TOLERANCE);
    expect(toLlama.greedyMismatches).toEqual([]);
    expect(toLlama.maxDiff).toBeLessThanOrEqual(llamaTolerance);
    // A model whose local layers saw the whole sequence would be far off (and choose other tokens where the logits
    // are not dominated by the tied embedding, as in the reported greedy counts).
    if (unwindowed) expect(unwindowed.maxDiff).toBeGreaterThan(10 * llamaTolerance);
    // Likewise a model that rotated q and k in SmolLM3's no-RoPE layers: measured 2.0-3.2 (4-100× the tolerance),
    // with 2-8 greedy choices changed.
    if (allRoped) {
      expect(allRoped.maxDiff).toBeGreaterThan(4 * llamaTolerance);
      expect(allRoped.greedyMismatches.length).toBeGreaterThan(0);
    }
    // And a phi3 model with the wrong LongRoPE set, none, or every dim rotated.
    for (const c of wrongRope) expect(c.maxDiff).toBeGreaterThan(4 * llamaTolerance);
  }

  for (const [index, spec] of FIXTURES.entries()) {
    // Every other fixture prefills in chunks of 5 (5 + 5 + 5 + 1), so later chunks attend to K/V written earlier.
    const prefillChunk = index % 2 === 0 ? 128 : 5;
    const llamaTolerance = LLAMA_TOLERANCE[spec.weightType]!;
    it(`${fixtureName(spec)} (prefill chunk ${prefillChunk}): engine within ${ENGINE_TOLERANCE} of the exact reference, ${llamaTolerance} of llama.cpp`, async () => {
      await check(spec, prefillChunk);
    });
  }

  for (const { spec, tokens, prefillChunk } of GEMMA_FIXTURES) {
    const llamaTolerance = LLAMA_TOLERANCE[spec.weightType]!;
    it(`${fixtureName(spec)}, ${tokens} tokens (prefill chunk ${prefillChunk}): engine within ${ENGINE_TOLERANCE} of the exact reference, ${llamaTolerance} of llama.cpp; the window matters`, async () => {
      await check(spec, prefillChunk, tokens, { windowless: true });
    });
  }

  for (const { spec, tokens, prefillChunk } of SMOLLM3_FIXTURES) {
    const llamaTolerance = LLAMA_TOLERANCE[spec.weightType]!;
    it(`${fixtureName(spec)}, ${tokens} tokens (prefill chunk ${prefillChunk}): engine within ${ENGINE_TOLERANCE} of the exact reference, ${llamaTolerance} of llama.cpp; the no-RoPE layers matter`, async () => {
      await check(spec, prefillChunk, tokens, { ropeEveryLayer: true });
    });
  }

  for (const { spec, tokens, prefillChunk } of PHI3_FIXTURES) {
    const llamaTolerance = LLAMA_TOLERANCE[spec.weightType]!;
    it(`${fixtureName(spec)}, ${tokens} tokens (prefill chunk ${prefillChunk}): engine within ${ENGINE_TOLERANCE} of the exact reference, ${llamaTolerance} of llama.cpp; partial rotary and LongRoPE matter`, async () => {
      await check(spec, prefillChunk, tokens, { phi3Rope: true });
    });
  }
});
