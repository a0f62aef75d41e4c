/**
 * Attention fidelity of the quantized KV cache on real activations (issue 10, point 3).
 *
 * Input: per layer, the q (after RoPE), k (after RoPE) and v of every position of a window, as the GPU forward
 * with an f16 cache computed them (runtime/eval/fidelity-capture.ts). For each KV variant this recomputes, per query
 * position and head, the attention the runtime would compute with that cache:
 * - K and V rotated as the runtime does (k·R_K, v·R_V in the stored basis; q·R_K reads them; the output is rotated
 *   back by R_Vᵀ), then rounded to f16 as kv-append stores them;
 * - rows of the pages the pool has demoted at that query (past the sink pages and older than the window: the
 *   pool's rule in runtime/kv/pool.ts `planDemotions`) replaced by `dequantizeRow(quantizeRow(row))` of their f16
 *   values (runtime/kv/quant-format.ts: the format the demotion kernel writes and the attention kernel reads);
 * - scores q·k/√d, softmax and Σ p·v in f64 (the GPU: f32).
 * and compares it with the f16 cache (no rotation, K/V rounded to f16): per (query, head) the relative L2 error
 * ||o − o_f16|| / ||o_f16|| of the attention output and KL(p_f16 || p) of the attention weights, averaged over the
 * heads and the query positions whose history holds at least one quantized page.
 *
 * Every step is f16/f32-exact emulation of the kernels except the accumulation order, so the 'f16' variant gives
 * exactly zero and the others match what the GPU computes (fidelity.test.ts checks both against the GPU).
 */
import { InvalidRequestError } from '../../core/errors.ts';
import type { KvPrecisionPlan } from '../kv/precision-plan.ts';
import { defaultGroupSize, type QuantRowFormat, roundToF16, roundTripRows } from '../kv/quant-format.ts';
import { rotationSet } from '../kv/rotation.ts';

export interface AttentionShape {
  heads: number;
  kvHeads: number;
  headDim: number;
}

/** One layer's attention inputs for `tokens` consecutive positions from 0, f32 as the GPU computed them. */
export interface LayerActivations {
  /** [tokens × heads × headDim], after RoPE. */
  q: Float32Array;
  /** [tokens × kvHeads × headDim], after RoPE. */
  k: Float32Array;
  /** [tokens × kvHeads × headDim]. */
  v: Float32Array;
  /** [tokens × heads × headDim]: the GPU's attention output, when captured (validation). */
  output?: Float32Array;
}

/** Which positions the cache holds quantized when a query runs (runtime/kv/pool.ts). */
export interface QuantPolicy {
  /** f16 positions at the start, rounded up to whole pages. */
  sink: number;
  /** Most recent positions kept f16. */
  window: number;
  pageTokens: number;
  /**
   * Positions per forward step. 1 (decode, the default view): the query at t runs in a step at position t. With n,
   * the query at t runs in the step starting at ⌊t/n⌋·n, and demotion is planned from that step's position.
   */
  stepTokens: number;
}

export const DEFAULT_QUANT_POLICY: QuantPolicy = { sink: 64, window: 256, pageTokens: 16, stepTokens: 1 };

/** Row formats of demoted K and V pages; a null side stays f16 (its demoted rows read exactly as stored). */
export interface FidelityFormats {
  key: Omit<QuantRowFormat, 'width'> | null;
  value: Omit<QuantRowFormat, 'width'> | null;
}

export interface FidelityVariant {
  name: string;
  /** Row formats of demoted K and V pages; null for the f16 cache (nothing is quantized). */
  format: FidelityFormats | null;
  /** Per layer, formats that replace `format` (a precision plan: runtime/kv/precision-plan.ts). */
  layerFormats?: readonly FidelityFormats[];
  /** f32 [layers × kvHeads × headDim × headDim], row-major, applied as x·R; null: no rotation. */
  rotation: { key: Float32Array; value: Float32Array } | null;
  /** 'f32': K/V kept unrounded, the exact reference that shows what the f16 cache's own rounding costs. */
  storage?: 'f32';
}

/** The variants by the names `longtab eval` uses; 'calibrated' needs its rotations. */
export const FIDELITY_MODES = ['f16', 'int2-none', 'int2-hadamard', 'int2-calibrated', 'int1-none'] as const;

