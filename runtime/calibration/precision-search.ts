/**
 * Chooses the 2-bit cache's precision plan (runtime/kv/precision-plan.ts) by measured attention fidelity, with no
 * user input. The calibration builds a retrieval probe from its own text: the text, then a few of its passages
 * repeated after the recent window, so that the repeats can only be predicted by reading far back into quantized
 * pages. The probe runs once through the f16 forward (captured q/k/v, runtime/eval/fidelity-capture.ts); for every
 * layer and every candidate format of its K rows (V kept exact) and of its V rows (K kept exact), the emulation of
 * runtime/eval/fidelity.ts measures, against the f16 cache:
 *   - plain: the attention output's relative error at ordinary positions (what perplexity feels);
 *   - copy: the same at the repeats' positions (what retrieval feels; far positions matter most there);
 *   - lost: the share of the f16 attention mass on each repeat query's heaviest quantized positions that the
 *     candidate loses (the far matches a copying head finds).
 * A side's error is plain + copy + lost. The plan is the choice of one candidate per side (the clip too, per layer
 * and side) with the least total error whose effective bits at the budget's context (sink, window and scales
 * counted) stay within the budget: an exact multiple-choice knapsack over the sides' code bits.
 */
import { InvalidRequestError } from '../../core/errors.ts';
import {
  type AttentionShape,
  accumulateLayerFidelity,
  emptySums,
  type FidelityFormats,
  type FidelitySums,
  type FidelityVariant,
  type LayerActivations,
  type QuantPolicy,
} from '../eval/fidelity.ts';
import {
  f16Positions,
  type KvF16Share,
  type KvLayerPrecision,
  type KvSidePrecision,
  planEffectiveBits,
} from '../kv/precision-plan.ts';

/** The formats each side may take: 1 bit, 2 bits at a few clip quantiles, 4 bits unclipped. */
export const SIDE_CANDIDATES: readonly KvSidePrecision[] = [
  { bits: 1, clipQuantile: 1 },
  { bits: 2, clipQuantile: 1 },
  { bits: 2, clipQuantile: 0.96 },
  { bits: 2, clipQuantile: 0.92 },
  { bits: 4, clipQuantile: 1 },
];

/** The default budget: effective bits per element of one sequence at this context (docs/kv-cache.md). */
export const DEFAULT_PLAN_BUDGET = { bitsPerElement: 2.5, tokens: 32768 } as const;

export interface RetrievalProbe {
  tokens: number[];
  /** Positions inside the repeats (each repeat's first two left out: nothing tells a copy from text yet). */
  copyQueries: number[];
  /** Ordinary positions whose history holds quantized pages. */
  plainQueries: number[];
}

export interface ProbeSettings {
  /** Probe length (default 1024). */
  length: number;
  /** Repeated passages and their length (default 4 × 64). */
  repeats: number;
  span: number;
  /** Ordinary query positions sampled (default 128). */
  plainQueries: number;
}

export const DEFAULT_PROBE: ProbeSettings = { length: 1024, repeats: 4, span: 64, plainQueries: 128 };

/**
 * The probe of `text` (at least `length − repeats·span` tokens): text[0, base) with base = length − repeats·span,
 * then `repeats` passages of it, each taken from inside the part that is quantized by the time it is repeated.
 */
export function retrievalProbe(
  text: readonly number[],
  policy: QuantPolicy,
  settings: ProbeSettings = DEFAULT_PROBE,
): RetrievalProbe {
  const { length, repeats, span } = settings;
  const base = length - repeats * span;
  const sink = Math.ceil(policy.sink / policy.pageTokens) * policy.pageTokens;
  // A source ends before the window of the first repeat's first query: quantized for every query that reads it.
  const lastStart =
    Math.floor((base - policy.window - span) / policy.pageTokens) * policy.pageTokens - policy.pageTokens;
  if (text.length < base || lastStart < sink + policy.pageTokens) {
    throw new InvalidRequestError(
      `retrieval probe: needs ${base} tokens of text and length ${length} > sink + window + ${repeats + 2} passages of ${span}.`,
    );
  }
  const tokens = text.slice(0, base);
  const copyQueries: number[] = [];
  for (let r = 0; r < repeats; r++) {
    const from =
      sink + policy.pageTokens + Math.round(((lastStart - sink - policy.pageTokens) * r) / Math.max(1, repeats - 1));
    const at = tokens.length;
    tokens.push(...text.slice(from, from + span));
    for (let j = 2; j < span; j++) copyQueries.push(at + j);
  }
  const first = sink + policy.pageTokens + policy.window;
  const plainQueries = Array.from({ length: settings.plainQueries }, (_, i) =>
    Math.min(base - 1, first + Math.floor(((base - first) * i) / settings.plainQueries)),
  );
  return { tokens, copyQueries, plainQueries: [...new Set(plainQueries)] };
}

