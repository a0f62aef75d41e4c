/**
 * Conversations evicted from the GPU budget wait in host memory (hostKvBudgetBytes) and come back without a re-prefill:
 * on the demo model, with one KV sequence so that every other conversation evicts the first, the first conversation's
 * next turn reuses its whole history (cached_tokens as in an engine that never evicted it) and answers exactly as that
 * engine does; with no host budget it is re-prefilled instead. A host budget too small for two saved conversations
 * keeps the most recently evicted one.
 */
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import type { ChatCompletion, ChatCompletionRequest, EngineLoadOptions, LongtabEngine } from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const DEMO = 'public/models/longtab-demo.gguf';

const opening = (topic: string) =>
  `${topic} It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered as the rightful property of some one or other of their daughters. My dear Mr. Bennet, said his lady to him one day, have you heard that Netherfield Park is let at last?`;

async function chat(engine: LongtabEngine, request: ChatCompletionRequest): Promise<ChatCompletion> {
  return (await engine.chat.completions.create({
    temperature: 0,
    max_tokens: 24,
    ...request,
    stream: false,
  })) as ChatCompletion;
}

/** Turn 1 of conversation a, of b (which evicts a where one sequence is allowed), then turn 2 of a. */
async function threeTurns(options: EngineLoadOptions) {
  const engine = createNodeEngine({ gpu: ctx.gpu });
  try {
    await engine.load(DEMO, { kvBudgetBytes: 8 << 20, ...options });
    const a1 = [{ role: 'user' as const, content: opening('Of Mr. Bingley.') }];
    const first = await chat(engine, { messages: a1, conversation_id: 'a' });
    await chat(engine, { messages: [{ role: 'user', content: opening('Of Mr. Darcy.') }], conversation_id: 'b' });
    const afterB = await engine.stats();
    const a2 = [
      ...a1,
      { role: 'assistant' as const, content: first.choices[0].message.content ?? '' },
      { role: 'user' as const, content: 'And what did Mrs. Bennet say?' },
    ];
    const second = await chat(engine, { messages: a2, conversation_id: 'a' });
    return { second, afterB, after: await engine.stats() };
  } finally {
    engine.destroy();
  }
}

describe('conversations kept in host memory while evicted', () => {
  it.each([
    ['f16', {}],
    ['int2', { rotation: 'hadamard' as const, experimental: { sink: 16, window: 32 } }],
  ] as const)(
    'kv %s: the next turn restores the whole history and answers as if never evicted',
    async (kv, extra) => {
      const never = await threeTurns({ kv, maxSequences: 4, ...extra });
      expect(never.afterB.context.evictions).toBe(0);
      const kept = await threeTurns({ kv, maxSequences: 1, ...extra });
      expect(kept.afterB.context.evictions).toBe(1);
      expect(kept.afterB.host.conversations).toBe(1);
      expect(kept.afterB.host.bytes).toBeGreaterThan(0);
      expect(kept.afterB.host.saves).toBe(1);
      expect(kept.after.host.restores).toBe(1);
      const cached = never.second.usage.prompt_tokens_details?.cached_tokens ?? 0;
      expect(cached).toBeGreaterThan(100);
      expect(kept.second.usage.prompt_tokens_details?.cached_tokens).toBe(cached);
      expect(kept.second.choices[0].message.content).toBe(never.second.choices[0].message.content);
      // Without a host budget the history is re-prefilled.
      const dropped = await threeTurns({ kv, maxSequences: 1, hostKvBudgetBytes: 0, ...extra });
      expect(dropped.afterB.host.conversations).toBe(0);
      expect(dropped.second.usage.prompt_tokens_details?.cached_tokens).toBe(0);
      if (kv === 'f16') expect(dropped.second.choices[0].message.content).toBe(never.second.choices[0].message.content);
    },
    300_000,
  );

  it('a host budget that holds one saved conversation keeps the most recently evicted one', async () => {
    const engine = createNodeEngine({ gpu: ctx.gpu });
    try {
      await engine.load(DEMO, { kv: 'f16', kvBudgetBytes: 8 << 20, maxSequences: 1 });
      const pageBytes = (await engine.stats()).kv.pageBytes;
      engine.destroy();
      const limited = createNodeEngine({ gpu: ctx.gpu });
      try {
        // Room for one conversation's pages (about 11 pages each), not two.
        await limited.load(DEMO, {
          kv: 'f16',
          kvBudgetBytes: 8 << 20,
          maxSequences: 1,
          hostKvBudgetBytes: 16 * pageBytes,
        });
        for (const id of ['a', 'b', 'c']) {
          await chat(limited, { messages: [{ role: 'user', content: opening(`Of ${id}.`) }], conversation_id: id });
        }
        const stats = await limited.stats();
        expect(stats.host.saves).toBe(2);
        expect(stats.host.conversations).toBe(1);
        expect(stats.host.bytes).toBeLessThanOrEqual(16 * pageBytes);
        // b, evicted last, comes back from host memory; a was dropped and is re-prefilled.
        const followUp = (id: string) =>
          chat(limited, {
            messages: [
              { role: 'user', content: opening(`Of ${id}.`) },
              { role: 'assistant', content: 'x' },
              { role: 'user', content: 'y' },
            ],
            conversation_id: id,
          });
        const b = await followUp('b');
        expect(b.usage.prompt_tokens_details?.cached_tokens).toBeGreaterThan(50);
        const a = await followUp('a');
        expect(a.usage.prompt_tokens_details?.cached_tokens).toBe(0);
      } finally {
        limited.destroy();
      }
    } finally {
      engine.destroy();
    }
  }, 300_000);
});
