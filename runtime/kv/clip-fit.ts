/**
 * The clip fit of the 2-bit cache's row formats: which clip quantile of each K and V group quantizes a sample of the
 * model's own rows with the least attention error, measured with the exact quantizer the cache uses. Pure CPU
 * arithmetic over rows the calibration captured (runtime/calibration/calibrate.ts).
 */
import { defaultGroupSize, type QuantRowFormat, roundToF16, roundTripRows } from './quant-format.ts';

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

export function resolveClipFormat(
  heads: { kvHeads: number; headDim: number },
  f: ClipFitFormat,
): Omit<QuantRowFormat, 'clipQuantile'> {
  const width = heads.kvHeads * heads.headDim;
  return { width, bits: f.bits ?? 2, groupSize: f.groupSize ?? defaultGroupSize(heads.kvHeads, heads.headDim) };
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
  options: { between?: () => Promise<void>; grid?: readonly number[]; onLayer?: (layer: number) => void } = {},
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
      const kBack = roundTripRows(rk, f);
      const vBack = roundTripRows(rv, f);
      for (let t = 0; t < n; t++) {
        const row = (x: Float32Array | Float64Array) => x.subarray(t * width, (t + 1) * width);
        const kErr = difference(row(kBack), row(rk));
        const vErr = difference(row(vBack), row(rv));
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
