/**
 * A long session in one engine (issue 9): 200+ generations and at least 20K generated tokens on stories260K, mixing
 * raw completions, several conversations with follow-ups (LRU eviction and dropped turns included), sampled and greedy
 * requests, stream aborts and engine.abort(), and max_tokens from 1 to 160, with an f16 and with an int2 KV cache
 * (where idle conversations' windows are flushed to 2 bits to make room). After every request the KV pool's own
 * audit must be clean; at the end, once the conversations are deleted the pool has returned its slabs, so the GPU
 * memory is back to its level after load (but for the named per-token-count caches), and after unload back to where
 * it was before. The decode-speed drift (first vs last 20 generations) is printed as a report line, never asserted.
 */
import { describe, expect, it } from 'vitest';
import { InvalidRequestError } from '../../core/errors.ts';
import type { MemorySnapshot } from '../../core/gpu/allocator.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { seededRandom } from '../../test/random.ts';
import { type FaultRecord, faultLog } from '../../test/regressions/fault-log.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import type { ChatMessageParam, CompletionUsage, LongtabEngine } from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const log = faultLog('session');

/**
 * LONGTAB_SESSION=full is the issue's size for f16 KV (>= 20K tokens, replies up to 160 tokens): about 10-25 minutes
 * on a loaded 2-core CPU Vulkan machine. int2 attention is slower there, so the int2 session takes the same replies
 * but 100 generations and >= 5K tokens (8 min); LONGTAB_SESSION_INT2=full (with LONGTAB_SESSION=full) gives it the
 * issue's size too: 32-38 minutes there (2026-11-29, twice: 265 generations, 20,038 tokens, 266 clean audits, 1,284
 * idle-window pages flushed, 18 evictions). The default keeps 200 generations with shorter replies (f16) and 30
 * (int2): a few minutes.
 */
const FULL = process.env.LONGTAB_SESSION === 'full';
const INT2_FULL = FULL && process.env.LONGTAB_SESSION_INT2 === 'full';
const GENERATIONS = Number(process.env.LONGTAB_SESSION_GENERATIONS ?? 200);
const MIN_TOKENS = Number(process.env.LONGTAB_SESSION_TOKENS ?? (FULL ? 20_000 : 1_500));
const MAX_TOKENS_CHOICES = FULL ? [1, 8, 40, 120, 160, 160, 160] : [1, 2, 4, 8, 12, 16, 24];
const CONVERSATIONS = 6;
const SYSTEM: ChatMessageParam = { role: 'system', content: 'Once upon a time there was a little girl named Lily.' };
const PROMPTS = ['', 'Once upon a time', 'Tom had a big red ball.', 'One day, a cat', 'The sun was hot and'];
const FOLLOW_UPS = ['What happened next?', 'Tell me more.', 'Where did they go?', 'And then?'];

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
  /** Pool audits run (after every request and after deleting every conversation), all clean. */
  audits: number;
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
  const random = seededRandom(seed); // deterministic, so a failing session replays exactly
  const pick = <T>(items: readonly T[]): T => items[Math.floor(random() * items.length)];
  const afterLoad = ctx.gpu.allocator.snapshot();
  const histories = new Map<string, ChatMessageParam[]>();
  const result: SessionResult = {
    liveAfterLoad: liveBuffers(),
    generations: 0,
    tokens: 0,
    aborts: 0,
    audits: 0,
    decodeRates: [],
    afterLoad,
  };
  const audit = (label: string) => {
    expect(engine.runner!.pool.audit(), `pool audit after ${label}`).toEqual([]);
    result.audits++;
  };
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

/** `items` with one occurrence removed per occurrence in `remove`. */
function withoutEach(items: string[], remove: string[]): string[] {
  const counts = new Map<string, number>();
  for (const r of remove) counts.set(r, (counts.get(r) ?? 0) + 1);
  return items.filter((item) => {
    const n = counts.get(item) ?? 0;
    if (n > 0) counts.set(item, n - 1);
    return n === 0;
  });
}

/**
 * Every conversation deleted: checks the GPU memory against its after-load level and returns the finding. The pool
 * has returned its slabs (the warm-up's slab, live after load, included), so KV memory is at or below that level;
 * what may remain is the per-token-count dispatch caches (the paged attention's parameters and partials, and the
 * forward graph's parameters, of each prepared token count: at most prefillChunk x layers x a few), kept until
 * unload: a finding in docs/faults.md.
 */
