/**
 * The context check costs what the input costs, not more (issue 39, point 6), on stories260K: 'drop_oldest_turns'
 * renders and tokenizes the conversation a few times, not once per dropped turn, and a prompt whose length alone
 * shows it cannot fit is refused before it is tokenized. Counted by watching the model's own tokenizer.
 */
import { describe, expect, it, vi } from 'vitest';
import { ContextOverflowError } from '../../core/errors.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { describeRefusal, faultLog } from '../../test/regressions/fault-log.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { chatTemplateFromMetadata, encodeConversation } from '../tokenizer/chat-template.ts';
import type { ChatMessageParam, LongtabEngine } from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const log = faultLog('context-cost');

const SYSTEM: ChatMessageParam = { role: 'system', content: 'You tell short stories about Lily.' };

/** 8 f16 pages of 16 tokens: 128 tokens per conversation. */
async function smallContext(): Promise<LongtabEngine> {
  const engine = createNodeEngine({ gpu: ctx.gpu });
  await engine.load(modelPath!, { kv: 'f16', kvBudgetBytes: 8 * 10240 });
  expect((await engine.stats()).context.capacity).toBe(128);
  return engine;
}

/** Counts the tokenizer's encode calls (and the longest text it got) while `run` runs; encode itself runs as ever. */
async function watchingEncode<T>(
  engine: LongtabEngine,
  run: () => Promise<T>,
): Promise<{ result: T | unknown; calls: number; longest: number }> {
  const spy = vi.spyOn(engine.runner!.tokenizer, 'encode');
  try {
    const result = await run().catch((error: unknown) => error);
    return { result, calls: spy.mock.calls.length, longest: Math.max(0, ...spy.mock.calls.map(([t]) => t.length)) };
  } finally {
    spy.mockRestore();
  }
}

describe.skipIf(!modelPath)('context checks cost what the input costs', () => {
  it('drop_oldest_turns on 400 turns tokenizes a few times, and drops the fewest turns that make it fit', async () => {
    const engine = await smallContext();
    try {
      const messages: ChatMessageParam[] = [SYSTEM];
      for (let i = 0; i < 200; i++) {
        messages.push({ role: 'user', content: `Question ${i}: where did Lily go with the ball?` });
        messages.push({ role: 'assistant', content: `Lily went to the park ${i} times.` });
      }
      messages.push({ role: 'user', content: 'Where is Lily now?' });
      const { result, calls } = await watchingEncode(engine, () =>
        engine.chat.completions.create({ messages, max_tokens: 1, context_overflow: 'drop_oldest_turns' }),
      );
      const reply = result as Awaited<ReturnType<typeof engine.chat.completions.create>> & {
        usage: { prompt_tokens: number; longtab: { dropped_messages: number } };
      };
      const dropped = reply.usage.longtab.dropped_messages;

      // The fewest: with one turn fewer dropped the prompt would not fit (one position stays free for the reply).
      const runner = engine.runner!;
      const template = chatTemplateFromMetadata(runner.loaded!.file.metadata);
      const tokens = (k: number) =>
        encodeConversation(runner.tokenizer, template, [SYSTEM, ...messages.slice(1 + k)] as never, {
          addGenerationPrompt: true,
          specialTokensInContent: 'text',
        }).length;
      const kept = tokens(dropped);
      const oneFewer = tokens(dropped - 1);
      log.record({
        area: 'context',
        fault: "a conversation of 400 turns into 128 tokens of context, context_overflow 'drop_oldest_turns'",
        expected: 'at most 14 tokenizer calls (bisection, not one per dropped turn); the fewest turns dropped',
        outcome: `${calls} tokenizer calls; ${dropped} messages dropped, ${kept} tokens kept (${oneFewer} with one fewer dropped)`,
        ok: calls <= 14 && dropped > 350 && kept === reply.usage.prompt_tokens && kept < 128 && oneFewer >= 128,
      });
      // One per dropped turn would be ~390 renders; bisection over 400 turns takes about log2(400) ≈ 9, plus the
      // system prompt alone.
      expect(calls).toBeLessThanOrEqual(14);
      expect(dropped).toBeGreaterThan(350);
      expect(kept).toBe(reply.usage.prompt_tokens);
      expect(kept).toBeLessThan(128);
      expect(oneFewer).toBeGreaterThanOrEqual(128);
    } finally {
      engine.destroy();
    }
  });

  it('a message far longer than the context is refused before anything is tokenized', async () => {
    const engine = await smallContext();
    try {
      const long = 'Lily went to the park. '.repeat(20_000); // 460 000 characters for 128 tokens
      for (const overflow of ['error', 'drop_oldest_turns'] as const) {
        const { result, calls } = await watchingEncode(engine, () =>
          engine.chat.completions.create({
            messages: [SYSTEM, { role: 'user', content: long }],
            context_overflow: overflow,
          }),
        );
        const message = /^This request needs at least \d+ tokens of KV cache, but only 128/;
        log.record({
          area: 'context',
          fault: `a 460 000-character user message into 128 tokens of context (chat, context_overflow '${overflow}')`,
          expected: 'ContextOverflowError before anything is tokenized (0 tokenizer calls)',
          outcome: `${describeRefusal(result, message)}; ${calls} tokenizer calls`,
          ok:
            result instanceof ContextOverflowError &&
            result.tokensAvailable === 128 &&
            message.test(result.message) &&
            calls === 0,
        });
        expect(result).toBeInstanceOf(ContextOverflowError);
        expect((result as ContextOverflowError).tokensAvailable).toBe(128);
        expect((result as Error).message).toMatch(message);
        expect(calls).toBe(0);
      }
      const { result, calls } = await watchingEncode(engine, () =>
        engine.completions.create({ prompt: long, max_tokens: 1 }),
      );
      log.record({
        area: 'context',
        fault: 'a 460 000-character prompt into 128 tokens of context (completions)',
        expected: 'ContextOverflowError before anything is tokenized (0 tokenizer calls)',
        outcome: `${describeRefusal(result)}; ${calls} tokenizer calls`,
        ok: result instanceof ContextOverflowError && calls === 0,
      });
      expect(result).toBeInstanceOf(ContextOverflowError);
      expect(calls).toBe(0);

      // An old turn that long is dropped without being tokenized, and the rest is answered.
      const dropping = await watchingEncode(engine, () =>
        engine.chat.completions.create({
          messages: [
            SYSTEM,
            { role: 'user', content: long },
            { role: 'assistant', content: 'Lily went home.' },
            { role: 'user', content: 'Where is Lily now?' },
          ],
          max_tokens: 1,
          context_overflow: 'drop_oldest_turns',
        }),
      );
      const droppedMessages = (dropping.result as { usage?: { longtab?: { dropped_messages?: number } } }).usage
        ?.longtab?.dropped_messages;
      log.record({
        area: 'context',
        fault:
          "the same 460 000-character message as the oldest turn, then a short one (context_overflow 'drop_oldest_turns')",
        expected: 'the long turn dropped without being tokenized (no text over 1000 characters tokenized); a reply',
        outcome:
          droppedMessages === undefined
            ? describeRefusal(dropping.result)
            : `replied; ${droppedMessages} message dropped; longest text tokenized ${dropping.longest} characters`,
        ok: droppedMessages === 1 && dropping.longest < 1000,
      });
      expect(dropping.result).toMatchObject({ usage: { longtab: { dropped_messages: 1 } } });
      expect(dropping.longest).toBeLessThan(1000);
    } finally {
      engine.destroy();
    }
  });
});
