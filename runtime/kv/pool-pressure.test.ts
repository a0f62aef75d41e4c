/**
 * The int2 pool under pressure from idle sequences (issue 9): `flush` demotes an idle sequence's window now, bit for
 * bit as the step demotion does; `pagesNeeded` is an upper bound on what a run takes of each kind, so a caller that
 * makes room for it never meets ContextOverflowError mid-run; `releaseFreeSlabs` returns the memory of an empty pool.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { ContextOverflowError } from '../../core/errors.ts';
import { readUint32 } from '../../core/gpu/readback.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { seededRandom } from '../../test/random.ts';
import { decodePageEntry, KV_PAGE_KIND, KvPagePool, type KvPoolOptions, type KvSequence } from './pool.ts';
import { f16Bits, f16BitsToNumber, quantizeRow } from './quant-format.ts';

const ctx = withTestGpu();

function int2Pool(options: Partial<KvPoolOptions> = {}): KvPagePool {
  return new KvPagePool(ctx.gpu, {
    layers: 2,
    kvHeads: 2,
    headDim: 8,
    pageTokens: 4,
    kv: 'quant',
    sink: 4,
    window: 8,
    keyFormat: { groupSize: 16 },
    valueFormat: { bits: 4, groupSize: 16 },
    budgetBytes: 64 << 10,
    maxStepTokens: 8,
    ...options,
  });
}

/**
 * Steps as the engine runs a request: rewind to `reuse`, prefill chunks of maxStepTokens, then decode steps;
 * `onStep` after each.
 */
function runRequest(
  pool: KvPagePool,
  seq: KvSequence,
  reuse: number,
  promptTokens: number,
  decode: number,
  onStep: () => void = () => {},
): void {
  pool.truncate(seq, Math.min(reuse, seq.length, promptTokens - 1));
  for (let position = seq.length; position < promptTokens; position += pool.maxStepTokens) {
    pool.writeStep(seq, position, Math.min(pool.maxStepTokens, promptTokens - position));
    onStep();
  }
  for (let i = 0; i < decode; i++) {
    pool.writeStep(seq, seq.length, 1);
    onStep();
  }
}

const kinds = (seq: KvSequence) => seq.pages.map((e) => decodePageEntry(e).kind);

/** Random f16 contents for an f16 page (bit patterns), as `write` puts them in the slab. */
function randomPage(pool: KvPagePool, random: () => number): Uint32Array<ArrayBuffer> {
  const words = new Uint32Array(pool.pageWords);
  for (let i = 0; i < words.length; i++) {
    const lo = f16Bits((random() * 2 - 1) * 3);
    const hi = f16Bits((random() * 2 - 1) * 3);
    words[i] = (lo | (hi << 16)) >>> 0;
  }
  return words;
}

/** One token's K (kv 0) or V (kv 1) row of `layer` in an f16 page: heads side by side, as the kernels read it. */
function f16Row(pool: KvPagePool, words: Uint32Array, layer: number, kv: 0 | 1, token: number): number[] {
  const half = pool.headDim / 2;
  const row: number[] = [];
  for (let h = 0; h < pool.kvHeads; h++) {
    const base = pool.layerOffsetWords(layer, kv) + h * pool.pageTokens * half + token * half;
    for (let w = 0; w < half; w++) {
      const word = words[base + w];
      row.push(f16BitsToNumber(word & 0xffff), f16BitsToNumber(word >>> 16));
    }
  }
  return row;
}

