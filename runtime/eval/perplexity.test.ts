import { describe, expect, it } from 'vitest';
import {
  logProbability,
  pairedPerplexityRatioInterval,
  perplexity,
  studentT95,
  topOneAgreement,
} from './perplexity.ts';

describe('perplexity', () => {
  it('log-probabilities are a normalized log-softmax, stable for large logits', () => {
    const logits = Float32Array.from([1000, 1001, 999, 1000.5]);
    const total = [0, 1, 2, 3].reduce((s, i) => s + Math.exp(logProbability(logits, 0, 4, i)), 0);
    expect(total).toBeCloseTo(1, 12);
    expect(logProbability(logits, 0, 4, 1)).toBeGreaterThan(logProbability(logits, 0, 4, 0));
  });

  it('a scorer that always predicts uniformly over V tokens has perplexity V', async () => {
    const vocab = 7;
    const scorer = { teacherForcedLogits: async (ids: number[]) => new Float32Array(ids.length * vocab).fill(0.25) };
    const ids = Array.from({ length: 50 }, (_, i) => i % vocab);
    const result = await perplexity(scorer, ids, 10, vocab);
    expect(result.windows).toBe(5);
    expect(result.tokensScored).toBe(45); // the first token of each window is context, not a target
    expect(result.perplexity).toBeCloseTo(vocab, 10);
  });

  it('a scorer that puts probability p on the right next token has perplexity 1/p', async () => {
    const vocab = 4;
    const p = 0.7;
    const scorer = {
      teacherForcedLogits: async (ids: number[]) => {
        const out = new Float32Array(ids.length * vocab);
        for (let t = 0; t + 1 < ids.length; t++) {
          for (let v = 0; v < vocab; v++) out[t * vocab + v] = Math.log(v === ids[t + 1] ? p : (1 - p) / (vocab - 1));
        }
        return out;
      },
    };
    const ids = Array.from({ length: 40 }, (_, i) => (i * 3) % vocab);
    const result = await perplexity(scorer, ids, 8, vocab);
    expect(result.perplexity).toBeCloseTo(1 / p, 5);
    expect(topOneAgreement(result.argmax, result.argmax)).toBe(1);
  });
});

describe('quality table verdict', () => {
  it('calls a table blind when the weak controls stay within 10% of f16, informative otherwise', async () => {
    const { judgeTable } = await import('../cli/eval.ts');
    expect(
      judgeTable([
        { kv: 'f16', vsF16: 0 },
        { kv: 'int2-hadamard', vsF16: 0.01 },
      ]).status,
    ).toBe('no-control');
    expect(
      judgeTable([
        { kv: 'f16', vsF16: 0 },
        { kv: 'int2-none', vsF16: 0.02 },
        { kv: 'int2-hadamard', vsF16: 0.01 },
      ]).status,
    ).toBe('blind');
    expect(
      judgeTable([
        { kv: 'f16', vsF16: 0 },
        { kv: 'int2-none', vsF16: 0.35 },
        { kv: 'int2-hadamard', vsF16: 0.02 },
      ]).status,
    ).toBe('informative');
  });
});

describe('paired perplexity interval', () => {
  it("Student's t quantiles match the tables", () => {
    // two-sided 95%: df 3 → 3.182, 5 → 2.571, 7 → 2.365, 11 → 2.201, 15 → 2.131, 63 → 1.998
    expect(studentT95(3)).toBeCloseTo(3.182, 3);
    expect(studentT95(5)).toBeCloseTo(2.571, 3);
    expect(studentT95(7)).toBeCloseTo(2.365, 3);
    expect(studentT95(11)).toBeCloseTo(2.201, 3);
    expect(studentT95(15)).toBeCloseTo(2.131, 3);
    expect(studentT95(63)).toBeCloseTo(1.998, 3);
  });

  it('brackets the ratio of per-window perplexities, which differ far more than the two caches do', () => {
    // windows of very different difficulty; the mode adds 0.05 nats ± 0.01 to each
    const reference = [3.1, 5.9, 4.2, 6.8, 3.7, 5.1, 4.8, 6.2];
    const jitter = [0.01, -0.01, 0.005, -0.005, 0.0, 0.01, -0.01, 0.0];
    const mode = reference.map((r, w) => r + 0.05 + jitter[w]);
    const interval = pairedPerplexityRatioInterval(mode, reference)!;
    const meanDiff = mode.reduce((s, m, w) => s + m - reference[w], 0) / mode.length;
    expect(interval.low).toBeLessThan(Math.exp(meanDiff) - 1);
    expect(interval.high).toBeGreaterThan(Math.exp(meanDiff) - 1);
    expect(interval.low).toBeGreaterThan(0.04); // exp(0.05) − 1 = 0.0513, jitter ± 0.01
    expect(interval.high).toBeLessThan(0.065);
    expect(pairedPerplexityRatioInterval(mode.slice(0, 2), reference.slice(0, 2))).toBeNull();
  });

  it("perplexity reports each window's mean NLL, and they average to the whole", async () => {
    const vocab = 4;
    const scorer = {
      teacherForcedLogits: async (ids: number[]) =>
        Float32Array.from({ length: ids.length * vocab }, (_, i) => Math.sin(i * 0.37 + ids[0])),
    };
    const ids = Array.from({ length: 30 }, (_, i) => Math.floor(Math.abs(Math.sin(i * 12.9898)) * 43758) % vocab);
    const result = await perplexity(scorer, ids, 10, vocab);
    expect(result.windowMeanNll).toHaveLength(3);
    const mean = result.windowMeanNll.reduce((s, x) => s + x, 0) / 3;
    expect(mean).toBeCloseTo(result.meanNll, 12);
    expect(new Set(result.windowMeanNll.map((x) => x.toFixed(6))).size).toBe(3);
  });
});
