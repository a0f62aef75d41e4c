/** Summaries of timed repeats: medians and spreads, the same for longtab and llama.cpp rows. */

/** One timed run: a prefill of `promptTokens` and the decode steps after it. */
export interface TimedRepeat {
  promptTokens: number;
  /** From the start of prefill to the first sampled token (read back on the host). */
  ttftMs: number;
  prefillTokensPerSecond: number;
  /** Wall time of each decode step: from one token on the host to the next. */
  stepMs: number[];
}

export interface Spread {
  median: number;
  min: number;
  max: number;
  /** 10th and 90th percentiles (nearest rank). */
  p10: number;
  p90: number;
  count: number;
}

export interface RowTiming {
  /** Repeats asked for and repeats that ran (fewer when the row's time budget ran out). */
  repeatsRequested: number;
  repeats: number;
  /** Over repeats; null when the prefill was not measured (fast fill). */
  prefillTokensPerSecond: Spread | null;
  ttftMs: Spread | null;
  /** Over every decode step of every repeat. */
  tpotMs: Spread;
  /** 1000 / median TPOT. */
  decodeTokensPerSecond: number;
}

export function spread(values: readonly number[]): Spread {
  const sorted = values.filter((v) => Number.isFinite(v)).sort((a, b) => a - b);
  if (sorted.length === 0)
    return { median: Number.NaN, min: Number.NaN, max: Number.NaN, p10: Number.NaN, p90: Number.NaN, count: 0 };
  const at = (q: number) => sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))];
  const mid = sorted.length >> 1;
  const median = sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
  return { median, min: sorted[0], max: sorted[sorted.length - 1], p10: at(0.1), p90: at(0.9), count: sorted.length };
}

export function summarize(repeats: readonly TimedRepeat[], requested: number, prefillMeasured = true): RowTiming {
  const tpot = spread(repeats.flatMap((r) => r.stepMs));
  return {
    repeatsRequested: requested,
    repeats: repeats.length,
    prefillTokensPerSecond: prefillMeasured ? spread(repeats.map((r) => r.prefillTokensPerSecond)) : null,
    ttftMs: prefillMeasured ? spread(repeats.map((r) => r.ttftMs)) : null,
    tpotMs: tpot,
    decodeTokensPerSecond: 1000 / tpot.median,
  };
}
