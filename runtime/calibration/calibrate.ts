/**
 * OSCAR-style calibration of the KV rotations, on the device, from the model's own activations:
 *   pass 1: S_Q[l][h] = Σ over query heads h' under KV head h of q_h'ᵀ q_h'   (the metric key errors are read with)
 *   pass 2: S_V[l][h] = Σ_t w_t · v_tᵀ v_t with w_t = k_t · S_Q · k_tᵀ         (values weighted by the logit energy
 *                                                                            of their key)
 * then R_K = rotation(S_Q), R_V = rotation(S_V) per (layer, KV head) (runtime/kv/rotation.ts). Both passes are
 * prefill-only forwards with an f16 cache over the calibration tokens; besides the moments, pass 2 reads back the
 * keys and values of its last chunk, on which the clip quantiles of the K and V row formats are fitted
 * (`fitClipQuantiles`, runtime/kv/clip-fit.ts). Every forward runs through the step runner (runtime/step).
 *
 * No dataset ships: `generateCalibrationText` samples the calibration text from the model itself with an f16 cache.
 * Every step takes an optional `between` hook, awaited before each GPU submit and between CPU steps, so a background
 * calibration (runtime/engine/background-calibration.ts) can pause while requests run and abort by throwing there.
 */

import { InvalidRequestError } from '../../core/errors.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { type PreparedDispatch, releaseDispatches } from '../../core/gpu/dispatch.ts';
import { readFloat32 } from '../../core/gpu/readback.ts';
import { prepareCovariance, prepareKeyEnergy } from '../../kernels/covariance.ts';
import { prepareAddInPlace } from '../../kernels/elementwise.ts';
import { prepareRopeStage, type RopeStage } from '../../kernels/rope.ts';
import { DEFAULT_QUANT_POLICY, type QuantPolicy } from '../eval/fidelity.ts';
import { logProbability } from '../eval/perplexity.ts';
import { type ClipFitFormat, type FittedClip, fitClipQuantiles, resolveClipFormat } from '../kv/clip-fit.ts';
import { createKvAttention, PagedKvAttention } from '../kv/paged-attention.ts';
import { KvPagePool } from '../kv/pool.ts';
import { type KvPrecisionPlan, planEffectiveBits, uniformPlan } from '../kv/precision-plan.ts';
import { covarianceRotation, type KvRotation } from '../kv/rotation.ts';
import type { StoredRotations } from '../kv/rotation-store.ts';
import type { ModelConfig } from '../model/config.ts';
import { type KvAttentionBackend, type LayerAttention, Transformer } from '../model/transformer.ts';
import type { ModelWeights } from '../model/weights.ts';
import { resolveSamplingParams } from '../sampling/params.ts';
import { StepRunner } from '../step/step-runner.ts';
import {
  BASELINE_SIDE,
  choosePlan,
  DEFAULT_PLAN_BUDGET,
  DEFAULT_PROBE,
  type LayerScores,
  type MeasuredPlan,
  type PlanChoice,
  type ProbeLoss,
  pickMeasuredPlan,
  probePlan,
  type RetrievalProbe,
  retrievalProbe,
  type SideScore,
  sideCandidates,
  sideScore,
  withoutOneBitSides,
} from './precision-search.ts';

export interface CalibratedRotations {
  /** f32 [layers × kvHeads × headDim × headDim], row-major, applied as x · R. */
  key: Float32Array;
  value: Float32Array;
  /** The measured second moments the rotations were fitted to (same layout), for inspection and tests. */
  moments: { query: Float32Array; value: Float32Array };
  tokens: number;
  /** Fitted clip quantiles (absent when `clip: null` was passed). */
  clip?: FittedClip;
  /** The precision plan chosen for the 2-bit cache (absent with `clip: null`, or when the text is too short). */
  plan?: PlanChoice & { scores: LayerScores[] };
}

