/**
 * Chooses the 2-bit cache's precision plan (runtime/kv/precision-plan.ts) by what each choice costs the model's own
 * predictions, with no user input. The calibration builds a retrieval probe from its own text: the text, then a few
 * of its passages repeated after the recent window, so that the repeats can only be predicted by reading far back
 * into quantized pages. The probe runs teacher-forced through the real forward over a quant pool (calibrate.ts,
 * `chooseKvPrecisionPlan`): once with every side (a layer's K or its V) at 2 bits unclipped, the baseline, then once
 * for each side and each other candidate with only that side changed: the costs are measured around the point most
 * sides of a plan end at, so that the sum of the chosen sides' costs stays close to what the plan costs as a whole
 * (measured around 4-bit sides, the costs of many 1-bit sides at once were underestimated:
 * docs/results/2026-12-02-plan-by-model-loss-h200.md). A candidate's cost is what it adds, against the
 * baseline, to the mean negative log-likelihood of the next token at
 *   - copy rows: inside the repeats, where the next token is the copy of one far back (what retrieval feels);
 *   - plain rows: ordinary text whose history holds quantized pages (what perplexity feels);
 * the two means summed. Measuring the end of the network, not one layer's attention, weighs each layer by how much
 * the model's output depends on it: a layer that carries the copying shows it, whichever side it needs.
 * The knapsack's plan is the choice of one candidate per side with the least total cost whose effective bits at the
 * budget's context (sink, window and scales counted) stay within the budget: an exact multiple-choice knapsack over
 * the sides' code bits. Single-side costs do not add up where many sides go to 1 bit at once (a held-out model's
 * plan with six 1-bit value sides cost +7.1% perplexity: docs/results/2026-12-03-heldout3-h200.md), so the plan
 * kept is the one with the least loss measured as a whole (`pickMeasuredPlan`) among the knapsack's plan, the
 * knapsack's plan without 1-bit candidates, and the baseline where it fits the budget.
 */
import { InvalidRequestError } from '../../core/errors.ts';
import type { QuantPolicy } from '../eval/fidelity.ts';
import {
  f16Positions,
  type KvF16Share,
  type KvLayerPrecision,
  type KvSidePrecision,
  planEffectiveBits,
  uniformPlan,
} from '../kv/precision-plan.ts';

/** The formats a side may take: 1 bit, 2 bits at a few clip quantiles, 4 bits unclipped (keys: `sideCandidates`). */
export const SIDE_CANDIDATES: readonly KvSidePrecision[] = [
  { bits: 1, clipQuantile: 1 },
  { bits: 2, clipQuantile: 1 },
  { bits: 2, clipQuantile: 0.96 },
  { bits: 2, clipQuantile: 0.92 },
  { bits: 4, clipQuantile: 1 },
];

/**
 * The candidates of keys and of values under `budget`. Keys take 1 bit only where no plan with 2-bit keys fits
 * (narrow rows, whose scales leave few code bits): every held-out plan with a 1-bit key side lost retrieval and
 * perplexity far beyond what the probe measured, while plans with 1-bit values and 2-bit keys did not
 * (docs/results/2026-12-03-heldout4-h200.md).
 */
export function sideCandidates(
  layers: number,
  options: { groupSize: number; share: KvF16Share; budget: { bitsPerElement: number; tokens: number } },
): { key: readonly KvSidePrecision[]; value: readonly KvSidePrecision[] } {
  const { groupSize, share, budget } = options;
  const cheapestWithTwoBitKeys = uniformPlan(layers, BASELINE_SIDE, { bits: 1, clipQuantile: 1 });
  const fits =
    planEffectiveBits(cheapestWithTwoBitKeys, groupSize, share, budget.tokens) <= budget.bitsPerElement + 1e-9;
  return { key: fits ? SIDE_CANDIDATES.filter((c) => c.bits > 1) : SIDE_CANDIDATES, value: SIDE_CANDIDATES };
}

/** The candidate every other side holds while one side is measured. */
export const BASELINE_SIDE: KvSidePrecision = { bits: 2, clipQuantile: 1 };

/** The default budget: effective bits per element of one sequence at this context (docs/kv-cache.md). */
export const DEFAULT_PLAN_BUDGET = { bitsPerElement: 2.5, tokens: 32768 } as const;

export interface RetrievalProbe {
  tokens: number[];
  /** Rows whose next token is inside a repeat, two or more tokens into it: the copy of a token far back. */
  copyRows: number[];
  /** Rows of ordinary text whose history holds quantized pages, each scored on the text's own next token. */
  plainRows: number[];
}

export interface ProbeSettings {
  /** Probe length (default 1024). */
  length: number;
  /** Repeated passages and their length (default 4 × 64). */
  repeats: number;
  span: number;
}

