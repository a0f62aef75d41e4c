/**
 * OSCAR-style calibration of the KV rotations, on the device, from the model's own activations:
 *   pass 1: S_Q[l][h] = Σ over query heads h' under KV head h of q_h'ᵀ q_h'   (the metric key errors are read with)
 *   pass 2: S_V[l][h] = Σ_t w_t · v_tᵀ v_t with w_t = k_t · S_Q · k_tᵀ         (values weighted by the logit energy
 *                                                                            of their key)
 * then R_K = rotation(S_Q), R_V = rotation(S_V) per (layer, KV head) (runtime/kv/rotation.ts). Both passes are
 * prefill-only forwards with an f16 cache over the calibration tokens; besides the moments, pass 2 reads back the
 * keys and values of its last chunk, on which the clip quantiles of the K and V row formats are fitted
 * (`fitClipQuantiles`).
 *
 * No dataset ships: `generateCalibrationText` samples the calibration text from the model itself with an f16 cache.
 * Every step takes an optional `between` hook, awaited before each GPU submit and between CPU steps, so a background
 * calibration (runtime/engine/background-calibration.ts) can pause while requests run and abort by throwing there.
 */

import type { GpuContext } from '../../core/gpu/device.ts';
import { encodeDispatches, type PreparedDispatch } from '../../core/gpu/dispatch.ts';
import { readFloat32 } from '../../core/gpu/readback.ts';
import { prepareCovariance, prepareKeyEnergy } from '../../kernels/covariance.ts';
import { prepareAddInPlace } from '../../kernels/elementwise.ts';
import { prepareSampler } from '../../kernels/sample.ts';
import type { ModelConfig } from '../model/config.ts';
import { type KvAttentionBackend, Transformer } from '../model/transformer.ts';
import type { ModelWeights } from '../model/weights.ts';
import { resolveSamplingParams } from '../sampling/params.ts';
import { PagedKvAttention } from './paged-attention.ts';
import { KvPagePool } from './pool.ts';
import { dequantizeRow, type QuantRowFormat, quantizeRow, roundToF16 } from './quant-format.ts';
import { covarianceRotation } from './rotation.ts';

/**
 * Clip quantiles tried for K and for V (the `clipQuantile` of runtime/kv/quant-format.ts; 1 = plain min/max). OSCAR
 * fits a clip ratio of the range (e.g. 0.96 for K, 0.92 for V); longtab's row format clips at a quantile of each
 * group instead, so the same idea is fitted on that parameter. 1 comes first: it is the reference of each layer.
 */
export const CLIP_QUANTILE_GRID: readonly number[] = [1, 0.98, 0.96, 0.94, 0.92, 0.9];

/** The row format the clip quantiles are fitted for (the pool's defaults: 2 bits, groups of min(128, width)). */
export interface ClipFitFormat {
  bits?: 1 | 2 | 4;
  groupSize?: number;
}

export interface FittedClip {
  key: number;
  value: number;
  grid: readonly number[];
  /** Per grid entry: the error summed over layers, each layer's relative to its error at clip 1. */
  keyError: number[];
  valueError: number[];
}

export interface CalibratedRotations {
  /** f32 [layers × kvHeads × headDim × headDim], row-major, applied as x · R. */
  key: Float32Array;
  value: Float32Array;
  /** The measured second moments the rotations were fitted to (same layout), for inspection and tests. */
  moments: { query: Float32Array; value: Float32Array };
  tokens: number;
  /** Fitted clip quantiles (absent when `clip: null` was passed). */
  clip?: FittedClip;
}

export interface CalibrationHooks {
  /**
   * Awaited before every GPU submit and between CPU steps (one matrix, one layer). A background calibration pauses
   * here while requests run; throwing here aborts the calibration (its GPU memory is released first).
   */
  between?: () => Promise<void>;
}

type Pass = 'query' | 'value';

/** Per layer, the post-RoPE keys and the values of one forward call (f32 [tokens × kvHeads × headDim] each). */
interface Capture {
  k: GPUBuffer[];
  v: GPUBuffer[];
}

/** Adds moment accumulation after RoPE (pass 'query') or around the value store (pass 'value') of each layer. */
class MomentCapture implements KvAttentionBackend {
  constructor(
    private readonly gpu: GpuContext,
    private readonly inner: KvAttentionBackend,
    private readonly config: ModelConfig,
    private readonly step: GPUBuffer,
    private readonly pass: Pass,
    private readonly moments: { query: GPUBuffer; value: GPUBuffer; energy: GPUBuffer },
    private readonly capture: Capture | null,
  ) {}