/** Per layer, per side, per candidate (SIDE_CANDIDATES order): the three measures and their sum. */
export interface SideScore {
  candidate: KvSidePrecision;
  plain: number;
  copy: number;
  lost: number;
  error: number;
}

export interface LayerScores {
  key: SideScore[];
  value: SideScore[];
}

function sideVariants(side: 'key' | 'value', groupSize: number, rotation: FidelityVariant['rotation']) {
  return SIDE_CANDIDATES.map((c): FidelityVariant => {
    const format = { bits: c.bits, groupSize, clipQuantile: c.clipQuantile };
    const formats: FidelityFormats = side === 'key' ? { key: format, value: null } : { key: null, value: format };
    return { name: `${side} ${c.bits}-bit clip ${c.clipQuantile}`, format: formats, rotation };
  });
}

/** Every k-th of `list`, so that at most `count` remain (evenly spread, first kept). */
function thinned(list: readonly number[], count: number): number[] {
  if (list.length <= count) return [...list];
  return Array.from({ length: count }, (_, i) => list[Math.floor((i * list.length) / count)]);
}

/**
 * The probe's queries, at most `samples` (query, head) pairs each for the copy and the plain measure: a model with
 * many heads is measured on fewer positions, so the emulation's time per layer does not grow with the head count.
 */
export function boundedProbe(
  probe: RetrievalProbe,
  heads: number,
  samples = { copy: 2048, plain: 1024 },
): RetrievalProbe {
  return {
    tokens: probe.tokens,
    copyQueries: thinned(probe.copyQueries, Math.max(1, Math.floor(samples.copy / heads))),
    plainQueries: thinned(probe.plainQueries, Math.max(1, Math.floor(samples.plain / heads))),
  };
}

/** Scores every candidate of both sides of one layer on the probe's captured activations. */
export function scoreLayer(
  layer: number,
  acts: LayerActivations,
  probe: RetrievalProbe,
  shape: AttentionShape,
  policy: QuantPolicy,
  groupSize: number,
  rotation: FidelityVariant['rotation'],
): LayerScores {
  const n = probe.tokens.length;
  const result: Partial<LayerScores> = {};
  for (const side of ['key', 'value'] as const) {
    const variants = sideVariants(side, groupSize, rotation);
    const plain: FidelitySums[] = variants.map(() => emptySums());
    const copy: FidelitySums[] = variants.map(() => emptySums());
    accumulateLayerFidelity(layer, acts, n, shape, policy, variants, plain, probe.plainQueries);
    accumulateLayerFidelity(layer, acts, n, shape, policy, variants, copy, probe.copyQueries);
    result[side] = SIDE_CANDIDATES.map((candidate, i) => {
      const p = plain[i].relativeError / Math.max(1, plain[i].samples);
      const c = copy[i].relativeError / Math.max(1, copy[i].samples);
      const lost = copy[i].topMass > 0 ? copy[i].topMassLost / copy[i].topMass : 0;
      return { candidate, plain: p, copy: c, lost, error: p + c + lost };
    });
  }
  return result as LayerScores;
}

export interface PlanChoice {
  plan: KvLayerPrecision[];
  /** Effective bits per element at the budget's context. */
  bitsPerElement: number;
  /** Sum over sides of the chosen candidates' errors. */
  error: number;
}

