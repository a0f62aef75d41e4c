/**
 * Contract tests of the OpenAI-shaped API (LongtabEngine, in-process on Dawn) with the real stories260K model.
 * stories260K has no chat template, so chat requests use the ChatML fallback (plain text in its vocabulary).
 */
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { ContextOverflowError, InvalidRequestError, ModelNotLoadedError } from '../../core/errors.ts';
import { GgmlType } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, STORIES260K_GOLDEN, sharedPath } from '../../test/shared.ts';
import { modelFixtureGguf } from '../../tools/fixtures/model-fixtures.ts';
import type {
  ChatCompletion,
  ChatCompletionChunk,
  ChatCompletionRequest,
  ChatMessageParam,
  EngineLoadOptions,
  EngineStats,
  LoadProgress,
  LongtabEngine,
} from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const goldenPath = sharedPath(STORIES260K_GOLDEN);

const SYSTEM: ChatMessageParam = {
  role: 'system',
  content: 'You tell short stories about a little girl named Lily and her red ball in the park.',
};

async function loaded(options: Parameters<LongtabEngine['load']>[1] = {}): Promise<LongtabEngine> {
  const engine = createNodeEngine({ gpu: ctx.gpu });
  await engine.load(modelPath!, { kvBudgetBytes: 4 << 20, ...options });
  return engine;
}

async function chat(engine: LongtabEngine, request: ChatCompletionRequest): Promise<ChatCompletion> {
  return engine.chat.completions.create({ temperature: 0, max_tokens: 16, ...request, stream: false });
}

async function collect(stream: AsyncIterable<ChatCompletionChunk>): Promise<ChatCompletionChunk[]> {
  const chunks: ChatCompletionChunk[] = [];
  for await (const chunk of stream) chunks.push(chunk);
  return chunks;
}

function text(chunks: ChatCompletionChunk[]): string {
  return chunks.map((c) => c.choices[0].delta.content ?? '').join('');
}