function checkMemoryAfterDelete(session: SessionResult, kv: string): FaultRecord {
  const after = ctx.gpu.allocator.snapshot();
  const live = liveBuffers();
  // Multiset differences: a buffer label repeats (one per prepared token count), so each occurrence counts.
  const grown = withoutEach(live, session.liveAfterLoad);
  const gone = withoutEach(session.liveAfterLoad, live);
  // The per-token-count dispatch caches: the paged attention's (kv.…) and the forward graphs' and KV rotations'
  // parameters (blk.N.…).
  const kept =
    /^scratch:(kv\.(layer\d+\.)?t\d+\.[\w.]+|(embed|output_norm|output(\.all)?|blk\.\d+\.(attn_norm|ffn_norm|q|k|v|qkv|q_norm|k_norm|rope|rotate_qkv|o|gate|up|swiglu|gate_up|down))(#\d+|\.quantize)?\.params) \d+$/;
  expect(gone.filter((b) => !/^kv:kv\.(f16|quant)\.slab\d+ \d+$/.test(b))).toEqual([]);
  expect(grown.filter((b) => !kept.test(b))).toEqual([]);
  expect(after.bytes.kv).toBeLessThanOrEqual(session.afterLoad.bytes.kv);
  expect(grown.length).toBeLessThanOrEqual(128 * 5 * 4);
  expect(after.bytes.weights).toBe(session.afterLoad.bytes.weights);
  expect(after.bytes.staging).toBe(session.afterLoad.bytes.staging);
  const grownBytes = grown.reduce((sum, b) => sum + Number(b.split(' ').at(-1)), 0);
  return {
    area: 'session',
    fault: `GPU memory after the session (${kv} KV), every conversation deleted, vs. right after load`,
    expected: 'back to the after-load level',
    outcome:
      `KV ${after.bytes.kv - session.afterLoad.bytes.kv} bytes vs. after load (the pool returned its slabs)` +
      (grown.length === 0
        ? '; nothing else above it'
        : `; FINDING: ${grown.length} per-token-count attention/append/forward-graph buffers (${grownBytes} bytes) cached until unload`),
    ok: true,
  };
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
    const stats = await engine.stats();
    const first = mean(session.decodeRates.slice(0, 20));
    const last = mean(session.decodeRates.slice(-20));
    const seconds = (performance.now() - started) / 1000;
    const report =
      `${session.generations} generations, ${session.tokens} tokens, ${session.aborts} aborts, ` +
      `${session.audits} clean audits, ${stats.context.evictions} evictions in ${seconds.toFixed(0)} s; decode ${first.toFixed(0)} tok/s (first 20) → ` +
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
    log.record(checkMemoryAfterDelete(session, 'f16'));
    expect(stats.context.conversations).toBe(0);
    await engine.unload();
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(beforeLoad.totalBuffers);
    expect(ctx.gpu.allocator.snapshot().totalBytes).toBe(beforeLoad.totalBytes);
    engine.destroy();
  }, 1_800_000);

  const INT2_GENERATIONS = INT2_FULL ? GENERATIONS : FULL ? 100 : 30;
  const INT2_TOKENS = INT2_FULL ? MIN_TOKENS : FULL ? 5_000 : 200;
  it(`int2 KV: ${INT2_GENERATIONS} generations and >= ${INT2_TOKENS} tokens, idle windows flushed (skipped with a note when this build has no int2)`, async (test) => {
    const started = performance.now();
    const beforeLoad = ctx.gpu.allocator.snapshot();
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
    const fault = `long session, int2 KV (2 MiB, 8 sequences): ${INT2_GENERATIONS}+ mixed requests, max_tokens ${MAX_TOKENS_CHOICES[0]}..${MAX_TOKENS_CHOICES.at(-1)}, drop_oldest_turns (seed 10)`;
    let session: SessionResult;
    try {
      session = await runSession(engine, INT2_GENERATIONS, INT2_TOKENS, 10);
    } catch (error) {
      log.record({
        area: 'session',
        fault,
        expected: 'pool audit empty after every request; no ContextOverflowError when turns can be dropped',
        outcome: `FINDING: ${error instanceof Error ? `${error.name}: ${error.message}` : String(error)}`,
        ok: false,
      });
      throw error;
    }
    const stats = await engine.stats();
    const pool = engine.runner!.pool;
    const seconds = (performance.now() - started) / 1000;
    const report =
      `${session.generations} generations, ${session.tokens} tokens, ${session.aborts} aborts, ${session.audits} clean ` +
      `audits, ${stats.context.evictions} evictions, ${pool.flushed} idle-window pages flushed to 2 bits, ` +
      `${pool.demotions} demotions, ${pool.promotions} promotions in ${seconds.toFixed(0)} s; decode ` +
      `${mean(session.decodeRates.slice(0, 20)).toFixed(0)} → ${mean(session.decodeRates.slice(-20)).toFixed(0)} tok/s`;
    console.log(`[long session, int2 KV] ${report}`);
    log.record({
      area: 'session',
      fault,
      expected: 'pool audit empty after every request; no ContextOverflowError when turns can be dropped',
      outcome: report,
      ok: true,
      count: session.generations,
    });
    expect(session.generations).toBeGreaterThanOrEqual(INT2_GENERATIONS);
    expect(session.tokens).toBeGreaterThanOrEqual(INT2_TOKENS);
    expect(pool.demotions).toBeGreaterThan(0);
    log.record(checkMemoryAfterDelete(session, 'int2'));
    expect(stats.context.conversations).toBe(0);
    await engine.unload();
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(beforeLoad.totalBuffers);
    expect(ctx.gpu.allocator.snapshot().totalBytes).toBe(beforeLoad.totalBytes);
    engine.destroy();
  }, 2_400_000);
});