export interface CalibrationHooks {
  /**
   * Awaited before every GPU submit and between CPU steps (one matrix, one layer). A background calibration pauses
   * here while requests run; throwing here aborts the calibration (its GPU memory is released first).
   */
  between?: () => Promise<void>;
}

/** What a calibration stores (cache, GGUF metadata): the rotations, their clip quantiles and precision plan. */
export function storedRotations(fitted: CalibratedRotations): StoredRotations {
  return {
    key: fitted.key,
    value: fitted.value,
    tokens: fitted.tokens,
    ...(fitted.clip ? { clip: { key: fitted.clip.key, value: fitted.clip.value } } : {}),
    ...(fitted.plan ? { plan: fitted.plan.plan } : {}),
  };
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

  prepareLayer(
    layer: number,
    b: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer },
    maxTokens: number,
    rope: RopeStage | null,
    attention?: LayerAttention,
  ) {
    const { gpu, config: c, step, moments, capture } = this;
    // The moments are of q and k as the cache sees them: RoPE first, here.
    const roped = prepareRopeStage(gpu, `blk.${layer}.rope`, rope, b.q, b.k, maxTokens);
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
    const own = [...roped, ...copies, ...moment];
    try {
      const inner = this.inner.prepareLayer(layer, b, maxTokens, null, attention);
      return { append: [...own, ...inner.append], attention: inner.attention };
    } catch (error) {
      releaseDispatches(gpu, own);
      throw error;
    }
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
    const runner = new StepRunner(gpu, { pool, transformer, sampling: { label: 'calibration' } });
    owned.push(() => runner.release());
    runner.resetSamplerHistory(prompt);
    const seq = pool.createSequence();
    const ids = prompt.slice(0, count);
    let step = 0;
    // Position p feeds ids[p]; the last known id's logits are sampled, so the prompt is read one token per submit.
    for (let position = 0; ids.length < count; position++) {
      await options.between?.();
      const sample = position === ids.length - 1;
      const next = runner.submit({
        label: 'calibration.generate',
        seq,
        position,
        ids: [ids[position]],
        sample: sample ? { params, step: step++ } : undefined,
      });
      if (next) ids.push(await next);
      else await gpu.device.queue.onSubmittedWorkDone();
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
    /** The sink and window the precision plan's probe is built for (default the pool's: 64 and 256). */
    planPolicy?: QuantPolicy;
  } = {},
): Promise<CalibratedRotations> {
  const c = config;
  const d = c.headDim;
  const width = c.kvHeads * d;
  const chunk = options.chunk ?? 128;
  const matrices = c.layers * c.kvHeads;
  const clipFormat = options.clip === null ? null : resolveClipFormat(c, options.clip ?? {});
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
      const runner = new StepRunner(gpu, { pool, transformer });
      const seq = pool.createSequence();
      try {
        for (let position = 0; position < tokens.length; position += chunk) {
          await options.between?.();
          const ids = tokens.slice(position, position + chunk);
          const last = position + chunk >= tokens.length;
          // The clip fit's sample: the last chunk's rows (the capture adds into these buffers, cleared first).
          const sampled = capture && pass === 'value' && last ? capture : null;
          if (sampled) sampleTokens = ids.length;
          runner.submit({
            label: `calibration.${pass}`,
            seq,
            position,
            ids,
            before: sampled
              ? (encoder) => {
                  for (const b of [...sampled.k, ...sampled.v]) encoder.clearBuffer(b);
                }
              : undefined,
          });
          await gpu.device.queue.onSubmittedWorkDone();
          gpu.throwIfErrors();
          done += ids.length;
          options.onProgress?.(done, total);
        }
      } finally {
        pool.free(seq);
        runner.release();
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
    // The eigendecompositions, then per layer the clip fit and the precision plan's scores.
    const fitSteps = 2 * matrices + (sample ? 2 * c.layers : 0);
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
      const plan = await chooseKvPrecisionPlan(gpu, c, weights, tokens, { key, value }, clipFormat.groupSize, {
        between: options.between,
        onLayer: (l) => options.onFitProgress?.(2 * matrices + c.layers + l + 1, fitSteps),
        policy: options.planPolicy,
      });
      if (plan) result.plan = plan;
    }
    return result;
  } finally {
    releaseAll();
  }
}