  prepareLayer(layer: number, b: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer }, maxTokens: number) {
    const { gpu, config: c, step, moments, capture } = this;
    const firstMatrix = layer * c.kvHeads;
    const width = c.kvHeads * c.headDim;
    const copies: PreparedDispatch[] = capture
      ? [
          // x += y into buffers cleared before the captured forward: a copy of this layer's k and v.
          prepareAddInPlace(gpu, `blk.${layer}.capture_k`, { x: capture.k[layer], y: b.k, count: maxTokens * width }),
          prepareAddInPlace(gpu, `blk.${layer}.capture_v`, { x: capture.v[layer], y: b.v, count: maxTokens * width }),
        ]
      : [];
    const moment: PreparedDispatch[] =
      this.pass === 'query'
        ? [
            prepareCovariance(gpu, `blk.${layer}.moment_q`, {
              x: b.q,
              weights: null,
              covariance: moments.query,
              firstMatrix,
              matrices: c.kvHeads,
              heads: c.heads,
              headDim: c.headDim,
              step,
            }),
          ]
        : [
            prepareKeyEnergy(gpu, `blk.${layer}.key_energy`, {
              k: b.k,
              queryMoment: moments.query,
              firstMatrix,
              energy: moments.energy,
              kvHeads: c.kvHeads,
              headDim: c.headDim,
              maxTokens,
              step,
            }),
            prepareCovariance(gpu, `blk.${layer}.moment_v`, {
              x: b.v,
              weights: moments.energy,
              covariance: moments.value,
              firstMatrix,
              matrices: c.kvHeads,
              heads: c.kvHeads,
              headDim: c.headDim,
              step,
            }),
          ];
    const inner = this.inner.prepareLayer(layer, b, maxTokens);
    return { append: [...copies, ...moment, ...inner.append], attention: inner.attention };
  }
}

/** An f16 pool for one sequence of `tokens` positions (calibration never uses the engine's pool). */
function f16Pool(gpu: GpuContext, c: ModelConfig, tokens: number): KvPagePool {
  return new KvPagePool(gpu, {
    layers: c.layers,
    kvHeads: c.kvHeads,
    headDim: c.headDim,
    budgetBytes: 2 * c.layers * c.kvHeads * c.headDim * 2 * (tokens + 64),
    maxSequences: 1,
    maxSequenceTokens: tokens + 64,
  });
}

/**
 * Calibration text: the model's own sampled continuation of `prompt` (BOS, or a neutral prompt), `count` tokens in
 * all, one decode submit per token with an f16 cache of its own. End-of-generation tokens do not stop it (a
 * calibration text may hold several documents). Deterministic for a given seed.
 */
export async function generateCalibrationText(
  gpu: GpuContext,
  config: ModelConfig,
  weights: ModelWeights,
  options: CalibrationHooks & {
    prompt: readonly number[];
    count: number;
    seed?: number;
    onProgress?: (done: number, total: number) => void;
  },
): Promise<number[]> {
  const { prompt, count } = options;
  if (prompt.length === 0) throw new RangeError('generateCalibrationText: the prompt is empty.');
  const params = resolveSamplingParams({ temperature: 0.8, topP: 0.95, seed: options.seed ?? 1 });
  const pool = f16Pool(gpu, config, count);
  const owned: Array<() => void> = [() => pool.destroy()];
  try {
    const transformer = new Transformer(
      gpu,
      config,
      weights,
      new PagedKvAttention(gpu, pool, { heads: config.heads }),
      1,
    );
    owned.push(() => transformer.release());
    const sampled = gpu.allocator.createStorage('calibration.sampledId', 'scratch', 16);
    owned.push(() => gpu.allocator.release(sampled));
    const readback = gpu.allocator.createBuffer({
      label: 'calibration.sampledId.readback',
      category: 'staging',
      size: 16,
      usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
    });
    owned.push(() => gpu.allocator.release(readback));
    const sampler = prepareSampler(gpu, 'calibration.sampler', {
      logits: transformer.buffers.logits,
      vocab: config.vocab,
      output: sampled,
    });
    owned.push(() => sampler.release());
    sampler.resetHistory(prompt);
    const seq = pool.createSequence();
    const ids = prompt.slice(0, count);
    let step = 0;
    // Position p feeds ids[p]; the last known id's logits are sampled, so the prompt is read one token per submit.
    for (let position = 0; ids.length < count; position++) {
      await options.between?.();
      const sample = position === ids.length - 1;
      pool.writeStep(seq, position, 1);
      transformer.writeStep([ids[position]], position);
      const encoder = gpu.device.createCommandEncoder({ label: 'calibration.generate' });
      transformer.encode(encoder, 1, sample ? 'last' : 'none');
      if (sample) {
        sampler.setParams(params, step++);
        const pass = encoder.beginComputePass({ label: 'calibration.sample' });
        encodeDispatches(pass, sampler.dispatches);
        pass.end();
        encoder.copyBufferToBuffer(sampled, 0, readback, 0, 4);
      }
      gpu.device.queue.submit([encoder.finish()]);
      if (sample) {
        await readback.mapAsync(GPUMapMode.READ, 0, 4);
        ids.push(new Uint32Array(readback.getMappedRange(0, 4))[0]);
        readback.unmap();
      } else await gpu.device.queue.onSubmittedWorkDone();
      gpu.throwIfErrors();
      options.onProgress?.(ids.length, count);
    }
    return ids;
  } finally {
    for (const release of owned.reverse()) release();
  }
}

