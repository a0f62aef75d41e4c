import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { LlamaReference } from '../../tools/fixtures/llama-reference.ts';
import { defaultModelPath } from '../cli/default-model.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { logProbability } from '../eval/perplexity.ts';
import { sourceFromPath } from '../gguf/node-source.ts';

// The embedded demo model (Q8_0) against llama.cpp: llama.cpp quantizes activations to 8 bits before Q8_0 matmuls,
// so log-probabilities agree to the Q8_0 tolerance of the oracle suite, not bit for bit.
const Q8_0_TOLERANCE = 0.5;
const ctx = withTestGpu();
const modelPath = defaultModelPath();

describe('embedded demo model vs llama.cpp', () => {
  let reference: LlamaReference;
  let engine: ModelRunner;
  beforeAll(async () => {
    reference = await LlamaReference.create();
    engine = new ModelRunner(ctx.gpu);
    await engine.load(await sourceFromPath(modelPath), { kv: 'f16', prefillChunk: 64 });
  });
  afterAll(() => engine?.unload());

  it('greedy output and next-token distributions match llama.cpp', async () => {
    const prompt = engine.tokenizer.encode('And it came to pass, when Elizabeth', { addSpecial: true });
    const result = await engine.generate({ promptIds: prompt, maxTokens: 24, stopAtEog: false });
    const ids = [...prompt, ...result.ids];
    const vocab = engine.config.vocab;
    const ours = await engine.teacherForcedLogits(ids);
    const theirs = await reference.teacherForced(modelPath, ids);
    expect(theirs.vocab).toBe(vocab);
    let worst = 0;
    for (let t = 0; t + 1 < ids.length; t++) {
      // Compare the log-probability of llama.cpp's top token and of ours, and the greedy choice.
      const row = theirs.logProbs.subarray(t * vocab, (t + 1) * vocab);
      const order = Array.from(row.keys()).sort((a, b) => row[b] - row[a]);
      for (const id of order.slice(0, 5))
        worst = Math.max(worst, Math.abs(logProbability(ours, t * vocab, vocab, id) - row[id]));
      if (t >= prompt.length - 1 && row[order[0]] - row[order[1]] > Q8_0_TOLERANCE) {
        expect(ids[t + 1], `greedy token at position ${t + 1}`).toBe(order[0]);
      }
    }
    console.info(`demo model vs llama.cpp: max |d log p| over the top-5 tokens = ${worst.toFixed(4)}`);
    expect(worst).toBeLessThan(Q8_0_TOLERANCE);
    expect(reference.errors).toEqual([]);
  });
});