describe.skipIf(!modelPath || !goldenPath)('LongtabEngine API on stories260K', () => {
  it('completions.create from an empty prompt (BOS) gives the golden greedy text, streamed or not', async () => {
    const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[]; greedy_text: string };
    const baseline = ctx.gpu.allocator.snapshot().totalBuffers;
    const progress: LoadProgress[] = [];
    const engine = await loaded({ onProgress: (p) => progress.push({ ...p }) });
    const phases = progress.map((p) => p.phase).filter((p, i, all) => all[i - 1] !== p);
    expect(phases).toEqual(['parse', 'upload', 'calibrate']);
    for (let i = 1; i < progress.length; i++) {
      if (progress[i].phase === progress[i - 1].phase)
        expect(progress[i].bytesDone).toBeGreaterThanOrEqual(progress[i - 1].bytesDone);
    }
    const upload = progress.filter((p) => p.phase === 'upload').at(-1)!;
    expect(upload.bytesDone).toBe(upload.bytesTotal);
    expect(progress.at(-1)).toEqual({ phase: 'calibrate', bytesDone: 1, bytesTotal: 1 });

    const maxTokens = golden.greedy_ids.length - 1;
    const whole = await engine.completions.create({ prompt: '', max_tokens: maxTokens, temperature: 0 });
    expect(whole.object).toBe('text_completion');
    expect(whole.choices[0].text).toBe(golden.greedy_text);
    expect(whole.choices[0].finish_reason).toBe('length');
    expect(whole.usage).toMatchObject({ prompt_tokens: 1, completion_tokens: maxTokens, total_tokens: maxTokens + 1 });
    const stream = await engine.completions.create({ prompt: '', max_tokens: maxTokens, stream: true });
    let streamed = '';
    for await (const chunk of stream) streamed += chunk.choices[0].text;
    expect(streamed).toBe(golden.greedy_text);

    await engine.unload();
    expect((await engine.stats()).memory.total).toBe(0);
    engine.destroy();
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline);
  });

  it('streamed chat chunks have the OpenAI shape and concatenate to the non-streamed reply', async () => {
    const engine = await loaded();
    const messages: ChatMessageParam[] = [SYSTEM, { role: 'user', content: 'Tell me about Lily.' }];
    const whole = await chat(engine, { messages, max_tokens: 24 });
    expect(whole).toMatchObject({ object: 'chat.completion', model: expect.any(String) });
    expect(whole.id).toMatch(/^chatcmpl-/);
    expect(whole.choices[0].message.role).toBe('assistant');
    expect(whole.choices[0].message.content?.length).toBeGreaterThan(0);

    const chunks = await collect(
      await engine.chat.completions.create({ messages, max_tokens: 24, temperature: 0, stream: true }),
    );
    expect(chunks[0].choices[0].delta.role).toBe('assistant');
    for (const c of chunks) {
      expect(c).toMatchObject({ object: 'chat.completion.chunk', id: chunks[0].id, created: expect.any(Number) });
      expect(c.choices).toHaveLength(1);
      expect(c.choices[0].index).toBe(0);
    }
    const last = chunks.at(-1)!;
    expect(last.choices[0].finish_reason).toBe(whole.choices[0].finish_reason);
    expect(chunks.slice(0, -1).every((c) => c.choices[0].finish_reason === null)).toBe(true);
    expect(text(chunks)).toBe(whole.choices[0].message.content);
    const usage = last.usage!;
    expect(usage.completion_tokens).toBe(whole.usage.completion_tokens);
    expect(usage.total_tokens).toBe(usage.prompt_tokens + usage.completion_tokens);
    expect(usage.longtab.decode_tokens_per_second).toBeGreaterThan(0);
    expect(usage.longtab.ttft_ms).toBeGreaterThan(0);
    expect(usage.longtab.tpot_ms).toBeGreaterThan(0);
    engine.destroy();
  });

  it('a follow-up turn prefills only its new tokens; a shared system prompt is forked, not prefilled again', async () => {
    const engine = await loaded();
    const turn1: ChatMessageParam[] = [SYSTEM, { role: 'user', content: 'Where is the ball?' }];
    const a1 = await chat(engine, { messages: turn1, conversation_id: 'a' });
    expect(a1.usage.prompt_tokens_details.cached_tokens).toBe(0);
    const turn2: ChatMessageParam[] = [
      ...turn1,
      { role: 'assistant', content: a1.choices[0].message.content },
      { role: 'user', content: 'And then?' },
    ];
    const a2 = await chat(engine, { messages: turn2, conversation_id: 'a' });
    const cached = a2.usage.prompt_tokens_details.cached_tokens;
    // Everything the first turn put in the cache is reused, up to where the retokenized reply may differ.
    expect(cached).toBeGreaterThanOrEqual(a1.usage.prompt_tokens);
    expect(a2.usage.longtab.prefill_tokens).toBe(a2.usage.prompt_tokens - cached);
    expect(a2.usage.longtab.prefill_tokens).toBeLessThan(a2.usage.prompt_tokens - a1.usage.prompt_tokens + 4);

    // The same system prompt in a new conversation: its KV is forked from the cached system sequence.
    const systemTokens = (await chat(engine, { messages: [SYSTEM, { role: 'user', content: 'Hi' }] })).usage
      .prompt_tokens_details.cached_tokens;
    expect(systemTokens).toBeGreaterThan(10);
    const pagesBefore = (await engine.stats()).kv.pagesUsed;
    const b1 = await chat(engine, { messages: turn1, conversation_id: 'b', max_tokens: 1 });
    expect(b1.usage.prompt_tokens_details.cached_tokens).toBe(systemTokens);
    // b shares the system prompt's full pages: it adds fewer pages than its prompt fills.
    const stats = await engine.stats();
    const pageTokens = stats.kv.pageTokens;
    expect(stats.kv.pagesUsed - pagesBefore).toBeLessThan(Math.ceil(b1.usage.prompt_tokens / pageTokens));
    expect(stats.context.conversations).toBe(2);
    engine.destroy();
  });

  it('two conversations interleaved give the same replies as each alone', async () => {
    const script = (topic: string): ChatMessageParam[][] => [
      [SYSTEM, { role: 'user', content: `Tell me about ${topic}.` }],
      [{ role: 'user', content: 'What happened next?' }],
      [{ role: 'user', content: 'How did it end?' }],
    ];
    async function play(engine: LongtabEngine, order: Array<[string, number]>): Promise<Record<string, string[]>> {
      const history: Record<string, ChatMessageParam[]> = {};
      const replies: Record<string, string[]> = {};
      for (const [id, turn] of order) {
        history[id] = [...(history[id] ?? []), ...script(id)[turn]];
        const reply = await chat(engine, { messages: history[id], conversation_id: id, max_tokens: 12 });
        history[id].push({ role: 'assistant', content: reply.choices[0].message.content });
        (replies[id] ??= []).push(reply.choices[0].message.content ?? '');
        if (turn > 0) expect(reply.usage.prompt_tokens_details.cached_tokens).toBeGreaterThan(0);
      }
      return replies;
    }
    const engine = await loaded();
    const alone = await play(engine, [
      ['Lily', 0],
      ['Lily', 1],
      ['Lily', 2],
    ]);
    Object.assign(
      alone,
      await play(engine, [
        ['Tom', 0],
        ['Tom', 1],
        ['Tom', 2],
      ]),
    );
    await engine.deleteConversation('Lily');
    await engine.deleteConversation('Tom');
    const interleaved = await play(engine, [
      ['Lily', 0],
      ['Tom', 0],
      ['Lily', 1],
      ['Tom', 1],
      ['Tom', 2],
      ['Lily', 2],
    ]);
    expect(interleaved).toEqual(alone);
    // And a fresh engine (nothing cached at all) agrees.
    const fresh = await loaded();
    expect(
      await play(fresh, [
        ['Tom', 0],
        ['Tom', 1],
        ['Tom', 2],
      ]),
    ).toEqual({ Tom: alone.Tom });
    engine.destroy();
    fresh.destroy();
  });

  it('concurrent requests queue (one runs at a time) and answer as they would one by one', async () => {
    const engine = await loaded();
    const ask = (content: string) => chat(engine, { messages: [{ role: 'user', content }], max_tokens: 10 });
    const sequential = [(await ask('Lily')).choices[0].message.content, (await ask('Tom')).choices[0].message.content];
    const running: boolean[] = [];
    const unsubscribe = await engine.subscribeStats((s) => running.push(s.queue.waiting > 0));
    const concurrent = await Promise.all([ask('Lily'), ask('Tom')]);
    unsubscribe();
    expect(concurrent.map((r) => r.choices[0].message.content)).toEqual(sequential);
    expect(running).toContain(true); // the second request waited while the first ran
    engine.destroy();
  });

  it('when the pool is full the least recently used conversation is evicted and, with no host budget, re-prefilled when it returns', async () => {
    // 24 pages of 16 tokens: room for about three of these conversations. (A host budget would keep Anna's pages:
    // runtime/engine/kv-host-tier.test.ts.)
    const engine = await loaded({ kvBudgetBytes: 24 * 10240, hostKvBudgetBytes: 0 });
    const ask = (id: string, extra: ChatMessageParam[] = []) =>
      chat(engine, {
        messages: [{ role: 'user', content: `Tell me a story about ${id} and the big red ball.` }, ...extra],
        conversation_id: id,
        max_tokens: 20,
      });
    const first = await ask('Anna');
    const followUp = (r: ChatCompletion): ChatMessageParam[] => [
      { role: 'assistant', content: r.choices[0].message.content },
      { role: 'user', content: 'More.' },
    ];
    for (const id of ['Ben', 'Cleo', 'Dan', 'Eve']) await ask(id);
    const stats = await engine.stats();
    expect(stats.kv.pagesUsed).toBeLessThanOrEqual(stats.kv.pagesBudget);
    expect(stats.context.conversations).toBe(5);
    expect(stats.context.evictions).toBeGreaterThan(0);
    // Anna was evicted: her follow-up re-prefills everything and still answers as an uncached conversation would.
    const again = await ask('Anna', followUp(first));
    expect(again.usage.prompt_tokens_details.cached_tokens).toBe(0);
    const reference = await loaded();
    const expected = await chat(reference, {
      messages: [{ role: 'user', content: 'Tell me a story about Anna and the big red ball.' }, ...followUp(first)],
      max_tokens: 20,
    });
    expect(again.choices[0].message.content).toBe(expected.choices[0].message.content);
    engine.destroy();
    reference.destroy();
  });

  it('a conversation longer than the context throws ContextOverflowError unless oldest turns may be dropped', async () => {
    // 8 f16 pages of 16 tokens: 128 tokens per conversation.
    const engine = await loaded({ kv: 'f16', kvBudgetBytes: 8 * 10240 });
    const capacity = (await engine.stats()).context.capacity;
    expect(capacity).toBe(128);
    const messages: ChatMessageParam[] = [SYSTEM];
    for (let i = 0; i < 8; i++) {
      messages.push({ role: 'user', content: `Question ${i}: where did Lily go with the ball?` });
      messages.push({ role: 'assistant', content: `Lily went to the park ${i} times.` });
    }
    messages.push({ role: 'user', content: 'Where is Lily now?' });
    const error = await chat(engine, { messages }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(ContextOverflowError);
    expect((error as ContextOverflowError).tokensAvailable).toBe(capacity);
    expect((error as Error).message).toMatch(/drop_oldest_turns/);
    // The budget is the limit here, in the f16 mode: the advice names both remedies of that mode.
    expect((error as ContextOverflowError).limit).toEqual({ kind: 'kv-budget', kv: 'f16' });
    expect((error as Error).message).toMatch(/in the f16 KV mode.*raise kvBudgetBytes.*kv: 'int2'/);

    const dropped = await chat(engine, { messages, context_overflow: 'drop_oldest_turns', conversation_id: 'long' });
    expect(dropped.usage.longtab.dropped_messages).toBeGreaterThan(0);
    expect(dropped.usage.prompt_tokens).toBeLessThanOrEqual(capacity);
    // The system prompt was kept: the same request with it removed by hand gives a different prompt length.
    const kept = messages.slice(1 + dropped.usage.longtab.dropped_messages);
    const withSystem = await chat(engine, { messages: [SYSTEM, ...kept] });
    expect(withSystem.usage.prompt_tokens).toBe(dropped.usage.prompt_tokens);
    expect(withSystem.choices[0].message.content).toBe(dropped.choices[0].message.content);
    engine.destroy();

    // A budget that holds more than the model's context: the context is the limit, and no budget advice is given.
    const roomy = await loaded({ kv: 'f16', kvBudgetBytes: 64 << 20 });
    const contextLength = (await roomy.stats()).model!.contextLength;
    const long = await roomy.completions
      .create({ prompt: 'Lily went to the park. '.repeat(contextLength), max_tokens: 1 })
      .catch((e: unknown) => e);
    expect(long).toBeInstanceOf(ContextOverflowError);
    expect((long as ContextOverflowError).limit).toEqual({ kind: 'model-context', contextLength });
    expect((long as Error).message).toMatch(new RegExp(`the model's context is ${contextLength} tokens`));
    expect((long as Error).message).not.toMatch(/kvBudgetBytes|int2/);
    roomy.destroy();
  });

  it('abort ends a stream with finish_reason "abort" and leaves the conversation consistent', async () => {
    const engine = await loaded();
    const messages: ChatMessageParam[] = [{ role: 'user', content: 'Tell me a long story.' }];
    const stream = await engine.chat.completions.create({
      messages,
      conversation_id: 'c',
      max_tokens: 200,
      temperature: 0,
      stream: true,
    });
    const queued = chat(engine, { messages, max_tokens: 50 });
    const chunks: ChatCompletionChunk[] = [];
    for await (const chunk of stream) {
      chunks.push(chunk);
      if (chunks.length === 4) await engine.abort();
    }
    const last = chunks.at(-1)!;
    expect(last.choices[0].finish_reason).toBe('abort');
    expect(last.usage!.completion_tokens).toBeLessThan(200);
    expect((await queued).choices[0].finish_reason).toBe('abort');
    const partial = text(chunks);
    expect(partial.length).toBeGreaterThan(0);

    // The partial reply is a prefix of the full one, and the conversation continues as if it had been cut there.
    // A reader that stops early (break) aborts its request; the engine goes on serving.
    const early = await engine.chat.completions.create({ messages, max_tokens: 200, temperature: 0, stream: true });
    for await (const chunk of early) if (chunk.choices[0].delta.content) break;

    const full = await chat(engine, { messages, max_tokens: last.usage!.completion_tokens + 8 });
    expect((await engine.stats()).queue).toEqual({ running: false, waiting: 0 });
    expect(full.choices[0].message.content?.startsWith(partial)).toBe(true);
    const next: ChatMessageParam[] = [
      ...messages,
      { role: 'assistant', content: partial },
      { role: 'user', content: 'Go on.' },
    ];
    const continued = await chat(engine, { messages: next, conversation_id: 'c' });
    expect(continued.usage.prompt_tokens_details.cached_tokens).toBeGreaterThan(0);
    const uncached = await chat(engine, { messages: next });
    expect(continued.choices[0].message.content).toBe(uncached.choices[0].message.content);
    engine.destroy();
  });

  it('int2 KV: the same API over 2-bit pages (layer 3 boosted to 4 bits), conversations included', async () => {
    const engine = await loaded({ kv: 'int2', experimental: { boostLayers: [3] } });
    const turn1: ChatMessageParam[] = [SYSTEM, { role: 'user', content: 'Where is the ball?' }];
    const first = await chat(engine, { messages: turn1, conversation_id: 'q' });
    expect(first.choices[0].message.content?.length).toBeGreaterThan(0);
    const second = await chat(engine, {
      messages: [
        ...turn1,
        { role: 'assistant', content: first.choices[0].message.content },
        { role: 'user', content: 'Then?' },
      ],
      conversation_id: 'q',
    });
    expect(second.usage.prompt_tokens_details.cached_tokens).toBeGreaterThanOrEqual(first.usage.prompt_tokens);
    const stats = await engine.stats();
    expect(stats.kv.mode).toBe('int2');
    expect(stats.kv.boostLayers).toEqual([3]);
    expect(stats.model?.kv).toBe('int2');
    expect(stats.memory.kvF16Equivalent).toBeGreaterThan(0);
    engine.destroy();
  });

  it('kv omitted: stories260K takes the 2-bit cache (rows of 4 × 8 in groups of 128 over four positions), and the stats say so', async () => {
    // 6 f16 pages' worth of budget: 96 tokens at f16. In int2 half of it holds f16 pages (48 tokens), the other half
    // 21 quant pages of 16 tokens (1,440 bytes: 5 layers × K and V × 4 stored rows of 9 words): 384 tokens.
    const engine = await loaded({ kvBudgetBytes: 6 * 10240 });
    const info = (await engine.stats()).model;
    expect(info?.kv).toBe('int2');
    await chat(engine, { messages: [{ role: 'user', content: 'Hello' }], conversation_id: 'x', max_tokens: 8 });
    const stats = await engine.stats();
    expect(stats.model?.kv).toBe('int2');
    expect(stats.kv.mode).toBe('int2');
    // The rotation follows the resolved mode: calibrated rotations once they exist; this model has none stored, so
    // Hadamard while the background calibration runs (it is stopped when the engine is destroyed).
    expect(stats.kv.rotation).toMatch(/^(hadamard|calibrating \d+%)$/);
    expect(stats.kv.calibration).not.toBeNull();
    expect(stats.kv.clip).toEqual({ key: 1, value: 1 });
    expect(stats.context.capacity).toBe(384);
    expect(stats.kv.plan).toMatchObject({ source: 'uniform', summary: 'K 2-bit, V 2-bit' });
    expect(stats.kv.plan!.layers).toHaveLength(5);
    expect(stats.kv.plan!.bitsPerElementAt32K).toBeGreaterThan(2);
    expect(stats.kv.plan!.bitsPerElementAt32K).toBeLessThan(4);
    expect(stats.kv.holds).toEqual({ tokens: stats.context.capacity, f16Tokens: 96 });
    expect(stats.kv.holds.tokens).toBeGreaterThan(2 * stats.kv.holds.f16Tokens);
    engine.destroy();
  });

  it('stats: memory by category, KV pages, context and adapter, also as a live subscription', async () => {
    const engine = createNodeEngine({ gpu: ctx.gpu });
    const seen: EngineStats[] = [];
    const unsubscribe = await engine.subscribeStats((s) => seen.push(s));
    await engine.load(modelPath!, { kv: 'f16', kvBudgetBytes: 4 << 20 });
    await chat(engine, { messages: [{ role: 'user', content: 'Hello' }], conversation_id: 'x', max_tokens: 40 });
    const stats = await engine.stats();
    expect(stats.model).toMatchObject({
      architecture: 'llama',
      layers: 5,
      vocab: 512,
      kv: 'f16',
      hasChatTemplate: false,
    });
    expect(stats.memory.weights).toBeGreaterThan(250_000 * 4);
    expect(stats.memory.kvUsed).toBe(stats.kv.pagesUsed * stats.kv.pageBytes);
    expect(stats.memory.kvReserved).toBe(stats.kv.pagesReserved * stats.kv.pageBytes);
    expect(stats.memory.kvTotal).toBeGreaterThan(stats.memory.kvReserved);
    expect(stats.memory.total).toBe(
      stats.memory.weights + stats.memory.kvTotal + stats.memory.scratch + stats.memory.staging,
    );
    // f16 mode: the fp16 equivalent of the held tokens fits in the pages that hold them.
    expect(stats.memory.kvF16Equivalent).toBe(stats.context.used * 2 * 5 * 4 * 8 * 2);
    expect(stats.memory.kvF16Equivalent).toBeLessThanOrEqual(stats.memory.kvUsed);
    expect(stats.memory.scratch).toBeGreaterThan(0);
    expect(stats.context.used).toBeGreaterThan(40);
    expect(stats.context.capacity).toBe(
      Math.min(stats.model!.contextLength, stats.kv.pagesBudget * stats.kv.pageTokens),
    );
    // An f16 cache has no precision plan, and holds what an f16 cache holds.
    expect(stats.kv.plan).toBeNull();
    expect(stats.kv.holds).toEqual({ tokens: stats.context.capacity, f16Tokens: stats.context.capacity });
    expect(stats.adapter?.maxBufferSize).toBeGreaterThan(0);
    expect(seen.length).toBeGreaterThanOrEqual(4); // subscribe, load, mid-generation, end
    expect(seen.some((s) => s.queue.running)).toBe(true);
    expect(seen.at(-1)!.context.used).toBe(stats.context.used);
    unsubscribe();
    const count = seen.length;
    await engine.deleteConversation('x');
    expect(seen.length).toBe(count);
    expect((await engine.stats()).context.used).toBe(0);
    engine.destroy();
  });

  it('rejects bad requests and sources with typed errors that say what to fix', async () => {
    const engine = createNodeEngine({ gpu: ctx.gpu });
    await expect(chat(engine, { messages: [{ role: 'user', content: 'x' }] })).rejects.toThrow(ModelNotLoadedError);
    await expect(engine.load('ftp://example.com/model.gguf')).rejects.toThrow(/http\(s\) only/);
    await expect(engine.load('file:///tmp/model.gguf')).rejects.toThrow(InvalidRequestError);
    await expect(engine.load(modelPath!, { kv: 'int4' as 'int2' })).rejects.toThrow(/kv = "int4" is invalid/);
    await expect(engine.load(modelPath!, { rotation: 'diagonal' as 'none' })).rejects.toThrow(/rotation/);
    await expect(engine.load(modelPath!, { kvBudgetBytes: -1 })).rejects.toThrow(/kvBudgetBytes/);
    await expect(engine.load(modelPath!, { experimental: { prefillMatmul: 'int4' as 'f32' } })).rejects.toThrow(
      /experimental.prefillMatmul = "int4" is invalid: use 'auto', 'f32' or 'int8-dot'/,
    );
    await expect(engine.load(modelPath!, { experimental: { prefillAttention: 'int8' as 'f32' } })).rejects.toThrow(
      /experimental.prefillAttention = "int8" is invalid: use 'auto', 'f32' or 'int8-dot'/,
    );
    const boost = (boostLayers: unknown) => ({
      kv: 'int2' as const,
      experimental: { boostLayers: boostLayers as number[] },
    });
    await expect(engine.load(modelPath!, boost('3'))).rejects.toThrow(/boostLayers/);
    // A research knob outside `experimental` is an unknown field whose message says where it goes.
    await expect(engine.load(modelPath!, { sink: 16 } as EngineLoadOptions)).rejects.toThrow(
      /unknown field 'sink'. It is experimental: pass it as experimental: \{ sink \}/,
    );
    // What only the model can tell is the pool's check, still an InvalidRequestError.
    await expect(engine.load(modelPath!, boost([7]))).rejects.toThrow(/names 7, not a layer/);
    // A Blob (a File in the browser) loads like a path.
    await engine.load(new Blob([readFileSync(modelPath!)]), { kvBudgetBytes: 4 << 20 });
    expect((await engine.stats()).model?.layers).toBe(5);
    // Options are checked before the load queues: a bad one leaves the loaded model in place.
    await expect(engine.load(modelPath!, { kvBudgetBytes: 0 })).rejects.toThrow(/kvBudgetBytes = 0 is invalid/);
    expect((await engine.stats()).model?.layers).toBe(5);
    const bad: Array<[unknown, RegExp]> = [
      [{ messages: [] }, /non-empty array/],
      [{ messages: [{ role: 'robot', content: 'x' }] }, /role/],
      [{ messages: [{ role: 'user', content: 5 }] }, /content/],
      [{ messages: [{ role: 'user', content: 'x' }], temperature: -1 }, /temperature/],
      [{ messages: [{ role: 'user', content: 'x' }], top_p: 0 }, /top_p/],
      [{ messages: [{ role: 'user', content: 'x' }], max_tokens: 1.5 }, /max_tokens/],
      [{ messages: [{ role: 'user', content: 'x' }], stop: ['a', 'b', 'c', 'd', 'e'] }, /stop/],
      [{ messages: [{ role: 'user', content: 'x' }], n: 2 }, /unknown field 'n'/],
    ];
    for (const [request, message] of bad) {
      const error = await engine.chat.completions.create(request as ChatCompletionRequest).catch((e: unknown) => e);
      expect(error, JSON.stringify(request)).toBeInstanceOf(InvalidRequestError);
      expect((error as Error).message).toMatch(message);
    }
    // A stop string ends the reply before it.
    const free = await chat(engine, { messages: [{ role: 'user', content: 'Tell me a story.' }], max_tokens: 30 });
    const content = free.choices[0].message.content ?? '';
    const stopAt = content.indexOf(' ', 5);
    const stop = content.slice(stopAt, stopAt + 3);
    const stopped = await chat(engine, {
      messages: [{ role: 'user', content: 'Tell me a story.' }],
      max_tokens: 30,
      stop,
    });
    expect(stopped.choices[0].finish_reason).toBe('stop');
    expect(stopped.choices[0].message.content ?? '').toBe(content.slice(0, content.indexOf(stop)));
    engine.destroy();
  });
});

