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
  /** Per window, its mean negative log-likelihood (every window scores ctx − 1 tokens): for paired comparisons. */
  windowMeanNll: number[];
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
  const windowMeanNll: number[] = [];
  for (let w = 0; w < total; w++) {
    const window = ids.slice(w * ctx, (w + 1) * ctx);
    const logits = await scorer.teacherForcedLogits(window);
    const predicted = new Int32Array(ctx - 1);
    let windowNll = 0;
    for (let t = 0; t + 1 < ctx; t++) {
      windowNll -= logProbability(logits, t * vocab, vocab, window[t + 1]);
      predicted[t] = argmaxRow(logits, t * vocab, vocab);
      scored++;
    }
    nll += windowNll;
    windowMeanNll.push(windowNll / (ctx - 1));
    argmax.push(predicted);
    options.onWindow?.(w + 1, total);
  }
  const meanNll = scored > 0 ? nll / scored : Number.NaN;
  return { windows: total, tokensScored: scored, meanNll, perplexity: Math.exp(meanNll), argmax, windowMeanNll };
}

/** Two-sided 95% quantiles of Student's t for 1..10 degrees of freedom (standard tables). */
const T95_TABLE = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228];

/**
 * Two-sided 95% quantile of Student's t with `df` degrees of freedom: the table up to 10, then a Cornish–Fisher
 * expansion around the normal quantile (error < 2e-4 from 10 on; it is too small below, 0.023 at df 3).
 */
export function studentT95(df: number): number {
  if (df <= T95_TABLE.length) return T95_TABLE[Math.max(1, Math.round(df)) - 1];
  const z = 1.959963984540054;
  const z3 = z ** 3;
  const z5 = z ** 5;
  const z7 = z ** 7;
  return (
    z +
    (z3 + z) / (4 * df) +
    (5 * z5 + 16 * z3 + 3 * z) / (96 * df ** 2) +
    (3 * z7 + 19 * z5 + 17 * z3 - 15 * z) / (384 * df ** 3)
  );
}

/**
 * 95% interval of perplexity(mode) / perplexity(reference) − 1 from paired windows (the same text windows under two
 * caches): a t interval on the per-window differences of mean log-likelihood, exponentiated. Windows differ far more
 * from each other (one article is easy, the next is not) than two caches differ on one window, so pairing is what
 * makes a difference of a few percent measurable. Null with fewer than 3 windows.
 */
export function pairedPerplexityRatioInterval(
  modeWindowNll: number[],
  referenceWindowNll: number[],
): { low: number; high: number } | null {
  const n = Math.min(modeWindowNll.length, referenceWindowNll.length);
  if (n < 3) return null;
  const diffs = Array.from({ length: n }, (_, w) => modeWindowNll[w] - referenceWindowNll[w]);
  const mean = diffs.reduce((s, d) => s + d, 0) / n;
  const variance = diffs.reduce((s, d) => s + (d - mean) ** 2, 0) / (n - 1);
  const half = studentT95(n - 1) * Math.sqrt(variance / n);
  return { low: Math.exp(mean - half) - 1, high: Math.exp(mean + half) - 1 };
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
