/**
 * A long session in one engine (issue 9): 200+ generations and at least 20K generated tokens on stories260K, mixing
 * raw completions, several conversations with follow-ups (LRU eviction and dropped turns included), sampled and greedy
 * requests, stream aborts and engine.abort(), and max_tokens from 1 to 160. After every request the KV pool's own
 * audit must be clean; at the end, once the conversations are deleted the GPU memory is back to its level after load,
 * and after unload back to where it was before. The decode-speed drift (first vs last 20 generations) is printed as a
 * report line, never asserted.
 */
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { faultLog } from '../../test/regressions/fault-log.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { InvalidRequestError } from '../errors.ts';
import type { MemorySnapshot } from '../gpu/allocator.ts';
import type { ChatMessageParam, CompletionUsage, LongtabEngine } from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const log = faultLog('session');

/**
 * LONGTAB_SESSION=full is the issue's size (>= 20K tokens, replies up to 160 tokens): about 10-25 minutes on a loaded
 * 2-core CPU Vulkan machine. The default keeps 200 generations with shorter replies so the suite stays a few minutes.
 */
const FULL = process.env.LONGTAB_SESSION === 'full';
const GENERATIONS = Number(process.env.LONGTAB_SESSION_GENERATIONS ?? 200);
const MIN_TOKENS = Number(process.env.LONGTAB_SESSION_TOKENS ?? (FULL ? 20_000 : 1_500));
const MAX_TOKENS_CHOICES = FULL ? [1, 8, 40, 120, 160, 160, 160] : [1, 2, 4, 8, 12, 16, 24];
const CONVERSATIONS = 6;
const SYSTEM: ChatMessageParam = { role: 'system', content: 'Once upon a time there was a little girl named Lily.' };
const PROMPTS = ['', 'Once upon a time', 'Tom had a big red ball.', 'One day, a cat', 'The sun was hot and'];
const FOLLOW_UPS = ['What happened next?', 'Tell me more.', 'Where did they go?', 'And then?'];

/** A small deterministic generator, so a failing session can be replayed exactly. */
function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Labels and sizes of the live buffers (the allocator keeps them private; read here only to name a leak). */
function liveBuffers(): string[] {
  const live = (ctx.gpu.allocator as unknown as { live: Map<GPUBuffer, { size: number }> }).live;
  return [...live].map(([buffer, entry]) => `${buffer.label} ${entry.size}`).sort();
}

interface SessionResult {
  liveAfterLoad: string[];
  generations: number;
  tokens: number;
  aborts: number;
  decodeRates: number[];
  afterLoad: MemorySnapshot;
}

