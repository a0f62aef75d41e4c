import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, STORIES260K_GOLDEN, sharedPath } from '../../test/shared.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { ModelRunner } from './model-runner.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const goldenPath = sharedPath(STORIES260K_GOLDEN);

describe.skipIf(!modelPath || !goldenPath)('stories260K end to end (real trained model)', () => {
  it('greedy decoding from BOS reproduces the golden ids exactly, in one prefill chunk or many', async () => {
    const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[]; greedy_text: string };
    const baseline = ctx.gpu.allocator.snapshot();
    for (const prefillChunk of [128, 7]) {
      const engine = new ModelRunner(ctx.gpu);
      const source = await sourceFromPath(modelPath!);
      await engine.load(source, { kv: 'f16', prefillChunk, kvBudgetBytes: 4 << 20 });
      const bos = golden.greedy_ids[0];
      const expected = golden.greedy_ids.slice(1);
      const fromBos = await engine.generate({ promptIds: [bos], maxTokens: expected.length, stopAtEog: false });
      expect(fromBos.ids).toEqual(expected);
      expect(engine.tokenizer.decode(fromBos.ids)).toBe(golden.greedy_text);
      // A longer prompt, prefilled in chunks that straddle pages, must continue exactly as decoding did.
      const prompt = [bos, ...expected.slice(0, 40)];
      const continued = await engine.generate({ promptIds: prompt, maxTokens: 20, stopAtEog: false });
      expect(continued.ids).toEqual(expected.slice(40, 60));
      engine.unload();
      await source.close?.();
    }
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline.totalBuffers);
  });

  it('a reply stopped early leaves exactly prompt + reply − 1 positions, and a follow-up reusing them continues the golden text', async () => {
    // Decode queues the step for token k before reading token k; when token k ends the reply, that look-ahead step's
    // K/V must be undone, or the next turn would reuse a position that no prompt token wrote.
    const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[] };
    const [bos, ...expected] = golden.greedy_ids;
    const engine = new ModelRunner(ctx.gpu);
    const source = await sourceFromPath(modelPath!);
    await engine.load(source, { kv: 'f16', kvBudgetBytes: 4 << 20 });
    const pool = engine.loaded!.pool;
    const seq = pool.createSequence();
    const prompt = [bos, ...expected.slice(0, 10)];
    let seen = 0;
    const stopped = await engine.generateInSequence(seq, {
      promptIds: prompt,
      maxTokens: 50,
      stopAtEog: false,
      onToken: () => ++seen < 7,
    });
    expect(stopped.finishReason).toBe('stop');
    expect(stopped.ids).toEqual(expected.slice(10, 17));
    expect(seq.length).toBe(prompt.length + stopped.ids.length - 1);
    const limited = await engine.generateInSequence(seq, {
      promptIds: [...prompt, ...stopped.ids],
      reuseTokens: seq.length,
      maxTokens: 5,
      stopAtEog: false,
    });
    expect(limited.usage.prefilledTokens).toBe(1);
    expect(limited.ids).toEqual(expected.slice(17, 22));
    expect(seq.length).toBe(prompt.length + stopped.ids.length + 4);
    pool.free(seq);
    engine.unload();
    await source.close?.();
  });
});