/**
 * Runs both calibration passes over `tokens` (one sequence; ~4K tokens is plenty) and returns the rotations and,
 * unless `clip: null`, the clip quantiles fitted for the row format `clip` (default 2 bits, groups of min(128,
 * kvHeads × headDim), the pool's defaults). GPU memory used here (a small f16 pool, scratch activations, the moments,
 * the captured rows) is released before returning, also when a hook throws.
 */
export async function calibrateKvRotations(
  gpu: GpuContext,
  config: ModelConfig,
  weights: ModelWeights,
  tokens: readonly number[],
  options: CalibrationHooks & {
    chunk?: number;
    /** Moment passes: tokens done of 2 × tokens. */
    onProgress?: (done: number, total: number) => void;
    /** CPU steps after the passes: the eigendecompositions, then the clip fit (one step per layer). */
    onFitProgress?: (done: number, total: number) => void;
    clip?: ClipFitFormat | null;
  } = {},
): Promise<CalibratedRotations> {
  const c = config;
  const d = c.headDim;
  const width = c.kvHeads * d;
  const chunk = options.chunk ?? 128;
  const matrices = c.layers * c.kvHeads;
  const clipFormat = options.clip === null ? null : resolveClipFormat(width, options.clip ?? {});
  const pool = f16Pool(gpu, c, tokens.length);
  const moments = {
    query: gpu.allocator.createStorage('calibration.S_Q', 'scratch', matrices * d * d * 4),
    value: gpu.allocator.createStorage('calibration.S_V', 'scratch', matrices * d * d * 4),
    energy: gpu.allocator.createStorage('calibration.energy', 'scratch', chunk * c.kvHeads * 4),
  };
  const capture: Capture | null = clipFormat
    ? {
        k: Array.from({ length: c.layers }, (_, l) =>
          gpu.allocator.createStorage(`calibration.capture_k${l}`, 'scratch', chunk * width * 4),
        ),
        v: Array.from({ length: c.layers }, (_, l) =>
          gpu.allocator.createStorage(`calibration.capture_v${l}`, 'scratch', chunk * width * 4),
        ),
      }
    : null;
  const total = 2 * tokens.length;
  let done = 0;
  let sampleTokens = 0;
  let released = false;
  const releaseAll = () => {
    if (released) return;
    released = true;
    for (const b of Object.values(moments)) gpu.allocator.release(b);
    for (const b of [...(capture?.k ?? []), ...(capture?.v ?? [])]) gpu.allocator.release(b);
    pool.destroy();
  };
  try {
    for (const pass of ['query', 'value'] as const) {
      const backend = new MomentCapture(
        gpu,
        new PagedKvAttention(gpu, pool, { heads: c.heads }),
        c,
        pool.step,
        pass,
        moments,
        pass === 'value' ? capture : null,
      );
      // f32 projections: the fitted rotations do not depend on whether this device has int8 tensor cores.
      const transformer = new Transformer(gpu, c, weights, backend, chunk, { prefillMatmul: 'f32' });
      const seq = pool.createSequence();
      try {
        for (let position = 0; position < tokens.length; position += chunk) {
          await options.between?.();
          const ids = tokens.slice(position, position + chunk);
          pool.writeStep(seq, position, ids.length);
          transformer.writeStep(ids, position);
          const encoder = gpu.device.createCommandEncoder({ label: `calibration.${pass}` });
          const last = position + chunk >= tokens.length;
          if (capture && pass === 'value' && last) {
            // The clip fit's sample: the last chunk's rows (the capture adds into these buffers).
            for (const b of [...capture.k, ...capture.v]) encoder.clearBuffer(b);
            sampleTokens = ids.length;
          }
          transformer.encode(encoder, ids.length, 'none');
          gpu.device.queue.submit([encoder.finish()]);
          await gpu.device.queue.onSubmittedWorkDone();
          gpu.throwIfErrors();
          done += ids.length;
          options.onProgress?.(done, total);
        }
      } finally {
        pool.free(seq);
        transformer.release();
      }
    }
    const sq = await readFloat32(gpu, moments.query, matrices * d * d);
    const sv = await readFloat32(gpu, moments.value, matrices * d * d);
    const sample =
      capture && sampleTokens > 0
        ? {
            tokens: sampleTokens,
            keys: await Promise.all(capture.k.map((b) => readFloat32(gpu, b, sampleTokens * width))),
            values: await Promise.all(capture.v.map((b) => readFloat32(gpu, b, sampleTokens * width))),
          }
        : null;
    // Release the GPU memory before the CPU work (which may pause for a long time between steps).
    releaseAll();
    const fitSteps = 2 * matrices + (sample ? c.layers : 0);
    const key = new Float32Array(matrices * d * d);
    const value = new Float32Array(matrices * d * d);
    for (let m = 0; m < matrices; m++) {
      await options.between?.();
      key.set(covarianceRotation(Float64Array.from(sq.subarray(m * d * d, (m + 1) * d * d)), d), m * d * d);
      options.onFitProgress?.(2 * m + 1, fitSteps);
      await options.between?.();
      value.set(covarianceRotation(Float64Array.from(sv.subarray(m * d * d, (m + 1) * d * d)), d), m * d * d);
      options.onFitProgress?.(2 * m + 2, fitSteps);
    }
    const result: CalibratedRotations = { key, value, moments: { query: sq, value: sv }, tokens: tokens.length };
    if (sample && clipFormat) {
      result.clip = await fitClipQuantiles(
        { layers: c.layers, kvHeads: c.kvHeads, headDim: d },
        sample,
        { key, value, query: sq },
        clipFormat,
        {
          between: options.between,
          onLayer: (l) => options.onFitProgress?.(2 * matrices + l + 1, fitSteps),
        },
      );
    }
    return result;
  } finally {
    releaseAll();
  }
}