/** A prefill chunk for the probe: at most 128 positions, and at most half the window (as `eval` requires). */
function probeChunk(policy: QuantPolicy): number {
  return Math.max(
    policy.pageTokens,
    Math.min(128, Math.floor(policy.window / 2 / policy.pageTokens) * policy.pageTokens),
  );
}

/**
 * The probe's mean negative log-likelihoods at its copy and plain rows, teacher-forced through the forward over a
 * quant pool laid out by `plan` (sink, window and pages of `policy`), K and V stored rotated by `rotation`.
 */
export async function measureProbeLoss(
  gpu: GpuContext,
  c: ModelConfig,
  weights: ModelWeights,
  probe: RetrievalProbe,
  layout: { plan: KvPrecisionPlan; groupSize: number; policy: QuantPolicy; rotation: KvRotation },
  hooks: CalibrationHooks = {},
): Promise<ProbeLoss> {
  const { tokens } = probe;
  const { policy } = layout;
  const chunk = probeChunk(policy);
  const f16Bytes = 2 * c.layers * c.kvHeads * c.headDim * 2 * (tokens.length + 64);
  const pool = new KvPagePool(gpu, {
    layers: c.layers,
    kvHeads: c.kvHeads,
    headDim: c.headDim,
    pageTokens: policy.pageTokens,
    budgetBytes: 2 * f16Bytes,
    maxSequences: 1,
    maxSequenceTokens: tokens.length + 64,
    kv: 'quant',
    sink: policy.sink,
    window: policy.window,
    keyFormat: { groupSize: layout.groupSize },
    valueFormat: { groupSize: layout.groupSize },
    plan: layout.plan,
    maxStepTokens: chunk,
  });
  const released: Array<() => void> = [() => pool.destroy()];
  try {
    const attention = createKvAttention(gpu, pool, { heads: c.heads, rotation: layout.rotation });
    // f32 projections, as the rotations' passes: the plan does not depend on the device's int8 tensor cores.
    const transformer = new Transformer(gpu, c, weights, attention, chunk, { prefillMatmul: 'f32' });
    released.push(() => transformer.release());
    const runner = new StepRunner(gpu, { pool, transformer });
    released.push(() => runner.release());
    const seq = pool.createSequence();
    released.push(() => pool.free(seq));
    pool.reserve(seq, tokens.length);
    const copy = new Set(probe.copyRows);
    const plain = new Set(probe.plainRows);
    const sums = { copy: 0, plain: 0 };
    const vocab = c.vocab;
    for (let position = 0; position < tokens.length; position += chunk) {
      await hooks.between?.();
      const ids = tokens.slice(position, position + chunk);
      const rows = ids.map((_, i) => position + i).filter((t) => copy.has(t) || plain.has(t));
      runner.submit({ label: 'calibration.plan', seq, position, ids, logits: rows.length > 0 ? 'all' : 'none' });
      if (rows.length > 0) {
        const logits = await readFloat32(gpu, transformer.allLogitsBuffer(), ids.length * vocab);
        for (const t of rows) {
          const nll = -logProbability(logits, (t - position) * vocab, vocab, tokens[t + 1]);
          if (copy.has(t)) sums.copy += nll;
          else sums.plain += nll;
        }
      }
      gpu.throwIfErrors();
    }
    return { copy: sums.copy / Math.max(1, copy.size), plain: sums.plain / Math.max(1, plain.size) };
  } finally {
    for (const release of released.reverse()) release();
  }
}

/**
 * The precision plan of the 2-bit cache for rotations `rotation` (runtime/calibration/precision-search.ts): the
 * retrieval probe of `text` under the pool's default sink and window, run through the real forward with every side
 * at the baseline (BASELINE_SIDE), then with each side at each other candidate; the least-cost plan within the
 * default budget. Null when
 * `text` is too short for a probe.
 */