export const DEFAULT_PROBE: ProbeSettings = { length: 1024, repeats: 4, span: 64 };

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
  // A source ends before the window of the first repeat's first row: quantized for every row that reads it.
  const lastStart =
    Math.floor((base - policy.window - span) / policy.pageTokens) * policy.pageTokens - policy.pageTokens;
  if (text.length < base || lastStart < sink + policy.pageTokens) {
    throw new InvalidRequestError(
      `retrieval probe: needs ${base} tokens of text and length ${length} > sink + window + ${repeats + 2} passages of ${span}.`,
    );
  }
  const tokens = text.slice(0, base);
  const copyRows: number[] = [];
  for (let r = 0; r < repeats; r++) {
    const from =
      sink + policy.pageTokens + Math.round(((lastStart - sink - policy.pageTokens) * r) / Math.max(1, repeats - 1));
    const at = tokens.length;
    tokens.push(...text.slice(from, from + span));
    // Row at + j has read j + 1 tokens of the repeat and predicts its token j + 1.
    for (let j = 1; j + 1 < span; j++) copyRows.push(at + j);
  }
  const first = sink + policy.pageTokens + policy.window;
  const plainRows = Array.from({ length: Math.max(0, base - 1 - first) }, (_, i) => first + i);
  return { tokens, copyRows, plainRows };
}

/** Per layer, per side, per candidate (`sideCandidates` order): what it adds to the baseline's two losses. */
export interface SideScore {
  candidate: KvSidePrecision;
  /** Added mean negative log-likelihood (nats) at the copy rows. */
  copy: number;
  /** The same at the plain rows. */
  plain: number;
  /** copy + plain: what the plan search minimises. */
  error: number;
}

export interface LayerScores {
  key: SideScore[];
  value: SideScore[];
}

/** The probe's mean negative log-likelihoods under one plan. */
export interface ProbeLoss {
  copy: number;
  plain: number;
}

/** A side's score for `candidate` whose probe loss is `loss`, against the baseline's. */
export function sideScore(candidate: KvSidePrecision, loss: ProbeLoss, baseline: ProbeLoss): SideScore {
  const copy = loss.copy - baseline.copy;
  const plain = loss.plain - baseline.plain;
  return { candidate, copy, plain, error: copy + plain };
}

/** The plan of `layers` layers with every side at the baseline but `side` of `layer` at `candidate`. */
export function probePlan(
  layers: number,
  layer: number,
  side: 'key' | 'value',
  candidate: KvSidePrecision,
): KvLayerPrecision[] {
  return Array.from({ length: layers }, (_, l) => ({
    key: { ...(l === layer && side === 'key' ? candidate : BASELINE_SIDE) },
    value: { ...(l === layer && side === 'value' ? candidate : BASELINE_SIDE) },
  }));
}

/** Whether `a` is less than `b` by more than rounding (the search's ties go to fewer bits, then earlier). */
function below(a: number, b: number, tolerance: number): boolean {
  return b === Number.POSITIVE_INFINITY ? a < b : a < b - tolerance * Math.abs(b);
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
      if (!held || below(s.error, held.error, 1e-9)) byBits.set(s.candidate.bits, s);
    }
    const kept: SideScore[] = [];
    for (const s of [...byBits.values()].sort((a, b) => a.candidate.bits - b.candidate.bits)) {
      if (kept.length === 0 || below(s.error, kept[kept.length - 1].error, 1e-9)) kept.push(s);
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
        if (below(e, next[nb], 1e-12)) {
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
  for (let b = 1; b <= capacity; b++) if (below(last[b], last[total], 1e-12)) total = b;
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

/** The candidates of `scores` at 2 bits or more: the knapsack's second plan, with no side at 1 bit. */
export function withoutOneBitSides(scores: readonly LayerScores[]): LayerScores[] {
  const keep = (list: SideScore[]) => list.filter((s) => s.candidate.bits > 1);
  return scores.map((l) => ({ key: keep(l.key), value: keep(l.value) }));
}

/** A plan the calibration measured as a whole: its probe loss through the real forward. */
export interface MeasuredPlan {
  plan: KvLayerPrecision[];
  bitsPerElement: number;
  loss: ProbeLoss;
}

/**
 * The measured plan with the least probe loss (copy + plain, the sum the side costs estimate); ties go to fewer bits,
 * then to the earlier entry. Throws on an empty list.
 */
export function pickMeasuredPlan<T extends MeasuredPlan>(plans: readonly T[]): T {
  if (plans.length === 0) throw new Error('pickMeasuredPlan: no plan');
  let best = plans[0];
  for (const p of plans.slice(1)) {
    const a = p.loss.copy + p.loss.plain;
    const b = best.loss.copy + best.loss.plain;
    if (below(a, b, 1e-9) || (!below(b, a, 1e-9) && p.bitsPerElement < best.bitsPerElement - 1e-9)) best = p;
  }
  return best;
}