describe('kv omitted: the 2-bit cache where the K/V rows form 2-bit groups, else f16', () => {
  const fixture = (heads: number, headDim: number) =>
    modelFixtureGguf({
      architecture: 'llama',
      weightType: GgmlType.F32,
      dim: heads * headDim,
      layers: 1,
      heads,
      kvHeads: heads,
      // The fixture's type lists the common head sizes; it writes any even one.
      headDim: headDim as 64,
      ffnDim: 64,
      vocab: 300,
      tiedOutput: true,
      ropeFreqBase: 10000,
      llama3RopeFreqs: false,
      seed: 7,
      contextLength: 256,
    });

  it("takes int2 on SmolLM2-360M's rows (5 heads × 64: one group of 320); an asked-for group of 128 fails", async () => {
    const bytes = fixture(5, 64);
    const engine = createNodeEngine({ gpu: ctx.gpu });
    const info = await engine.load(new Blob([bytes]), { kvBudgetBytes: 1 << 20, calibrate: 'off' });
    expect(info.kv).toBe('int2');
    const reply = await engine.completions.create({ prompt: 'ab', max_tokens: 4, temperature: 0 });
    expect(reply.choices[0].finish_reason).toMatch(/^(length|stop)$/);
    await expect(
      engine.load(new Blob([bytes]), { kv: 'int2', kvBudgetBytes: 1 << 20, experimental: { groupSize: 128 } }),
    ).rejects.toThrow(/group size 128 must divide the row width 320/);
    engine.destroy();
  });

  it('loads f16 on rows of 3 heads × 40 (120 values, no whole 2-bit words), and ModelInfo and the stats say f16', async () => {
    const bytes = fixture(3, 40);
    const engine = createNodeEngine({ gpu: ctx.gpu });
    const info = await engine.load(new Blob([bytes]), { kvBudgetBytes: 1 << 20 });
    expect(info.kv).toBe('f16');
    const reply = await engine.completions.create({ prompt: 'ab', max_tokens: 4, temperature: 0 });
    expect(reply.choices[0].finish_reason).toMatch(/^(length|stop)$/);
    const stats = await engine.stats();
    expect(stats.model?.kv).toBe('f16');
    expect(stats.kv).toMatchObject({ mode: 'f16', rotation: 'none', clip: null, boostLayers: [] });
    expect(stats.kv.plan).toBeNull();
    expect(stats.kv.holds.tokens).toBe(stats.kv.holds.f16Tokens);
    // An explicit int2 still asks for the 2-bit cache, and fails where the model cannot take it.
    await expect(engine.load(new Blob([bytes]), { kv: 'int2', kvBudgetBytes: 1 << 20 })).rejects.toThrow(
      /group size 120 must be a multiple of 16/,
    );
    engine.destroy();
  });
});