/** Calibrated rotations as stored (runtime/kv/rotation-store.ts), with the clip quantiles fitted with them if any. */
export interface CalibratedKv {
  key: Float32Array;
  value: Float32Array;
  clip?: { key: number; value: number };
  /** The precision plan chosen with them, if any (runtime/kv/precision-plan.ts). */
  plan?: KvPrecisionPlan;
}

export function fidelityVariant(
  name: string,
  shape: AttentionShape & { layers: number },
  options: { groupSize?: number; calibrated?: CalibratedKv | null } = {},
): FidelityVariant {
  // The pool's default group (runtime/kv/quant-format.ts defaultGroupSize) and clip quantile (1: min/max) unless fitted.
  const groupSize = options.groupSize ?? defaultGroupSize(shape.kvHeads, shape.headDim);
  const format = (bits: 1 | 2, clip = { key: 1, value: 1 }) => ({
    key: { bits, groupSize, clipQuantile: clip.key },
    value: { bits, groupSize, clipQuantile: clip.value },
  });
  switch (name) {
    case 'f32':
      return { name, format: null, rotation: null, storage: 'f32' };
    case 'f16':
      return { name, format: null, rotation: null };
    case 'int2-none':
      return { name, format: format(2), rotation: null };
    case 'int1-none':
      return { name, format: format(1), rotation: null };
    case 'int2': {
      // What kv: 'int2' runs once calibrated: the calibrated rotations, each layer's K and V as the plan says.
      const plan = options.calibrated?.plan;
      if (!options.calibrated || !plan)
        throw new InvalidRequestError("'int2' needs calibrated rotations with a precision plan (longtab calibrate).");
      return {
        name,
        format: format(2),
        layerFormats: plan.map((l) => ({
          key: { ...l.key, groupSize },
          value: { ...l.value, groupSize },
        })),
        rotation: { key: options.calibrated.key, value: options.calibrated.value },
      };
    }
    case 'int2-hadamard': {
      const h = rotationSet('hadamard', shape.layers, shape.kvHeads, shape.headDim);
      return { name: 'int2-hadamard', format: format(2), rotation: { key: h, value: h } };
    }
    case 'int2-calibrated':
      if (!options.calibrated)
        throw new InvalidRequestError('int2-calibrated needs calibrated rotations (longtab calibrate).');
      return {
        name,
        format: format(2, options.calibrated.clip),
        rotation: { key: options.calibrated.key, value: options.calibrated.value },
      };
    default:
      throw new InvalidRequestError(`Unknown KV variant '${name}': use ${FIDELITY_MODES.join(', ')} or f32.`);
  }
}

/** Sums over (query, head) samples of one layer and one variant. */
export interface FidelitySums {
  samples: number;
  relativeError: number;
  kl: number;
  /** Σ over samples of the fraction of attended positions read from quantized pages. */
  quantizedFraction: number;
  maxRelativeError: number;
  /**
   * Retrieval: Σ over samples of the f16 cache's attention mass on its TOP_POSITIONS heaviest quantized positions,
   * and Σ of how much of that mass the variant loses there (max(0, f16 mass − its mass on the same positions)).
   * Their ratio is the share of the far matches queries retrieve that the quantized cache loses (0 for f16); heads
   * that retrieve nothing from far count little.
   */
  topMass: number;
  topMassLost: number;
}

/** Positions per (query, head) whose f16 attention mass the retrieval measure follows. */
export const TOP_POSITIONS = 4;

export function emptySums(): FidelitySums {
  return { samples: 0, relativeError: 0, kl: 0, quantizedFraction: 0, maxRelativeError: 0, topMass: 0, topMassLost: 0 };
}

/** The rows read dequantized by the query at t: [start, end) (empty when end = start). */
export function quantizedRange(policy: QuantPolicy, t: number): { start: number; end: number } {
  const { pageTokens: p } = policy;
  const start = Math.ceil(policy.sink / p) * p;
  const position = Math.floor(t / policy.stepTokens) * policy.stepTokens;
  // Page i is demoted once (i + 1)·p <= position − window, i.e. rows below ⌊(position − window)/p⌋·p.
  const end = Math.floor((position - policy.window) / p) * p;
  return { start, end: Math.max(start, end) };
}

/** The first query position whose history holds a quantized page (the queries the metrics average over). */
export function firstQuantizedQuery(policy: QuantPolicy): number {
  const { start } = quantizedRange(policy, 0);
  const position = start + policy.pageTokens + policy.window;
  return Math.ceil(position / policy.stepTokens) * policy.stepTokens;
}

