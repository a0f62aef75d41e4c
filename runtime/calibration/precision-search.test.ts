import { describe, expect, it } from 'vitest';
import { seededRandom } from '../../test/random.ts';
import { DEFAULT_QUANT_POLICY, quantizedRange } from '../eval/fidelity.ts';
import { planEffectiveBits } from '../kv/precision-plan.ts';
import {
  choosePlan,
  type LayerScores,
  pickMeasuredPlan,
  retrievalProbe,
  SIDE_CANDIDATES,
  type SideScore,
  sideCandidates,
  withoutOneBitSides,
} from './precision-search.ts';

function randomScores(random: () => number, layers: number): LayerScores[] {
  const side = (): SideScore[] =>
    SIDE_CANDIDATES.map((candidate) => {
      // Error falls with the bits (plus noise), as measured errors do; some sides barely care.
      const scale = random() < 0.3 ? 0.01 : 1;
      const error = (scale * (1 + random())) / candidate.bits ** 2;
      return { candidate, plain: error / 2, copy: error / 2, error };
    });
  return Array.from({ length: layers }, () => ({ key: side(), value: side() }));
}

describe('sideCandidates', () => {
  const share = { sink: 64, window: 256, pageTokens: 16 };
  const budget = { bitsPerElement: 2.5, tokens: 32768 };

  it('keeps keys off 1 bit where a plan with 2-bit keys and 1-bit values fits the budget', () => {
    const { key, value } = sideCandidates(8, { groupSize: 128, share, budget });
    expect(value).toEqual(SIDE_CANDIDATES);
    expect(key).toEqual(SIDE_CANDIDATES.filter((c) => c.bits !== 1));
    expect(key.length).toBe(SIDE_CANDIDATES.length - 1);
  });

  it('offers keys 1 bit where nothing else fits: rows of 32 values, whose scales cost a bit an element', () => {
    const { key } = sideCandidates(8, { groupSize: 32, share, budget });
    expect(key).toEqual(SIDE_CANDIDATES);
    // The boundary is the pool's accounting: 2-bit keys with 1-bit values over the budget at groups of 32.
    const plan = [{ key: { bits: 2 as const, clipQuantile: 1 }, value: { bits: 1 as const, clipQuantile: 1 } }];
    expect(planEffectiveBits(plan, 32, share, budget.tokens)).toBeGreaterThan(budget.bitsPerElement);
    expect(planEffectiveBits(plan, 128, share, budget.tokens)).toBeLessThanOrEqual(budget.bitsPerElement);
  });
});

describe('choosePlan', () => {
  const share = { sink: 64, window: 256, pageTokens: 16 };

  it('finds the least-error plan within the budget: the same total as an exhaustive search', () => {
    const random = seededRandom(35);
    for (let trial = 0; trial < 20; trial++) {
      const layers = 2 + (trial % 3);
      const scores = randomScores(random, layers);
      const budget = { bitsPerElement: 2 + random(), tokens: 32768 };
      const choice = choosePlan(scores, { groupSize: 128, share, budget });
      expect(choice.bitsPerElement).toBeLessThanOrEqual(budget.bitsPerElement + 1e-9);
      // Exhaustive: every candidate of every side.
      const sides = scores.flatMap((l) => [l.key, l.value]);
      let best = Number.POSITIVE_INFINITY;
      const walk = (i: number, picked: SideScore[]) => {
        if (i === sides.length) {
          const plan = Array.from({ length: layers }, (_, l) => ({
            key: picked[2 * l].candidate,
            value: picked[2 * l + 1].candidate,
          }));
          if (planEffectiveBits(plan, 128, share, budget.tokens) <= budget.bitsPerElement + 1e-9) {
            best = Math.min(
              best,
              picked.reduce((s, p) => s + p.error, 0),
            );
          }
          return;
        }
        for (const s of sides[i]) walk(i + 1, [...picked, s]);
      };
      walk(0, []);
      expect(choice.error).toBeCloseTo(best, 9);
      // Deterministic.
      expect(choosePlan(scores, { groupSize: 128, share, budget })).toEqual(choice);
    }
  });

  it('refuses a budget below the cheapest plan with a typed error that says why', () => {
    const scores = randomScores(seededRandom(1), 2);
    expect(() => choosePlan(scores, { groupSize: 128, share, budget: { bitsPerElement: 1.0, tokens: 32768 } })).toThrow(
      /below the cheapest plan/,
    );
  });
});