describe('KvPagePool under pressure from idle sequences', () => {
  it('flush demotes an idle window bit for bit as quantizeRow, keeps the sink, a partial page and shared pages', async () => {
    const { gpu } = ctx;
    const baseline = gpu.allocator.snapshot();
    const pool = int2Pool({ maxStepTokens: 64 });
    try {
      const seq = pool.createSequence();
      pool.writeStep(seq, 0, 30); // 8 pages, the last one partial; nothing is older than the window at position 0
      const child = pool.fork(seq); // pages 0..6 shared for now
      pool.writeStep(child, 20, 1); // the child copies page 5 and drops pages 6..7
      pool.free(child);
      const shared = pool.fork(seq);
      pool.truncate(shared, 12); // pages 0..2 stay shared with `seq`
      expect(seq.pages.every((e) => decodePageEntry(e).kind === KV_PAGE_KIND.f16)).toBe(true);
      const random = seededRandom(91);
      const contents = new Map<number, Uint32Array>();
      for (const entry of seq.pages) {
        const { slab, page } = decodePageEntry(entry);
        const words = randomPage(pool, random);
        contents.set(entry, words);
        gpu.device.queue.writeBuffer(pool.slabBindings()[slab], page * pool.pageBytes, words);
      }
      const before = [...seq.pages];
      const usedBefore = pool.stats().f16.pagesUsed;
      // Sink = page 0; pages 1..2 are shared with `shared`; page 7 is partial: 4 pages (3..6) can go, 3 at most here.
      expect(pool.flushablePages(seq)).toBe(4);
      expect(pool.flush(seq, 3)).toBe(3);
      expect(pool.flush(seq)).toBe(1);
      expect(pool.flush(seq)).toBe(0);
      expect(pool.flushed).toBe(4);
      const after = kinds(seq);
      expect(after).toEqual([0, 0, 0, 1, 1, 1, 1, 0]);
      expect(seq.pages.filter((_, i) => after[i] === 0)).toEqual(before.filter((_, i) => after[i] === 0));
      expect(pool.stats().f16.pagesUsed).toBe(usedBefore - 4);
      expect(pool.stats().quant.pagesUsed).toBe(4);
      expect(seq.length).toBe(30);
      expect(pool.audit()).toEqual([]);
      pool.submitPending(); // the flushed demotions (and the forks' page copies) go into this submit
      await gpu.device.queue.onSubmittedWorkDone();
      expect([...(await readUint32(gpu, pool.pageTable, seq.pages.length, seq.tableOffset))]).toEqual(seq.pages);
      const quant = pool.quant!;
      let rows = 0;
      for (let i = 3; i < 7; i++) {
        const { slab, page } = decodePageEntry(seq.pages[i]);
        const words = await readUint32(gpu, pool.slabBindings()[slab], quant.pageWords, page * quant.pageWords);
        const source = contents.get(before[i])!;
        for (let layer = 0; layer < pool.layers; layer++) {
          for (const kv of [0, 1] as const) {
            const { format, rowWords } = quant.rows(layer, kv);
            for (let t = 0; t < pool.pageTokens; t++) {
              const offset = quant.layerOffsetWords(layer, kv) + t * rowWords;
              const expected = quantizeRow(f16Row(pool, source, layer, kv, t), format);
              expect([...words.slice(offset, offset + rowWords)]).toEqual([...expected]);
              rows++;
            }
          }
        }
      }
      expect(rows).toBe(4 * pool.layers * 2 * pool.pageTokens);
      // The sequence goes on: a rewrite inside a flushed page promotes it; the step after demotes as usual.
      pool.writeStep(seq, 18, 1);
      expect(decodePageEntry(seq.pages[4]).kind).toBe(KV_PAGE_KIND.f16);
      expect(pool.promotions).toBe(1);
      for (let n = 0; n < 12; n++) pool.writeStep(seq, seq.length, 1);
      expect(pool.audit()).toEqual([]);
      pool.free(shared);
      pool.free(seq);
      // Nothing in use: every slab (and the copy bounce buffer) can go back.
      expect(pool.releaseFreeSlabs()).toBeGreaterThan(0);
      expect(pool.stats()).toMatchObject({ slabs: 0, pagesReserved: 0, pagesUsed: 0 });
      expect(pool.audit()).toEqual([]);
      // ... and come back when needed.
      const again = pool.createSequence();
      runRequest(pool, again, 0, 40, 3);
      expect(pool.audit()).toEqual([]);
      expect(pool.stats().quant.pagesUsed).toBeGreaterThan(0);
    } finally {
      pool.destroy();
    }
    const after = gpu.allocator.snapshot();
    expect(after.totalBuffers).toBe(baseline.totalBuffers);
    expect(after.bytes.kv).toBe(baseline.bytes.kv);
  });

  it('releaseFreeSlabs returns only trailing slabs none of whose pages is in use', () => {
    const pool = int2Pool({ maxSlabBytes: 3 * 2 * 2 * 2 * 4 * 8 * 2 }); // 3 f16 pages per slab
    try {
      const a = pool.createSequence();
      const b = pool.createSequence();
      pool.writeStep(a, 0, 12); // 3 pages: slab 0
      pool.writeStep(b, 0, 12); // slab 1
      expect(pool.stats().f16.slabs).toBe(2);
      pool.free(a);
      expect(pool.releaseFreeSlabs()).toBe(0); // slab 0 is free but slab 1 is not: ids are positional
      expect(pool.stats().f16.slabs).toBe(2);
      pool.free(b);
      expect(pool.releaseFreeSlabs()).toBeGreaterThan(0);
      expect(pool.stats().f16).toMatchObject({ slabs: 0, pagesReserved: 0 });
      const c = pool.createSequence();
      pool.writeStep(c, 0, 16);
      expect(pool.stats().f16).toMatchObject({ slabs: 2, pagesUsed: 4 });
      expect(pool.audit()).toEqual([]);
    } finally {
      pool.destroy();
    }
  });

  it('pagesNeeded bounds what a run takes of each kind: with exactly that much left, it runs as with plenty', async () => {
    const f16PageBytes = 2 * 2 * 2 * 4 * 8 * 2;
    const quantPageBytes = 2 * 4 * (2 + 3) * 4;
    let demoting = 0;
    let resumedFlushed = 0;
    await fc.assert(
      fc.asyncProperty(
        fc.record({
          sink: fc.constantFrom(0, 4, 8),
          window: fc.constantFrom(0, 4, 8, 16),
          step: fc.constantFrom(1, 4, 6, 8, 12),
          // The sequence's history: requests (reuse fraction, prompt, decode steps).
          history: fc.array(fc.tuple(fc.double({ min: 0, max: 1, noNaN: true }), fc.nat(50), fc.nat(12)), {
            maxLength: 4,
          }),
          // Often a follow-up on all it holds: a flushed sequence resumed with a long prompt is where the bound is tight.
          reuse: fc.oneof(fc.constant(1), fc.double({ min: 0, max: 1, noNaN: true })),
          prompt: fc.integer({ min: 1, max: 70 }),
          decode: fc.nat(20),
          flushFirst: fc.boolean(),
        }),
        async ({ sink, window, step, history, reuse: fraction, prompt, decode, flushFirst }) => {
          // Two pools run the same requests; the second is left exactly what pagesNeeded asks for.
          const options = {
            sink,
            window,
            maxStepTokens: step,
            f16BudgetBytes: 64 * f16PageBytes,
            budgetBytes: 64 * f16PageBytes + 160 * quantPageBytes,
            maxSequences: 4,
          };
          const pools = [int2Pool(options), int2Pool(options)];
          try {
            const [plenty, tight] = pools.map((pool) => {
              const seq = pool.createSequence();
              for (const [reuse, prompt, decode] of history) {
                const start = Math.floor(seq.length * reuse);
                runRequest(pool, seq, start, start + prompt + 1, decode);
              }
              if (flushFirst) pool.flush(seq);
              return seq;
            });
            const pool = pools[1];
            const reuse = Math.floor(tight.length * fraction);
            const end = reuse + prompt + decode;
            const need = pool.pagesNeeded(tight, reuse, end);
            // Fillers take the rest: a quant one (decode-size steps demote it, a flush ends it), then an f16 one (one
            // step from position 0 demotes nothing).
            const quantTake = pool.pagesObtainable().quant - need.quant;
            const quantFiller = pool.createSequence();
            while (quantFiller.length < (pool.sinkPages + quantTake) * pool.pageTokens) {
              pool.writeStep(quantFiller, quantFiller.length, pool.pageTokens);
            }
            pool.flush(quantFiller);
            const f16Take = pool.pagesObtainable().f16 - need.f16;
            if (f16Take > 0) pool.writeStep(pool.createSequence(), 0, f16Take * pool.pageTokens);
            expect(pool.pagesObtainable()).toEqual(need);
            const demotions = pool.demotions;
            const expected: number[][] = [];
            runRequest(pools[0], plenty, reuse, reuse + prompt, decode, () => expected.push(kinds(plenty)));
            let steps = 0;
            try {
              // Same pages of each kind after every step: no overflow, no demotion held back for want of quant pages.
              runRequest(pool, tight, reuse, reuse + prompt, decode, () =>
                expect(kinds(tight)).toEqual(expected[steps++]),
              );
            } catch (error) {
              if (!(error instanceof ContextOverflowError)) throw error;
              throw new Error(`step ${steps} of ${reuse}..${end} overflowed with ${JSON.stringify(need)} left`);
            }
            expect(tight.length).toBe(end);
            expect(pool.audit()).toEqual([]);
            if (pool.demotions > demotions) demoting++;
            if (flushFirst && pool.flushed > 0 && fraction === 1) resumedFlushed++;
          } finally {
            for (const p of pools) p.destroy();
          }
        },
      ),
      { numRuns: 150, seed: 20261209 },
    );
    expect(demoting).toBeGreaterThan(50);
    expect(resumedFlushed).toBeGreaterThan(10);
  });
});