export async function chooseKvPrecisionPlan(
  gpu: GpuContext,
  config: ModelConfig,
  weights: ModelWeights,
  text: readonly number[],
  rotation: { key: Float32Array; value: Float32Array },
  groupSize: number,
  options: CalibrationHooks & {
    onLayer?: (layer: number) => void;
    budget?: { bitsPerElement: number; tokens: number };
    /** The sink and window the probe is built for (default the pool's: 64 and 256). */
    policy?: QuantPolicy;
  } = {},
): Promise<(PlanChoice & { scores: LayerScores[] }) | null> {
  const c = config;
  const policy = options.policy ?? DEFAULT_QUANT_POLICY;
  const repeated = DEFAULT_PROBE.repeats * DEFAULT_PROBE.span;
  const length = Math.min(DEFAULT_PROBE.length, text.length + repeated, c.contextLength);
  let probe: RetrievalProbe;
  try {
    probe = retrievalProbe(text, policy, { ...DEFAULT_PROBE, length });
  } catch (error) {
    // The text (or the model's context) is too short for a probe: no plan, the uniform format stays.
    if (error instanceof InvalidRequestError) return null;
    throw error;
  }
  const layout = (plan: KvPrecisionPlan) => ({
    plan,
    groupSize,
    policy,
    rotation: { kind: 'calibrated' as const, key: rotation.key, value: rotation.value },
  });
  const baseline = await measureProbeLoss(
    gpu,
    c,
    weights,
    probe,
    layout(uniformPlan(c.layers, BASELINE_SIDE, BASELINE_SIDE)),
    options,
  );
  const share = { sink: policy.sink, window: policy.window, pageTokens: policy.pageTokens };
  const budget = options.budget ?? DEFAULT_PLAN_BUDGET;
  const candidates = sideCandidates(c.layers, { groupSize, share, budget });
  const scores: LayerScores[] = [];
  for (let l = 0; l < c.layers; l++) {
    const layer: Partial<LayerScores> = {};
    for (const side of ['key', 'value'] as const) {
      const list: SideScore[] = [];
      for (const candidate of candidates[side]) {
        const same = candidate.bits === BASELINE_SIDE.bits && candidate.clipQuantile === BASELINE_SIDE.clipQuantile;
        const loss = same
          ? baseline
          : await measureProbeLoss(gpu, c, weights, probe, layout(probePlan(c.layers, l, side, candidate)), options);
        list.push(sideScore(candidate, loss, baseline));
      }
      layer[side] = list;
    }
    scores.push(layer as LayerScores);
    options.onLayer?.(l);
  }
  // The knapsack's plans, each measured as a whole (their side costs need not add up), and the baseline where it fits.
  const baselinePlan = uniformPlan(c.layers, BASELINE_SIDE, BASELINE_SIDE);
  const measured: Array<MeasuredPlan & { error: number }> = [];
  const seen = new Set<string>();
  for (const from of [scores, withoutOneBitSides(scores)]) {
    let choice: PlanChoice;
    try {
      choice = choosePlan(from, { groupSize, share, budget });
    } catch (error) {
      if (from !== scores && error instanceof InvalidRequestError) continue; // 2-bit sides do not fit the budget
      throw error;
    }
    const key = JSON.stringify(choice.plan);
    if (seen.has(key)) continue;
    seen.add(key);
    const loss = await measureProbeLoss(gpu, c, weights, probe, layout(choice.plan), options);
    measured.push({ ...choice, loss });
  }
  const baselineBits = planEffectiveBits(baselinePlan, groupSize, share, budget.tokens);
  if (baselineBits <= budget.bitsPerElement + 1e-9 && !seen.has(JSON.stringify(baselinePlan))) {
    measured.push({ plan: baselinePlan, bitsPerElement: baselineBits, loss: baseline, error: 0 });
  }
  const { loss: _loss, ...kept } = pickMeasuredPlan(measured);
  return { ...kept, scores };
}