/** Runs the mixed session; every request is followed by the pool audit. */
async function runSession(
  engine: LongtabEngine,
  generations: number,
  minTokens: number,
  seed: number,
): Promise<SessionResult> {
  const random = mulberry32(seed);
  const pick = <T>(items: readonly T[]): T => items[Math.floor(random() * items.length)];
  const afterLoad = ctx.gpu.allocator.snapshot();
  const histories = new Map<string, ChatMessageParam[]>();
  const result: SessionResult = {
    liveAfterLoad: liveBuffers(),
    generations: 0,
    tokens: 0,
    aborts: 0,
    decodeRates: [],
    afterLoad,
  };
  const audit = (label: string) => expect(engine.core!.pool.audit(), `pool audit after ${label}`).toEqual([]);
  const count = (usage: CompletionUsage) => {
    result.generations++;
    result.tokens += usage.completion_tokens;
    if (usage.completion_tokens >= 8) result.decodeRates.push(usage.longtab.decode_tokens_per_second);
  };
  while ((result.generations < generations || result.tokens < minTokens) && result.generations < generations * 3) {
    const n = result.generations;
    const maxTokens = pick(MAX_TOKENS_CHOICES);
    const sampling = random() < 0.3 ? { temperature: 0.9, top_p: 0.95, seed: n } : { temperature: 0 };
    const kind = random();
    if (kind < 0.3) {
      // Raw completion, sometimes streamed and cut after a few chunks.
      const prompt = pick(PROMPTS);
      if (random() < 0.25) {
        const stream = await engine.completions.create({ prompt, max_tokens: maxTokens, stream: true, ...sampling });
        let chunks = 0;
        let usage: CompletionUsage | undefined;
        const cutAt = 1 + Math.floor(random() * 6);
        for await (const chunk of stream) {
          usage = chunk.usage ?? usage;
          if (++chunks === cutAt) break; // return() aborts the request
        }
        result.aborts++;
        result.generations++;
        audit(`aborted completion ${n}`);
        if (usage) result.tokens += usage.completion_tokens;
        continue;
      }
      const done = await engine.completions.create({ prompt, max_tokens: maxTokens, ...sampling });
      count(done.usage!);
      audit(`completion ${n}`);
      continue;
    }
    // A conversation turn (new or follow-up); long ones drop their oldest turns.
    const id = `c${Math.floor(random() * CONVERSATIONS)}`;
    const history = histories.get(id) ?? (random() < 0.5 ? [SYSTEM] : []);
    const messages: ChatMessageParam[] = [
      ...history,
      { role: 'user', content: history.length > 1 ? pick(FOLLOW_UPS) : 'Tell me a story.' },
    ];
    const request = {
      messages,
      conversation_id: id,
      max_tokens: maxTokens,
      context_overflow: 'drop_oldest_turns',
      ...sampling,
    } as const;
    if (kind > 0.92) {
      // engine.abort() while the reply streams: the request returns what it had with finish_reason 'abort'.
      const stream = await engine.chat.completions.create({ ...request, stream: true });
      let chunks = 0;
      let finish: string | null = null;
      for await (const chunk of stream) {
        if (++chunks === 3) await engine.abort();
        finish = chunk.choices[0].finish_reason ?? finish;
        if (chunk.usage) result.tokens += chunk.usage.completion_tokens;
      }
      expect(['abort', 'stop', 'length']).toContain(finish);
      result.aborts++;
      result.generations++;
      histories.delete(id); // the client discards an aborted turn
      await engine.deleteConversation(id);
      audit(`engine.abort() in ${id}`);
      continue;
    }
    const reply = await engine.chat.completions.create(request);
    count(reply.usage);
    audit(`chat turn ${n} in ${id}`);
    histories.set(id, [...messages, { role: 'assistant', content: reply.choices[0].message.content }]);
  }
  for (let i = 0; i < CONVERSATIONS; i++) await engine.deleteConversation(`c${i}`);
  audit('deleting every conversation');
  return result;
}

function mean(values: number[]): number {
  return values.reduce((a, b) => a + b, 0) / Math.max(values.length, 1);
}