/** The cache's view of one layer under one variant: stored (rotated, f16) rows, their dequantized form, queries. */
interface CacheView {
  keys: Float32Array;
  values: Float32Array;
  quantKeys: Float32Array | null;
  quantValues: Float32Array | null;
  queries: Float32Array;
  /** headDim² per KV head, for rotating the output back; null: no rotation. */
  valueRotation: Float32Array | null;
}

/** x·R per head (f64 accumulation of f32 inputs, as kernels/rotate.wgsl up to order), for `rows` rows. */
function rotateRows(
  x: Float32Array,
  rotation: Float32Array,
  rows: number,
  heads: number,
  headDim: number,
  headsPerMatrix: number,
  firstMatrix: number,
): Float32Array {
  const d = headDim;
  const y = new Float32Array(x.length);
  for (let r = 0; r < rows; r++) {
    for (let h = 0; h < heads; h++) {
      const base = (r * heads + h) * d;
      const m = (firstMatrix + Math.floor(h / headsPerMatrix)) * d * d;
      for (let j = 0; j < d; j++) {
        let acc = 0;
        for (let i = 0; i < d; i++) acc += x[base + i] * rotation[m + i * d + j];
        y[base + j] = acc;
      }
    }
  }
  return y;
}

function cacheView(
  layer: number,
  acts: LayerActivations,
  tokens: number,
  shape: AttentionShape,
  variant: FidelityVariant,
): CacheView {
  const { heads, kvHeads, headDim: d } = shape;
  const width = kvHeads * d;
  const first = layer * kvHeads;
  const r = variant.rotation;
  const k = acts.k.subarray(0, tokens * width);
  const v = acts.v.subarray(0, tokens * width);
  const q = acts.q.subarray(0, tokens * heads * d);
  // kv-append packs the (rotated) f32 rows to f16.
  const store = (x: Float32Array) => (variant.storage === 'f32' ? x : x.map(roundToF16));
  const keys = store(r ? rotateRows(k, r.key, tokens, kvHeads, d, 1, first) : k);
  const values = store(r ? rotateRows(v, r.value, tokens, kvHeads, d, 1, first) : v);
  const queries = r ? rotateRows(q, r.key, tokens, heads, d, heads / kvHeads, first) : q;
  const formats = variantFormats(variant, layer);
  const quantize = (rows: Float32Array, format: Omit<QuantRowFormat, 'width'> | null) => {
    if (!format) return rows;
    return roundTripRows(rows, { ...format, width });
  };
  const quantKeys = formats ? quantize(keys, formats.key) : null;
  const quantValues = formats ? quantize(values, formats.value) : null;
  const valueRotation = r ? r.value.subarray(first * d * d, (first + kvHeads) * d * d) : null;
  return { keys, values, quantKeys, quantValues, queries, valueRotation };
}

/** The formats `variant` gives `layer`'s demoted rows (null: none are quantized). */
function variantFormats(variant: FidelityVariant, layer: number): FidelityFormats | null {
  return variant.layerFormats?.[layer] ?? variant.format;
}

/** Scratch of one (query, head) attention: scores (then log-probabilities) and the output. */
interface HeadResult {
  logp: Float64Array;
  output: Float64Array;
}

/** Attention of query t, head h over positions 0..t of `view`; rows in [qStart, qEnd) read dequantized. */
function attend(
  view: CacheView,
  shape: AttentionShape,
  t: number,
  h: number,
  qStart: number,
  qEnd: number,
  out: HeadResult,
  rotated: Float64Array,
): void {
  const { heads, kvHeads, headDim: d } = shape;
  const width = kvHeads * d;
  const g = Math.floor(h / (heads / kvHeads));
  const scale = 1 / Math.sqrt(d);
  const qBase = (t * heads + h) * d;
  const { queries } = view;
  const logp = out.logp;
  let max = Number.NEGATIVE_INFINITY;
  for (let j = 0; j <= t; j++) {
    const quant = j >= qStart && j < qEnd;
    const keys = quant ? (view.quantKeys as Float32Array) : view.keys;
    const kBase = j * width + g * d;
    let dot = 0;
    for (let e = 0; e < d; e++) dot += queries[qBase + e] * keys[kBase + e];
    const s = dot * scale;
    logp[j] = s;
    if (s > max) max = s;
  }
  let sum = 0;
  for (let j = 0; j <= t; j++) sum += Math.exp(logp[j] - max);
  const logZ = max + Math.log(sum);
  const o = view.valueRotation ? rotated : out.output;
  o.fill(0);
  for (let j = 0; j <= t; j++) {
    logp[j] -= logZ;
    const p = Math.exp(logp[j]);
    const quant = j >= qStart && j < qEnd;
    const values = quant ? (view.quantValues as Float32Array) : view.values;
    const vBase = j * width + g * d;
    for (let e = 0; e < d; e++) o[e] += p * values[vBase + e];
  }
  if (view.valueRotation) {
    // Back from the stored basis: o · R_Vᵀ.
    const m = g * d * d;
    const rot = view.valueRotation;
    for (let i = 0; i < d; i++) {
      let acc = 0;
      for (let e = 0; e < d; e++) acc += o[e] * rot[m + i * d + e];
      out.output[i] = acc;
    }
  }
}

