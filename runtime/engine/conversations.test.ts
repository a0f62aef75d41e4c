/**
 * The conversation cache under page pressure (issue 9, point 4). An int2 pool keeps the sinks and recent windows of
 * its sequences in an f16 share of its own: idle conversations fill it while 2-bit pages are free. The cache must make
 * room by kind (flush idle windows to 2 bits, then evict), so that a request that fits the pool on its own never
 * meets ContextOverflowError, and every idle conversation it keeps still holds what it held.
 *
 * The engine is replaced by the pool's own bookkeeping: requests step the pool exactly as ModelRunner.run does (rewind,
 * reserve, prefill chunks, decode steps), without running a model, so hundreds of requests take seconds.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { ContextOverflowError } from '../../core/errors.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { seededRandom } from '../../test/random.ts';
import { KvPagePool, type KvPoolOptions, type KvSequence } from '../kv/pool.ts';
import { ConversationCache, commonPrefixLength } from './conversations.ts';
import type { ModelRunner } from './model-runner.ts';

const ctx = withTestGpu();

/** What ModelRunner.run does to the pool for a prompt of `promptTokens` with `reuse` cached and `maxTokens` to generate. */
function engineSteps(pool: KvPagePool, seq: KvSequence, promptTokens: number, reuse: number, maxTokens: number): void {
  pool.truncate(seq, Math.min(reuse, seq.length, promptTokens - 1));
  try {
    pool.reserve(seq, promptTokens + maxTokens);
  } catch (error) {
    if (!(error instanceof ContextOverflowError)) throw error;
    pool.reserve(seq, promptTokens + 1);
  }
  for (let position = seq.length; position < promptTokens; position += pool.maxStepTokens) {
    pool.writeStep(seq, position, Math.min(pool.maxStepTokens, promptTokens - position));
  }
  // The first token comes from the last prefill chunk; every later one is one decode step. Unlike ModelRunner.run, an
  // overflow here is not swallowed: a reply cut short by the pool is what this test is about.
  for (let i = 1; i < maxTokens; i++) pool.writeStep(seq, seq.length, 1);
}

function fakeEngine(pool: KvPagePool): ModelRunner {
  const engine = {
    pool,
    prefillSequence: async (seq: KvSequence, ids: number[], reuse = 0) => engineSteps(pool, seq, ids.length, reuse, 0),
  };
  return engine as unknown as ModelRunner;
}

/** One chat turn as LongtabEngine.generate runs it: attach, make room, generate, record. Returns the reused tokens. */
async function turn(
  cache: ConversationCache,
  pool: KvPagePool,
  id: string,
  ids: number[],
  maxTokens: number,
  systemIds: number[] | null = null,
): Promise<number> {
  const entry = cache.conversation(id);
  await cache.attach(entry, systemIds);
  const reuse = Math.min(commonPrefixLength(entry.ids, ids), ids.length - 1);
  const dbg = {
    id,
    len: ids.length,
    maxTokens,
    reuse,
    seqLen: entry.seq!.length,
    needBefore: pool.pagesNeeded(entry.seq, reuse, ids.length + maxTokens),
    obtBefore: pool.pagesObtainable(),
  };
  await cache.makeRoom([entry], entry.seq, reuse, ids.length + maxTokens);
  if (process.env.DBG)
    console.log(
      'TURN',
      JSON.stringify({
        ...dbg,
        need: pool.pagesNeeded(entry.seq, reuse, ids.length + maxTokens),
        obt: pool.pagesObtainable(),
        seqs: pool.stats().sequences,
        f16Used: pool.stats().f16.pagesUsed,
        kinds: entry.seq!.pages.map((e) => e >>> 28).join(''),
      }),
    );
  engineSteps(pool, entry.seq!, ids.length, reuse, maxTokens);
  const reply = Array.from({ length: maxTokens }, (_, i) => 1000 + i);
  cache.record(entry, [...ids, ...reply]);
  expect(entry.seq!.length).toBe(ids.length + maxTokens - 1);
  return Math.min(reuse, entry.seq!.length);
}

function tokens(random: () => number, n: number): number[] {
  return Array.from({ length: n }, () => Math.floor(random() * 500));
}

