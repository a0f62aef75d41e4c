/**
 * CPU reference for kernels/sample.wgsl: the same chain (repetition penalty → top-k → top-p → min-p →
 * temperature → inverse-CDF draw in id order) with the same tie rule (every logit equal to a threshold is kept),
 * in f64 except the penalized logits, which are f32 as on the GPU. The GPU's top-p mass is exact 32.32 fixed point
 * of f32 weights and its draw sums are f32, so results may differ only where `nearBoundary` says so.
 */
export interface SampleReferenceParams {
  temperature: number;
  topK: number;
  topP: number;
  minP: number;
  repetitionPenalty: number;
}

export interface SampleReferenceResult {
  /** Logits after the repetition penalty (f32). */
  penalized: Float32Array;
  /** Surviving ids, ascending. */
  candidates: number[];
  /** softmax(logit / T) over `candidates`, same order. */
  probabilities: number[];
  choice: number;
  /**
   * True when f32 rounding on the GPU could legitimately change the result: a top-p cumulative mass, a min-p
   * threshold or the draw's target lies within a relative `eps` of a decision boundary.
   */
  nearBoundary: boolean;
}

/** llama.cpp repeat penalty: each id in `history` once, logit/penalty if positive, else logit*penalty. */
export function penalizeReference(logits: Float32Array, history: readonly number[], penalty: number): Float32Array {
  const out = Float32Array.from(logits);
  if (penalty === 1) return out;
  for (const id of new Set(history)) {
    if (id < 0 || id >= logits.length) continue;
    const l = logits[id];
    out[id] = l > 0 ? Math.fround(l / penalty) : Math.fround(l * penalty);
  }
  return out;
}

/** Argmax, lowest id among equal maxima. */
export function argmaxReference(values: ArrayLike<number>): number {
  let best = 0;
  for (let i = 1; i < values.length; i++) if (values[i] > values[best]) best = i;
  return best;
}

export function sampleReference(
  logits: Float32Array,
  params: SampleReferenceParams,
  history: readonly number[],
  u: number,
  eps = 2e-5,
): SampleReferenceResult {
  const vocab = logits.length;
  const penalized = penalizeReference(logits, history, params.repetitionPenalty);
  const argmax = argmaxReference(penalized);
  const max = penalized[argmax];
  if (params.temperature === 0) {
    return { penalized, candidates: [argmax], probabilities: [1], choice: argmax, nearBoundary: false };
  }
  let nearBoundary = false;
  const order = Array.from({ length: vocab }, (_, i) => i).sort((a, b) => penalized[b] - penalized[a] || a - b);

  let threshold = Number.NEGATIVE_INFINITY;
  if (params.topK > 0 && params.topK < vocab) threshold = penalized[order[params.topK - 1]];

  if (params.topP < 1) {
    let z = 0;
    for (const i of order) if (penalized[i] >= threshold) z += Math.exp(penalized[i] - max);
    const goal = params.topP * z;
    let cum = 0;
    for (let j = 0; j < vocab; ) {
      const v = penalized[order[j]];
      if (v < threshold) break;
      // All ids tied at v enter together.
      while (j < vocab && penalized[order[j]] === v) cum += Math.exp(penalized[order[j++]] - max);
      if (Math.abs(cum - goal) <= eps * z) nearBoundary = true;
      if (cum >= goal) {
        threshold = Math.max(threshold, v);
        break;
      }
    }
  }

  if (params.minP > 0) {
    const minLogit = max + Math.log(params.minP);
    for (const l of penalized) if (Math.abs(l - minLogit) <= eps * Math.max(1, Math.abs(minLogit))) nearBoundary = true;
    threshold = Math.max(threshold, minLogit);
  }

  const candidates: number[] = [];
  const weights: number[] = [];
  let total = 0;
  for (let i = 0; i < vocab; i++) {
    if (penalized[i] < threshold) continue;
    const w = Math.exp((penalized[i] - max) / params.temperature);
    candidates.push(i);
    weights.push(w);
    total += w;
  }
  const goal = u * total;
  let cum = 0;
  let choice = candidates[candidates.length - 1];
  for (let j = 0; j < candidates.length; j++) {
    if (weights[j] > 0 && cum + weights[j] > goal) {
      choice = candidates[j];
      if (Math.abs(cum - goal) <= eps * total || Math.abs(cum + weights[j] - goal) <= eps * total) {
        nearBoundary = true;
      }
      break;
    }
    cum += weights[j];
  }
  return { penalized, candidates, probabilities: weights.map((w) => w / total), choice, nearBoundary };
}