/**
 * Adds one layer of one window to `sums` (one entry per variant), every head, at the query positions `queries`: a
 * list, or the first of a range that runs to the end of the window (default firstQuantizedQuery(policy)).
 */
export function accumulateLayerFidelity(
  layer: number,
  acts: LayerActivations,
  tokens: number,
  shape: AttentionShape,
  policy: QuantPolicy,
  variants: readonly FidelityVariant[],
  sums: FidelitySums[],
  queries: number | readonly number[] = firstQuantizedQuery(policy),
): void {
  const { heads, headDim: d } = shape;
  const reference = cacheView(layer, acts, tokens, shape, { name: 'f16', format: null, rotation: null });
  const views = variants.map((v) => cacheView(layer, acts, tokens, shape, v));
  const ref: HeadResult = { logp: new Float64Array(tokens), output: new Float64Array(d) };
  const cur: HeadResult = { logp: new Float64Array(tokens), output: new Float64Array(d) };
  const rotated = new Float64Array(d);
  const top = new Int32Array(TOP_POSITIONS);
  const positions =
    typeof queries === 'number'
      ? Array.from({ length: Math.max(0, tokens - queries) }, (_, i) => queries + i)
      : queries;
  for (const t of positions) {
    if (!Number.isInteger(t) || t < 0 || t >= tokens)
      throw new RangeError(`fidelity: query ${t} is outside the window`);
    const { start, end } = quantizedRange(policy, t);
    const fraction = (Math.min(end, t + 1) - Math.min(start, t + 1)) / (t + 1);
    for (let h = 0; h < heads; h++) {
      attend(reference, shape, t, h, 0, 0, ref, rotated);
      let refNorm = 0;
      for (let e = 0; e < d; e++) refNorm += ref.output[e] ** 2;
      refNorm = Math.sqrt(refNorm);
      const found = heaviest(ref.logp, start, Math.min(end, t + 1), top);
      let mass = 0;
      for (let i = 0; i < found; i++) mass += Math.exp(ref.logp[top[i]]);
      for (let i = 0; i < views.length; i++) {
        const view = views[i];
        const quantized = view.quantKeys !== null;
        attend(view, shape, t, h, quantized ? start : 0, quantized ? end : 0, cur, rotated);
        let err = 0;
        for (let e = 0; e < d; e++) err += (cur.output[e] - ref.output[e]) ** 2;
        err = Math.sqrt(err);
        const relative = refNorm > 0 ? err / refNorm : err > 0 ? Number.POSITIVE_INFINITY : 0;
        let kl = 0;
        for (let j = 0; j <= t; j++) kl += Math.exp(ref.logp[j]) * (ref.logp[j] - cur.logp[j]);
        let kept = 0;
        for (let k = 0; k < found; k++) kept += Math.exp(cur.logp[top[k]]);
        const s = sums[i];
        s.samples++;
        s.relativeError += relative;
        // KL >= 0; a sum of rounding errors between near-equal distributions may dip below by ~1e-17.
        s.kl += Math.max(0, kl);
        s.quantizedFraction += quantized ? fraction : 0;
        s.maxRelativeError = Math.max(s.maxRelativeError, relative);
        s.topMass += mass;
        s.topMassLost += Math.max(0, mass - kept);
      }
    }
  }
}

/** Writes into `top` the indices of the (up to) top.length largest logp[start..end); returns how many. */
function heaviest(logp: Float64Array, start: number, end: number, top: Int32Array): number {
  let found = 0;
  for (let j = start; j < end; j++) {
    if (found < top.length) {
      top[found++] = j;
      continue;
    }
    let min = 0;
    for (let k = 1; k < found; k++) if (logp[top[k]] < logp[top[min]]) min = k;
    if (logp[j] > logp[top[min]]) top[min] = j;
  }
  return found;
}