/** The int2 pool of the long-session test: stories260K's KV shape, a 2 MiB budget, 8 sequences, chunks of 128. */
const STORIES_INT2: KvPoolOptions = {
  layers: 5,
  kvHeads: 4,
  headDim: 8,
  budgetBytes: 2 << 20,
  maxSequences: 8,
  kv: 'quant',
  sink: 64,
  window: 256,
  maxStepTokens: 128,
};

describe('ConversationCache on an int2 pool', () => {
  it('idle conversations holding their f16 windows do not make a new one overflow: they are flushed, not lost', async () => {
    const pool = new KvPagePool(ctx.gpu, STORIES_INT2);
    try {
      const cache = new ConversationCache(fakeEngine(pool));
      const random = seededRandom(9);
      const histories = new Map<string, number[]>();
      // Four idle conversations of 400-520 tokens: each keeps sink + window, 20-21 f16 pages; the share holds 62.
      for (let c = 0; c < 4; c++) {
        const ids = tokens(random, 400 + 40 * c);
        await turn(cache, pool, `c${c}`, ids, 40);
        histories.set(`c${c}`, cache.conversation(`c${c}`).ids.slice());
        expect(pool.audit()).toEqual([]);
      }
      // A new conversation with a long prompt needs sink + window + two chunks of f16 pages at its peak (38) while
      // 2-bit pages are plentiful. Flushed, an idle conversation keeps 5 f16 pages: its sink and its partial last page.
      expect(pool.pagesNeeded(null, 0, 760)).toEqual({ f16: 38, quant: 27 });
      expect(pool.pagesObtainable().quant).toBeGreaterThan(600);
      await turn(cache, pool, 'new', tokens(random, 700), 60);
      expect(pool.audit()).toEqual([]);
      expect(cache.evictions).toBe(0);
      expect(cache.flushes).toBeGreaterThan(0);
      expect(pool.flushed).toBe(cache.flushes);
      // Every idle conversation still holds what it held, and a follow-up reuses all of it.
      for (const [id, ids] of histories) {
        const entry = cache.conversation(id);
        expect(entry.seq?.length).toBe(ids.length);
        expect(entry.ids).toEqual(ids);
        const reused = await turn(cache, pool, id, [...ids, ...tokens(random, 30)], 20);
        expect(reused).toBe(ids.length);
        expect(pool.audit()).toEqual([]);
      }
      expect(cache.evictions).toBe(0);
      // Deleting every conversation returns every page and every slab.
      for (const id of [...histories.keys(), 'new']) cache.delete(id);
      expect(pool.stats()).toMatchObject({ sequences: 0, pagesUsed: 0, slabs: 0, pagesReserved: 0 });
      expect(pool.audit()).toEqual([]);
    } finally {
      pool.destroy();
    }
  });

  it('evicts least recently used conversations when flushing is not enough (shared pages, 2-bit pages short)', async () => {
    // Quant pages for about one long sequence: flushing idle windows cannot help, eviction must.
    const pool = new KvPagePool(ctx.gpu, {
      ...STORIES_INT2,
      f16BudgetBytes: 62 * 10240,
      budgetBytes: 62 * 10240 + 60 * 1920,
    });
    try {
      const cache = new ConversationCache(fakeEngine(pool));
      const random = seededRandom(10);
      const system = tokens(random, 200); // forked: its pages past the sink are shared, so they are never flushed
      await turn(cache, pool, 'a', [...system, ...tokens(random, 300)], 10, system);
      await turn(cache, pool, 'b', [...system, ...tokens(random, 300)], 10, system);
      await turn(cache, pool, 'c', tokens(random, 900), 100);
      expect(pool.audit()).toEqual([]);
      expect(cache.evictions).toBeGreaterThan(0);
      expect(cache.conversation('c').seq?.length).toBe(999);
    } finally {
      pool.destroy();
    }
  });

  it('property: a session of random turns never overflows when each request fits the pool alone; audits stay clean', async () => {
    const f16PageBytes = 2 * 2 * 2 * 4 * 8 * 2;
    const quantPageBytes = 2 * 4 * (2 + 2) * 4;
    let requests = 0;
    let flushed = 0;
    let evicted = 0;
    await fc.assert(
      fc.asyncProperty(
        fc.record({
          sink: fc.constantFrom(0, 4, 8),
          window: fc.constantFrom(4, 8, 16),
          step: fc.constantFrom(4, 8, 12),
          maxSequences: fc.integer({ min: 3, max: 6 }),
          quantPages: fc.integer({ min: 24, max: 200 }),
          turns: fc.array(
            fc.record({
              conversation: fc.nat(5),
              system: fc.boolean(),
              newTokens: fc.integer({ min: 1, max: 40 }),
              maxTokens: fc.integer({ min: 1, max: 24 }),
              // Drop the oldest turns: keep only the last part of the history (a rollback into old pages).
              keepFraction: fc.oneof(fc.constant(1), fc.double({ min: 0, max: 1, noNaN: true })),
              remove: fc.nat(20),
            }),
            { minLength: 10, maxLength: 40 },
          ),
          seed: fc.nat(),
        }),
        async ({ sink, window, step, maxSequences, quantPages, turns, seed }) => {
          // Default f16 share: sinks and windows of two sequences plus two steps' pages.
          const probe = new KvPagePool(ctx.gpu, {
            layers: 2,
            kvHeads: 2,
            headDim: 8,
            pageTokens: 4,
            kv: 'quant',
            sink,
            window,
            maxStepTokens: step,
            maxSequences,
            budgetBytes: 1 << 20,
          });
          const f16Pages = probe.stats().f16.pagesBudget;
          probe.destroy();
          const pool = new KvPagePool(ctx.gpu, {
            layers: 2,
            kvHeads: 2,
            headDim: 8,
            pageTokens: 4,
            kv: 'quant',
            sink,
            window,
            maxStepTokens: step,
            maxSequences,
            f16BudgetBytes: f16Pages * f16PageBytes,
            budgetBytes: f16Pages * f16PageBytes + quantPages * quantPageBytes,
          });
          try {
            expect(pool.stats().f16.pagesBudget).toBe(f16Pages);
            const cache = new ConversationCache(fakeEngine(pool));
            const random = seededRandom(seed);
            const systemIds = tokens(random, 10);
            const histories = new Map<string, number[]>();
            for (const t of turns) {
              const id = `c${t.conversation}`;
              let history = histories.get(id) ?? (t.system ? systemIds.slice() : []);
              if (t.remove > 15) {
                cache.delete(id);
                histories.delete(id);
                expect(pool.audit()).toEqual([]);
                continue;
              }
              if (t.keepFraction < 1) history = history.slice(Math.floor(history.length * (1 - t.keepFraction)));
              let ids = [...history, ...tokens(random, t.newTokens)];
              // Does the request fit an empty pool? Otherwise drop from the front (as 'drop_oldest_turns').
              const fits = () => {
                const need = pool.pagesNeeded(null, 0, ids.length + t.maxTokens);
                return need.f16 <= f16Pages && need.quant <= quantPages;
              };
              while (!fits()) ids = ids.slice(Math.ceil(ids.length / 4));
              const system = ids.length > systemIds.length && commonPrefixLength(ids, systemIds) === systemIds.length;
              const held = cache.peek(id)?.seq;
              const flushesBefore = pool.flushed;
              await turn(cache, pool, id, ids, t.maxTokens, system ? systemIds : null);
              requests++;
              if (held && pool.flushed > flushesBefore) flushed++;
              histories.set(id, cache.peek(id)!.ids.slice());
              expect(pool.audit()).toEqual([]);
              // Every other conversation that still has a sequence holds exactly the ids it recorded.
              for (const [other, ids] of histories) {
                const e = cache.peek(other);
                if (e?.seq) {
                  expect(e.seq.length).toBe(e.ids.length);
                  expect(e.ids).toEqual(ids);
                }
              }
            }
            evicted += cache.evictions;
            for (const id of histories.keys()) cache.delete(id);
            expect(pool.stats()).toMatchObject({ sequences: 0, pagesUsed: 0, slabs: 0 });
          } finally {
            pool.destroy();
          }
        },
      ),
      { numRuns: 60, seed: 20261209 },
    );
    expect(requests).toBeGreaterThan(600);
    expect(flushed).toBeGreaterThan(20);
    expect(evicted).toBeGreaterThan(20);
  });
});
