import { describe, expect, it } from 'vitest';
import { ContextOverflowError, InvalidRequestError } from '../../core/errors.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { quantPoolOptions, SMALL_PAGE_BYTES, smallPoolOptions } from '../../test/kv-pool-options.ts';
import { decodePageEntry, defaultQuantF16Bytes, KV_PAGE_KIND, KvPagePool } from './pool.ts';

const ctx = withTestGpu();

const PAGE_BYTES = SMALL_PAGE_BYTES;

function smallPool(budgetPages: number, slabPages = 5, maxSequences = 4): KvPagePool {
  return new KvPagePool(ctx.gpu, smallPoolOptions(budgetPages, slabPages, maxSequences));
}

function quantPool(f16Pages: number, quantPages: number, maxStepTokens?: number): KvPagePool {
  return new KvPagePool(ctx.gpu, quantPoolOptions(f16Pages, quantPages, maxStepTokens));
}

// Llama-3.2-1B's cache shape: 16 layers, 8 KV heads x 64 (rows of 512); an f16 page of 16 tokens is 512 KiB.
const LLAMA_CACHE = { layers: 16, kvHeads: 8, headDim: 64 } as const;

describe('KvPagePool', () => {
  it("quant mode: the first decode step after a prompt demotes all of its last chunk's pages that left the window", () => {
    // Pages of 4 tokens, sink 4, window 4, steps of up to 32 tokens: a step carries up to 32 / 4 + 1 = 9 demotions.
    const pool = quantPool(12, 10, 32);
    try {
      expect(pool.maxStepDemotions).toBe(9);
      const seq = pool.createSequence();
      pool.writeStep(seq, 0, 32);
      expect(pool.stepDemotions).toBe(0);
      // At position 32, pages 1..6 (positions 4..27) are older than the window: all demoted now, not 2 a step.
      pool.writeStep(seq, 32, 1);
      expect(pool.stepDemotions).toBe(6);
      expect(seq.pages.map((e) => decodePageEntry(e).kind)).toEqual([0, 1, 1, 1, 1, 1, 1, 0, 0]);
      pool.writeStep(seq, 33, 1);
      expect(pool.stepDemotions).toBe(0);
      expect(pool.audit()).toEqual([]);
    } finally {
      pool.destroy();
    }
  });

  it('quant mode: steps of 2048 tokens demote all the pages each makes due (more than a flush batch of 64)', () => {
    // The default sink (64) and window (256), 16-token pages.
    const pool = new KvPagePool(ctx.gpu, { ...LLAMA_CACHE, budgetBytes: 1 << 30, kv: 'quant', maxStepTokens: 2048 });
    try {
      expect(pool.maxStepDemotions).toBe(129);
      const seq = pool.createSequence();
      const demoted: number[] = [];
      for (let position = 0; position < 8192; position += 2048) {
        pool.writeStep(seq, position, 2048);
        demoted.push(pool.stepDemotions);
      }
      // Due at position p: pages 4 .. (p - 256) / 16 - 1. Each step after the second makes 128 more due.
      expect(demoted).toEqual([0, 108, 128, 128]);
      expect(pool.audit()).toEqual([]);
    } finally {
      pool.destroy();
    }
  });

  it('quant mode: a long sequence ends up quantized but for sink and window, then overflows with a typed error', () => {
    const pool = quantPool(8, 10);
    try {
      const seq = pool.createSequence();
      // sink 4 (1 page), window 4: at length L the f16 pages are the sink, the window and the step's pages.
      // stepDemotions says which steps demote (their forward's demotion dispatches run; the others skip them).
      let demotingSteps = 0;
      for (let n = 0; n < 40; n++) {
        const before = pool.demotions;
        pool.writeStep(seq, seq.length, 1);
        expect(pool.stepDemotions).toBe(pool.demotions - before);
        if (pool.stepDemotions > 0) demotingSteps++;
      }
      expect(demotingSteps).toBe(7);
      const kinds = seq.pages.map((e) => decodePageEntry(e).kind);
      expect(kinds).toEqual([0, 1, 1, 1, 1, 1, 1, 1, 0, 0]);
      expect(pool.audit()).toEqual([]);
      // 10 quant pages + sink + window + 2: the pool holds far more than its 8 f16 pages alone.
      let error: unknown;
      try {
        for (;;) pool.writeStep(seq, seq.length, 3);
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(ContextOverflowError);
      const overflow = error as ContextOverflowError;
      expect(overflow.tokensNeeded).toBe(seq.length + 3);
      expect(overflow.tokensAvailable).toBeLessThan(overflow.tokensNeeded);
      expect(seq.length).toBeGreaterThan(8 * 4);
      expect(pool.audit()).toEqual([]);
      expect(() => pool.reserve(seq, 10_000)).toThrow(ContextOverflowError);
      // A rollback into the quantized region promotes the page it rewrites.
      pool.truncate(seq, 10);
      pool.writeStep(seq, 10, 1);
      expect(decodePageEntry(seq.pages[2]).kind).toBe(KV_PAGE_KIND.f16);
      expect(pool.promotions).toBe(1);
      expect(pool.audit()).toEqual([]);
    } finally {
      pool.destroy();
    }
  });

  it('quant mode at a Llama-3.2-1B shape: effective bits per element from the pool stats', () => {
    // 16 layers, 8 KV heads x 64 (rows of 512), 2-bit, group 128, sink 64, window 256; prefill in chunks of 128.
    const pool = new KvPagePool(ctx.gpu, { ...LLAMA_CACHE, kv: 'quant', budgetBytes: 200 << 20 });
    try {
      const width = 8 * 64;
      const seq = pool.createSequence();
      const report: string[] = [];
      for (const target of [1024, 8192, 32768]) {
        while (seq.length < target) pool.writeStep(seq, seq.length, Math.min(128, target - seq.length));
        pool.writeStep(seq, seq.length, 1); // the next decode step demotes what the last chunk pushed out
        const s = pool.stats();
        const bits = (8 * s.bytesUsed) / (seq.length * pool.layers * 2 * width);
        report.push(`${seq.length}: ${bits.toFixed(3)} (f16 pages ${s.f16.pagesUsed}, quant ${s.quant.pagesUsed})`);
        if (target === 32768) expect(bits).toBeLessThan(2.45);
      }
      expect(pool.audit()).toEqual([]);
      console.log(`effective bits per element, Llama-3.2-1B shape: ${report.join('; ')}`);
    } finally {
      pool.destroy();
    }
  });

  it('quant mode with boosted layers: their rows are 4-bit and unclipped, the page holds each layer at its width', () => {
    // 3 layers, rows of 16 values, pages of 4 tokens: 2-bit group 16 = 1 + 1 words a row, 4-bit = 2 + 1.
    const make = (boostLayers?: number[]) =>
      new KvPagePool(ctx.gpu, {
        layers: 3,
        kvHeads: 2,
        headDim: 8,
        pageTokens: 4,
        kv: 'quant',
        keyFormat: { groupSize: 16, clipQuantile: 0.96 },
        valueFormat: { groupSize: 16, clipQuantile: 0.94 },
        budgetBytes: 64 << 10,
        ...(boostLayers ? { boostLayers } : {}),
      });
    const plain = make();
    const boosted = make([2, 1]);
    try {
      const q = boosted.quant!;
      expect(q.boostLayers).toEqual([1, 2]);
      expect(q.rows(0, 0)).toEqual({
        format: { width: 16, bits: 2, groupSize: 16, clipQuantile: 0.96 },
        rowWords: 2,
        codeWords: 1,
      });
      expect(q.rows(0, 1).format.clipQuantile).toBe(0.94);
      for (const kv of [0, 1] as const) {
        expect(q.rows(1, kv)).toEqual({
          format: { width: 16, bits: 4, groupSize: 16, clipQuantile: 1 },
          rowWords: 3,
          codeWords: 2,
        });
      }
      // Layer 0: K at 0, V at 4 tokens x 2 words; layer 1 starts after 16 words, its V after 4 x 3 words.
      expect([0, 1, 2].flatMap((l) => [q.layerOffsetWords(l, 0), q.layerOffsetWords(l, 1)])).toEqual([
        0, 8, 16, 28, 40, 52,
      ]);
      expect(q.pageWords).toBe(64);
      expect(plain.quant!.pageWords).toBe(48);
      expect(() => make([3])).toThrow(InvalidRequestError);
      expect(() => make([-1])).toThrow(/names -1, not a layer of this model \(0\.\.2\)/);
      expect(() => make([1, 1])).toThrow(/lists a layer twice/);
      // biome-ignore lint/suspicious/noSparseArray: a hole is what a careless caller may pass
      expect(() => make([, 1] as number[])).toThrow(/names undefined/);
    } finally {
      plain.destroy();
      boosted.destroy();
    }
  });

  it('throws ContextOverflowError with the tokens needed and available instead of truncating', () => {
    const pool = smallPool(6, 2);
    try {
      const a = pool.createSequence();
      pool.writeStep(a, 0, 10); // 3 pages of 4
      const b = pool.createSequence();
      let error: unknown;
      try {
        pool.writeStep(b, 0, 13); // 4 pages, 3 left
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(ContextOverflowError);
      expect((error as ContextOverflowError).tokensNeeded).toBe(13);
      expect((error as ContextOverflowError).tokensAvailable).toBe(12);
      expect(b.length).toBe(0);
      expect(b.pages).toEqual([]);
      pool.writeStep(b, 0, 12);
      expect(pool.stats()).toMatchObject({ pagesUsed: 6, pagesFree: 0, pagesReserved: 6, slabs: 3, tokensHeld: 22 });
      expect(() => pool.fork(a)).toThrow(ContextOverflowError); // a's partial last page needs a copy
      pool.truncate(a, 8);
      const c = pool.fork(a); // full pages only: shared, nothing allocated
      expect(pool.stats().pagesUsed).toBe(5);
      expect(() => pool.writeStep(c, 6, 1)).not.toThrow(); // copy-on-write takes the one free page
      expect(() => pool.writeStep(a, 8, 1)).toThrow(ContextOverflowError);
      expect(pool.audit()).toEqual([]);
    } finally {
      pool.destroy();
    }
  });

  it('grows by slabs only when pages are needed and reports bytes by category', () => {
    const { gpu } = ctx;
    const kvBefore = gpu.allocator.snapshot().bytes.kv;
    const pool = smallPool(20, 5);
    const fixed = gpu.allocator.snapshot().bytes.kv - kvBefore;
    expect(pool.stats().slabs).toBe(0);
    const seq = pool.createSequence();
    pool.reserve(seq, 21); // 6 pages: two slabs of 5
    expect(pool.stats()).toMatchObject({ slabs: 2, pagesReserved: 10, pagesUsed: 6, bytesReserved: 10 * PAGE_BYTES });
    expect(gpu.allocator.snapshot().bytes.kv - kvBefore - fixed).toBe(10 * PAGE_BYTES);
    expect(pool.generation).toBe(2);
    pool.truncate(seq, 0);
    pool.reserve(seq, 20);
    expect(pool.stats().slabs).toBe(2); // freed pages are reused before growing
    pool.destroy();
    expect(gpu.allocator.snapshot().bytes.kv).toBe(kvBefore);
  });
});

describe("KvPagePool.holdsStep: whether a 2-bit pool's default f16 share holds prefill steps of a size", () => {
  it('a 64 MiB 2-bit budget holds 128-token steps, not 512 (the f16 share is capped at half the budget)', () => {
    const options = { ...LLAMA_CACHE, budgetBytes: 64 << 20, kv: 'quant' as const };
    // Sink 4 + window 18 pages for 2 sequences, plus 2 steps and 2: 62 pages (31 MiB) at 128, 110 (55 MiB) at 512.
    expect(defaultQuantF16Bytes({ ...options, maxStepTokens: 128 })).toBe(62 * 512 * 1024);
    expect(KvPagePool.holdsStep(options, 128)).toBe(true);
    expect(KvPagePool.holdsStep(options, 512)).toBe(false);
    // The pool itself grants that share: its f16 pages at 128-token steps.
    const pool = new KvPagePool(ctx.gpu, { ...options, maxStepTokens: 128 });
    try {
      expect(pool.pagesObtainable().f16).toBe(62);
    } finally {
      pool.destroy();
    }
  });

  it('a large 2-bit budget, an f16 pool or an explicit f16 share hold any step', () => {
    expect(KvPagePool.holdsStep({ ...LLAMA_CACHE, budgetBytes: 1 << 30, kv: 'quant' }, 512)).toBe(true);
    expect(KvPagePool.holdsStep({ ...LLAMA_CACHE, budgetBytes: 64 << 20, kv: 'f16' }, 512)).toBe(true);
    expect(
      KvPagePool.holdsStep({ ...LLAMA_CACHE, budgetBytes: 64 << 20, kv: 'quant', f16BudgetBytes: 8 << 20 }, 512),
    ).toBe(true);
  });
});