/**
 * The attention output the runtime computes with `variant`'s cache under `policy`, [tokens × heads × headDim] for
 * queries 0..tokens-1: for validation against an output captured from the GPU running that cache.
 */
export function emulatedAttention(
  layer: number,
  acts: LayerActivations,
  tokens: number,
  shape: AttentionShape,
  policy: QuantPolicy,
  variant: FidelityVariant,
): Float32Array {
  const { heads, headDim: d } = shape;
  const view = cacheView(layer, acts, tokens, shape, variant);
  const out = new Float32Array(tokens * heads * d);
  const cur: HeadResult = { logp: new Float64Array(tokens), output: new Float64Array(d) };
  const rotated = new Float64Array(d);
  for (let t = 0; t < tokens; t++) {
    const { start, end } = view.quantKeys ? quantizedRange(policy, t) : { start: 0, end: 0 };
    for (let h = 0; h < heads; h++) {
      attend(view, shape, t, h, start, end, cur, rotated);
      out.set(cur.output, (t * heads + h) * d);
    }
  }
  return out;
}

export interface LayerFidelity {
  layer: number;
  /** Per variant name. */
  /** retrievalLoss: topMassLost / topMass (FidelitySums). */
  variants: Record<string, { relativeError: number; kl: number; maxRelativeError: number; retrievalLoss: number }>;
}

export interface FidelitySummary {
  /** (query, head) samples per layer and variant. */
  samples: number;
  /** Mean fraction of the attended positions read from quantized pages, over the samples. */
  quantizedFraction: number;
  layers: LayerFidelity[];
  /** Mean over layers, per variant. */
  mean: Record<string, { relativeError: number; kl: number }>;
}

export function summarize(variants: readonly FidelityVariant[], perLayer: FidelitySums[][]): FidelitySummary {
  const layers = perLayer.map((sums, layer) => ({
    layer,
    variants: Object.fromEntries(
      variants.map((v, i) => [
        v.name,
        {
          relativeError: sums[i].relativeError / sums[i].samples,
          kl: sums[i].kl / sums[i].samples,
          maxRelativeError: sums[i].maxRelativeError,
          retrievalLoss: sums[i].topMass > 0 ? sums[i].topMassLost / sums[i].topMass : 0,
        },
      ]),
    ),
  }));
  const mean = Object.fromEntries(
    variants.map((v) => [
      v.name,
      {
        relativeError: layers.reduce((s, l) => s + l.variants[v.name].relativeError, 0) / layers.length,
        kl: layers.reduce((s, l) => s + l.variants[v.name].kl, 0) / layers.length,
      },
    ]),
  );
  const quantizedOne = variants.findIndex((v) => v.format !== null || v.layerFormats !== undefined);
  const first = perLayer[0]?.[Math.max(0, quantizedOne)];
  return {
    samples: first?.samples ?? 0,
    quantizedFraction: quantizedOne >= 0 && first ? first.quantizedFraction / first.samples : 0,
    layers,
    mean,
  };
}

/** Two markdown tables (relative error, KL), one row per layer and a mean row, one column per variant. */
export function fidelityMarkdown(summary: FidelitySummary, variants: readonly string[]): string {
  const table = (title: string, pick: (x: { relativeError: number; kl: number }) => number) => {
    const head = `| layer | ${variants.join(' | ')} |\n| --- | ${variants.map(() => '---').join(' | ')} |\n`;
    const rows = summary.layers
      .map((l) => `| ${l.layer} | ${variants.map((v) => format(pick(l.variants[v]))).join(' | ')} |`)
      .join('\n');
    const mean = `| mean | ${variants.map((v) => format(pick(summary.mean[v]))).join(' | ')} |`;
    return `${title}\n\n${head}${rows}\n${mean}\n`;
  };
  return [
    table('Mean relative L2 error of the attention output, ||o − o_f16|| / ||o_f16||:', (x) => x.relativeError),
    table('Mean KL(p_f16 || p) of the attention weights (nats):', (x) => x.kl),
  ].join('\n');
}

function format(x: number): string {
  if (x === 0) return '0';
  if (!Number.isFinite(x)) return String(x);
  return x >= 0.01 ? x.toFixed(4) : x.toExponential(2);
}