function resolveClipFormat(width: number, f: ClipFitFormat): Omit<QuantRowFormat, 'clipQuantile'> {
  return { width, bits: f.bits ?? 2, groupSize: f.groupSize ?? Math.min(128, width) };
}

/**
 * Picks, from `grid`, the clip quantile of the K rows and of the V rows that quantize the sampled activations with
 * the least attention error, after rotation and with the exact quantizer the cache uses (quantizeRow, bit-exact
 * with the demotion kernel):
 *   K: a key error e (rotated space) moves the logits by q·(e·Rᵀ): its expected square is e · (Rᵀ S_Q R) · eᵀ;
 *   V: a value error moves the output in proportion to its attention weight: w_t · |e|², with w_t = k_t·S_Q·k_tᵀ
 *      (the key energy pass 2 weights S_V with).
 * Each layer's error is taken relative to its error at clip 1 (so every layer counts alike), summed over layers;
 * ties keep the earlier (less clipped) grid entry.
 */
export async function fitClipQuantiles(
  shape: { layers: number; kvHeads: number; headDim: number },
  sample: { tokens: number; keys: Float32Array[]; values: Float32Array[] },
  fitted: { key: Float32Array; value: Float32Array; query: Float32Array },
  format: Omit<QuantRowFormat, 'clipQuantile'>,
  options: CalibrationHooks & { grid?: readonly number[]; onLayer?: (layer: number) => void } = {},
): Promise<FittedClip> {
  const grid = options.grid ?? CLIP_QUANTILE_GRID;
  const { layers, kvHeads, headDim: d } = shape;
  const width = kvHeads * d;
  const n = sample.tokens;
  const keyError = grid.map(() => 0);
  const valueError = grid.map(() => 0);
  for (let l = 0; l < layers; l++) {
    await options.between?.();
    const keys = sample.keys[l];
    const values = sample.values[l];
    const rk = rotateRows(keys, fitted.key, l, n, kvHeads, d);
    const rv = rotateRows(values, fitted.value, l, n, kvHeads, d);
    // M_h = R_Kᵀ S_Q R_K: the logit-error metric in the rotated space; w[t, h] = k S_Q kᵀ (unrotated).
    const metric: Float64Array[] = [];
    const energy = new Float64Array(n * kvHeads);
    for (let h = 0; h < kvHeads; h++) {
      const base = (l * kvHeads + h) * d * d;
      const s = fitted.query.subarray(base, base + d * d);
      const r = fitted.key.subarray(base, base + d * d);
      metric.push(congruence(r, s, d));
      for (let t = 0; t < n; t++) energy[t * kvHeads + h] = quadratic(keys, (t * kvHeads + h) * d, s, d);
    }
    const layerKey = grid.map(() => 0);
    const layerValue = grid.map(() => 0);
    for (const [g, clipQuantile] of grid.entries()) {
      const f: QuantRowFormat = { ...format, clipQuantile };
      for (let t = 0; t < n; t++) {
        const kRow = rk.subarray(t * width, (t + 1) * width);
        const kErr = difference(dequantizeRow(quantizeRow(kRow, f), f), kRow);
        const vRow = rv.subarray(t * width, (t + 1) * width);
        const vErr = difference(dequantizeRow(quantizeRow(vRow, f), f), vRow);
        for (let h = 0; h < kvHeads; h++) {
          layerKey[g] += quadratic(kErr, h * d, metric[h], d);
          let norm = 0;
          for (let i = h * d; i < (h + 1) * d; i++) norm += vErr[i] * vErr[i];
          layerValue[g] += energy[t * kvHeads + h] * norm;
        }
      }
    }
    for (let g = 0; g < grid.length; g++) {
      keyError[g] += layerKey[0] > 0 ? layerKey[g] / layerKey[0] : 1;
      valueError[g] += layerValue[0] > 0 ? layerValue[g] / layerValue[0] : 1;
    }
    options.onLayer?.(l);
  }
  const best = (errors: number[]) => {
    let b = 0;
    for (let g = 1; g < errors.length; g++) if (errors[g] < errors[b] * (1 - 1e-9)) b = g;
    return grid[b];
  };
  return { key: best(keyError), value: best(valueError), grid, keyError, valueError };
}

