import { describe, expect, it } from 'vitest';
import { logProbability, perplexity, topOneAgreement } from './perplexity.ts';

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