describe.skipIf(!modelPath)('a long session on stories260K', () => {
  it(`${GENERATIONS} generations and >= ${MIN_TOKENS} tokens in one engine: clean audits, memory back to its level`, async () => {
    const started = performance.now();
    const beforeLoad = ctx.gpu.allocator.snapshot();
    const engine = createNodeEngine({ gpu: ctx.gpu });
    await engine.load(modelPath!, { kv: 'f16', kvBudgetBytes: 2 << 20, maxSequences: 8 });
    const session = await runSession(engine, GENERATIONS, MIN_TOKENS, 9);
    const afterSession = ctx.gpu.allocator.snapshot();
    const stats = await engine.stats();
    const first = mean(session.decodeRates.slice(0, 20));
    const last = mean(session.decodeRates.slice(-20));
    const seconds = (performance.now() - started) / 1000;
    const report =
      `${session.generations} generations, ${session.tokens} tokens, ${session.aborts} aborts, ` +
      `${stats.context.evictions} evictions in ${seconds.toFixed(0)} s; decode ${first.toFixed(0)} tok/s (first 20) → ` +
      `${last.toFixed(0)} tok/s (last 20), drift ${(((last - first) / first) * 100).toFixed(1)}%`;
    console.log(`[long session, f16 KV] ${report}`);
    log.record({
      area: 'session',
      fault: `long session, f16 KV: ${session.generations} mixed requests (conversations, follow-ups, aborts, max_tokens ${MAX_TOKENS_CHOICES[0]}..${MAX_TOKENS_CHOICES.at(-1)})`,
      expected: 'pool audit empty after every request; memory back to its after-load level; speed drift reported',
      outcome: report,
      ok: true,
      count: session.generations,
    });
    expect(session.generations).toBeGreaterThanOrEqual(GENERATIONS);
    expect(session.tokens).toBeGreaterThanOrEqual(MIN_TOKENS);
    // Conversations deleted: memory is back to its after-load level except for two caches the KV code keeps on
    // purpose (named so anything else fails): pool slabs and the copy bounce buffer, which stay allocated up to the
    // KV budget, and the paged attention's per-token-count dispatch parameters (at most prefillChunk x layers x 2).
    // Both are reported as findings in docs/faults.md; releasing them when idle would make the level exact.
    const grown = liveBuffers().filter((b) => !session.liveAfterLoad.includes(b));
    const gone = session.liveAfterLoad.filter((b) => !liveBuffers().includes(b));
    const kept =
      /^(kv:kv\.f16\.slab\d+|kv:kv\.copyBounce\d+|scratch:kv\.layer\d+\.t\d+\.(append|attention)\.params) \d+$/;
    expect(gone).toEqual([]);
    expect(grown.filter((b) => !kept.test(b))).toEqual([]);
    const grownBytes = afterSession.totalBytes - session.afterLoad.totalBytes;
    expect(afterSession.bytes.kv).toBeLessThanOrEqual(session.afterLoad.bytes.kv + (2 << 20) + (64 << 10));
    expect(grown.filter((b) => b.includes('.params')).length).toBeLessThanOrEqual(128 * 5 * 2);
    expect(afterSession.bytes.weights).toBe(session.afterLoad.bytes.weights);
    expect(afterSession.bytes.staging).toBe(session.afterLoad.bytes.staging);
    log.record({
      area: 'session',
      fault: 'GPU memory after the session, every conversation deleted, vs. right after load',
      expected: 'back to the after-load level',
      outcome:
        grown.length === 0
          ? 'exactly the after-load level'
          : `FINDING: ${grown.length} buffers (${grownBytes} bytes) above it: ${grown.filter((b) => b.startsWith('kv:')).length} KV slabs/bounce kept up to the budget, ${grown.filter((b) => b.includes('.params')).length} per-token-count attention/append parameter buffers cached until unload; all released by unload`,
      ok: grown.every((b) => kept.test(b)),
    });
    expect(stats.context.conversations).toBe(0);
    await engine.unload();
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(beforeLoad.totalBuffers);
    expect(ctx.gpu.allocator.snapshot().totalBytes).toBe(beforeLoad.totalBytes);
    engine.destroy();
  }, 1_800_000);

  it('int2 KV: a shorter session when this build loads it (skipped with a note otherwise)', async (test) => {
    const engine = createNodeEngine({ gpu: ctx.gpu });
    try {
      await engine.load(modelPath!, { kv: 'int2', kvBudgetBytes: 2 << 20, maxSequences: 8 });
    } catch (error) {
      if (!(error instanceof InvalidRequestError)) throw error;
      console.warn(`\n*** SKIPPING the int2 session: ${error.message} ***\n`);
      log.record({
        area: 'session',
        fault: 'long session, int2 KV',
        expected: 'runs when int2 is switched on',
        outcome: `not run: ${error.message}`,
        ok: true,
      });
      engine.destroy();
      test.skip();
      return;
    }
    let session: SessionResult;
    try {
      session = await runSession(engine, 30, 200, 10);
    } catch (error) {
      log.record({
        area: 'session',
        fault: "long session, int2 KV: chat turns with context_overflow 'drop_oldest_turns' (seed 10)",
        expected: 'pool audit empty after every request; no ContextOverflowError when turns can be dropped',
        outcome: `FINDING: ${error instanceof Error ? `${error.name}: ${error.message}` : String(error)}`,
        ok: false,
      });
      throw error;
    }
    log.record({
      area: 'session',
      fault: `long session, int2 KV: ${session.generations} mixed requests`,
      expected: 'pool audit empty after every request',
      outcome: `${session.generations} generations, ${session.tokens} tokens`,
      ok: true,
    });
    await engine.unload();
    engine.destroy();
  }, 600_000);
});