/**
 * x[t, h, :] · R[layer, h] for every token and head of one layer's rows, rounded to f16 as the f16 pages hold them
 * before they are quantized.
 */
function rotateRows(x: Float32Array, rotations: Float32Array, layer: number, n: number, kvHeads: number, d: number) {
  const out = new Float64Array(n * kvHeads * d);
  for (let h = 0; h < kvHeads; h++) {
    const base = (layer * kvHeads + h) * d * d;
    for (let t = 0; t < n; t++) {
      const row = (t * kvHeads + h) * d;
      for (let i = 0; i < d; i++) {
        const xi = x[row + i];
        if (xi === 0) continue;
        const r = base + i * d;
        for (let j = 0; j < d; j++) out[row + j] += xi * rotations[r + j];
      }
    }
  }
  for (let i = 0; i < out.length; i++) out[i] = roundToF16(out[i]);
  return out;
}

/** Rᵀ S R (d × d). */
function congruence(r: Float32Array, s: Float32Array, d: number): Float64Array {
  const sr = new Float64Array(d * d);
  for (let i = 0; i < d; i++)
    for (let k = 0; k < d; k++) {
      const sik = s[i * d + k];
      for (let j = 0; j < d; j++) sr[i * d + j] += sik * r[k * d + j];
    }
  const out = new Float64Array(d * d);
  for (let k = 0; k < d; k++)
    for (let i = 0; i < d; i++) {
      const rki = r[k * d + i];
      for (let j = 0; j < d; j++) out[i * d + j] += rki * sr[k * d + j];
    }
  return out;
}

/** x[offset..offset+d) · M · x[offset..offset+d)ᵀ. */
function quadratic(x: ArrayLike<number>, offset: number, m: ArrayLike<number>, d: number): number {
  let sum = 0;
  for (let i = 0; i < d; i++) {
    const xi = x[offset + i];
    if (xi === 0) continue;
    let row = 0;
    for (let j = 0; j < d; j++) row += m[i * d + j] * x[offset + j];
    sum += xi * row;
  }
  return sum;
}

function difference(a: ArrayLike<number>, b: ArrayLike<number>): Float64Array {
  const out = new Float64Array(b.length);
  for (let i = 0; i < b.length; i++) out[i] = a[i] - b[i];
  return out;
}