describe('retrievalProbe', () => {
  it('repeats passages that are quantized for every query that reads them', () => {
    const text = Array.from({ length: 2000 }, (_, i) => i);
    const probe = retrievalProbe(text, DEFAULT_QUANT_POLICY);
    expect(probe.tokens.length).toBe(1024);
    expect(probe.copyRows.length).toBe(4 * 62);
    for (const t of probe.copyRows) {
      // The token a copy row predicts is the copy of one that is quantized when that row reads it.
      const source = probe.tokens[t + 1];
      const { start, end } = quantizedRange(DEFAULT_QUANT_POLICY, t);
      expect(source).toBeGreaterThanOrEqual(start);
      expect(source).toBeLessThan(end);
      expect(probe.tokens[t]).toBe(source - 1);
    }
    // Plain rows: ordinary text (the next token follows it) with quantized history.
    expect(probe.plainRows.length).toBeGreaterThan(300);
    for (const t of probe.plainRows) {
      expect(quantizedRange(DEFAULT_QUANT_POLICY, t).end).toBeGreaterThan(64);
      expect(probe.tokens[t + 1]).toBe(probe.tokens[t] + 1);
    }
    expect(() => retrievalProbe(text.slice(0, 300), DEFAULT_QUANT_POLICY)).toThrow(/needs 768 tokens/);
  });
});

describe('pickMeasuredPlan', () => {
  const side = (bits: 1 | 2 | 4) => ({ bits, clipQuantile: 1 });
  const plan = (bits: 1 | 2 | 4) => [{ key: side(bits), value: side(bits) }];

  it('keeps the plan whose loss measured as a whole is least, not the one whose side costs sum least', () => {
    // The knapsack's plan (1-bit sides its costs called free) measures worse than the 2-bit fallback.
    const knapsack = { plan: plan(1), bitsPerElement: 1.6, loss: { copy: 2.9, plain: 4.4 }, error: -0.001 };
    const fallback = { plan: plan(2), bitsPerElement: 2.4, loss: { copy: 2.5, plain: 4.3 }, error: 0 };
    expect(pickMeasuredPlan([knapsack, fallback])).toBe(fallback);
    expect(pickMeasuredPlan([fallback, knapsack])).toBe(fallback);
  });

  it('ties go to fewer bits, then to the earlier plan; an empty list throws', () => {
    const a = { plan: plan(4), bitsPerElement: 4.3, loss: { copy: 1, plain: 2 } };
    const b = { plan: plan(2), bitsPerElement: 2.4, loss: { copy: 2, plain: 1 } };
    const c = { plan: plan(2), bitsPerElement: 2.4, loss: { copy: 1.5, plain: 1.5 } };
    expect(pickMeasuredPlan([a, b, c])).toBe(b);
    expect(() => pickMeasuredPlan([])).toThrow();
  });
});

describe('withoutOneBitSides', () => {
  it('drops the 1-bit candidates of every side and keeps the rest in order', () => {
    const scores = randomScores(seededRandom(7), 3);
    const kept = withoutOneBitSides(scores);
    for (const [l, layer] of kept.entries()) {
      for (const s of ['key', 'value'] as const) {
        expect(layer[s].map((x) => x.candidate)).toEqual(
          scores[l][s].map((x) => x.candidate).filter((c) => c.bits > 1),
        );
      }
    }
    // The knapsack over what is left picks no 1-bit side.
    const choice = choosePlan(kept, { groupSize: 128, share: { sink: 64, window: 256, pageTokens: 16 } });
    expect(choice.plan.every((l) => l.key.bits > 1 && l.value.bits > 1)).toBe(true);
  });
});