/**
 * The plan for `scores` (one entry per layer): one candidate per side, the least total error among the choices
 * whose effective bits at `budget.tokens` stay within `budget.bitsPerElement`. Within a side, a candidate is kept
 * only if it has less error than every cheaper one; ties go to fewer bits, then to the earlier (less clipped)
 * candidate. Deterministic for given scores. Throws when even the cheapest plan is over the budget.
 */
export function choosePlan(
  scores: readonly LayerScores[],
  options: { groupSize: number; share: KvF16Share; budget?: { bitsPerElement: number; tokens: number } },
): PlanChoice {
  const budget = options.budget ?? DEFAULT_PLAN_BUDGET;
  const sides = scores.flatMap((l) => [l.key, l.value]);
  // Per side: the best candidate at each bit width, then only those that beat every cheaper one.
  const choices = sides.map((list) => {
    const byBits = new Map<number, SideScore>();
    for (const s of list) {
      const held = byBits.get(s.candidate.bits);
      if (!held || s.error < held.error * (1 - 1e-9)) byBits.set(s.candidate.bits, s);
    }
    const kept: SideScore[] = [];
    for (const s of [...byBits.values()].sort((a, b) => a.candidate.bits - b.candidate.bits)) {
      if (kept.length === 0 || s.error < kept[kept.length - 1].error * (1 - 1e-9)) kept.push(s);
    }
    return kept;
  });
  // Code bits the budget leaves for the sides, in whole bits per side-element (every side has the same count).
  const tokens = budget.tokens;
  const f16 = f16Positions(options.share, tokens);
  const scaleBits = 32 / options.groupSize;
  const quantBitsAllowed = (budget.bitsPerElement * tokens - 16 * f16) / Math.max(1, tokens - f16) - scaleBits;
  const capacity = Math.floor(quantBitsAllowed * sides.length + 1e-9);
  const cheapest = choices.reduce((n, o) => n + o[0].candidate.bits, 0);
  if (capacity < cheapest) {
    throw new InvalidRequestError(
      `KV precision plan: a budget of ${budget.bitsPerElement} bits per element at ${tokens} positions leaves ${quantBitsAllowed.toFixed(3)} code bits per element, below the cheapest plan's ${(cheapest / sides.length).toFixed(3)}.`,
    );
  }
  // best[i][b]: least error of sides 0..i-1 with b code bits in all; choice[i][b] the option of side i-1 there.
  const best: Float64Array[] = [new Float64Array(capacity + 1).fill(Number.POSITIVE_INFINITY)];
  best[0][0] = 0;
  const choice: Int8Array[] = [];
  for (const [i, opts] of choices.entries()) {
    const next = new Float64Array(capacity + 1).fill(Number.POSITIVE_INFINITY);
    const pick = new Int8Array(capacity + 1).fill(-1);
    for (let b = 0; b <= capacity; b++) {
      if (best[i][b] === Number.POSITIVE_INFINITY) continue;
      for (const [k, o] of opts.entries()) {
        const nb = b + o.candidate.bits;
        if (nb > capacity) break;
        const e = best[i][b] + o.error;
        if (e < next[nb] * (1 - 1e-12)) {
          next[nb] = e;
          pick[nb] = k;
        }
      }
    }
    best.push(next);
    choice.push(pick);
  }
  // The least error over all totals; ties: fewer bits.
  const last = best[sides.length];
  let total = 0;
  for (let b = 1; b <= capacity; b++) if (last[b] < last[total] * (1 - 1e-12)) total = b;
  const picked: SideScore[] = new Array(sides.length);
  for (let i = sides.length - 1, b = total; i >= 0; i--) {
    const k = choice[i][b];
    picked[i] = choices[i][k];
    b -= choices[i][k].candidate.bits;
  }
  const plan = scores.map((_, l) => ({
    key: { ...picked[2 * l].candidate },
    value: { ...picked[2 * l + 1].candidate },
  }));
  return {
    plan,
    bitsPerElement: planEffectiveBits(plan, options.groupSize, options.share, tokens),
    error: picked.reduce((s, p) => s + p.error, 0),
  };
}
