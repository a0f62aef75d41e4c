/**
 * Perplexity over non-overlapping windows, the go/no-go test for a KV cache format: every window starts a fresh
 * sequence, so a window of N tokens exercises the cache at every length up to N.
 */

export interface WindowScorer {
  /**
   * Logits after each prefix of `ids` ([ids.length × vocab]). With `rows`, only the rows it accepts are needed: a
   * scorer may leave the others zero and skip reading them back (a retrieval trial scores a few dozen of 2K rows).
   */
  teacherForcedLogits(ids: number[], rows?: (row: number) => boolean): Promise<Float32Array>;
}

export interface PerplexityResult {
  windows: number;
  tokensScored: number;
  meanNll: number;
  perplexity: number;
  /** Per window, the predicted (argmax) id at each scored position: for top-1 agreement between caches. */
  argmax: Int32Array[];
}

/** log p(target | row) for one row of logits, in f64. */
export function logProbability(logits: Float32Array, offset: number, vocab: number, target: number): number {
  let max = Number.NEGATIVE_INFINITY;
  for (let i = 0; i < vocab; i++) max = Math.max(max, logits[offset + i]);
  let sum = 0;
  for (let i = 0; i < vocab; i++) sum += Math.exp(logits[offset + i] - max);
  return logits[offset + target] - max - Math.log(sum);
}

function argmaxRow(logits: Float32Array, offset: number, vocab: number): number {
  let best = 0;
  for (let i = 1; i < vocab; i++) if (logits[offset + i] > logits[offset + best]) best = i;
  return best;
}

/** Cuts `ids` into windows of `ctx` tokens (the last partial window is dropped) and scores every next token. */
export async function perplexity(
  scorer: WindowScorer,
  ids: number[],
  ctx: number,
  vocab: number,
  options: { maxWindows?: number; onWindow?: (done: number, total: number) => void } = {},
): Promise<PerplexityResult> {
  const total = Math.min(Math.floor(ids.length / ctx), options.maxWindows ?? Number.POSITIVE_INFINITY);
  let nll = 0;
  let scored = 0;
  const argmax: Int32Array[] = [];
  for (let w = 0; w < total; w++) {
    const window = ids.slice(w * ctx, (w + 1) * ctx);
    const logits = await scorer.teacherForcedLogits(window);
    const predicted = new Int32Array(ctx - 1);
    for (let t = 0; t + 1 < ctx; t++) {
      nll -= logProbability(logits, t * vocab, vocab, window[t + 1]);
      predicted[t] = argmaxRow(logits, t * vocab, vocab);
      scored++;
    }
    argmax.push(predicted);
    options.onWindow?.(w + 1, total);
  }
  const meanNll = scored > 0 ? nll / scored : Number.NaN;
  return { windows: total, tokensScored: scored, meanNll, perplexity: Math.exp(meanNll), argmax };
}

/** Fraction of scored positions where two runs predicted the same top-1 token. */
export function topOneAgreement(a: Int32Array[], b: Int32Array[]): number {
  let same = 0;
  let count = 0;
  for (let w = 0; w < Math.min(a.length, b.length); w++) {
    for (let t = 0; t < a[w].length; t++) {
      same += a[w][t] === b[w][t] ? 1 : 0;
      count++;
    }
  }
  return count > 0 ? same / count : Number.NaN;
}
