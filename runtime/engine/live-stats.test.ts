/**
 * Live stats during a reply (issue 38, point 2): the engine tells its subscribers what the cache holds once the
 * prompt is in and while tokens arrive, not only at the end of a request (stories260K on Dawn).
 */
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import type { EngineStats } from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);

describe.skipIf(!modelPath)('live stats on stories260K', () => {
  it('a reply shorter than any batch of tokens still sends stats after its prefill and before its end', async () => {
    const engine = createNodeEngine({ gpu: ctx.gpu });
    await engine.load(modelPath!, { kv: 'f16', kvBudgetBytes: 4 << 20 });
    const duringReply: EngineStats[] = [];
    let streaming = false;
    const unsubscribe = await engine.subscribeStats((s) => {
      if (streaming) duringReply.push(s);
    });
    const prompt = 'Once upon a time there was a little girl named Lily.';
    const stream = await engine.completions.create({ prompt, max_tokens: 6, temperature: 0, stream: true });
    streaming = true;
    let promptTokens = 0;
    let pieces = 0;
    const seenByPiece: number[] = [];
    for await (const chunk of stream) {
      if (chunk.usage) promptTokens = chunk.usage.prompt_tokens;
      if (chunk.choices[0].text) seenByPiece[pieces++] = duringReply.length;
    }
    streaming = false;
    unsubscribe();
    // The first piece of text comes after stats that hold the whole prompt: the prefill is counted when it is done
    // (with the first token too where the decode step that writes it was already under way).
    expect(seenByPiece[0]).toBeGreaterThan(0);
    expect(duringReply[0]!.context.used).toBeGreaterThanOrEqual(promptTokens);
    expect(duringReply[0]!.context.used).toBeLessThanOrEqual(promptTokens + 1);
    expect(duringReply[0]!.memory.kvUsed).toBeGreaterThan(0);
    expect(duringReply[0]!.queue.running).toBe(true);
    engine.destroy();
  });
});
