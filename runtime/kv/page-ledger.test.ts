/**
 * The pool's bookkeeping under random operations, with no GPU: the ledger (runtime/kv/page-ledger.ts) with a CPU
 * mirror of what it asks of GPU memory (slabs, page-table entries, copies, promotions).
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { ContextOverflowError, InvalidRequestError } from '../../core/errors.ts';
import { quantPoolOptions, smallPoolOptions } from '../../test/kv-pool-options.ts';
import { decodePageEntry, KV_PAGE_KIND, type KvSequence, type PageBookEvents, type PageStore } from './page-book.ts';
import { KvPageLedger, type KvPoolOptions, kvPoolGeometry, MAX_KV_SLABS } from './page-ledger.ts';

/** What GPU memory would hold: the page table and the slabs, as the ledger's events describe them. */
class GpuMirror implements PageBookEvents {
  readonly table = new Map<number, number>();
  readonly slabs = new Map<PageStore, number>();
  copies = 0;
  promotions = 0;

  slabAdded(store: PageStore, slab: number): void {
    expect(slab).toBe(this.slabs.get(store) ?? 0);
    this.slabs.set(store, slab + 1);
  }

  slabRemoved(store: PageStore, slab: number): void {
    expect(slab).toBe((this.slabs.get(store) ?? 0) - 1);
    this.slabs.set(store, slab);
  }

  tableChanged(seq: KvSequence, from: number, to: number): void {
    for (let i = from; i < to; i++) this.table.set(seq.tableOffset + i, seq.pages[i]);
  }

  pagesCopied(pairs: ReadonlyArray<readonly [number, number]>): void {
    for (const [src, dst] of pairs) {
      expect(decodePageEntry(src).kind).toBe(decodePageEntry(dst).kind);
      expect(src).not.toBe(dst);
    }
    this.copies += pairs.length;
  }

  pagesPromoted(pairs: ReadonlyArray<readonly [number, number]>): void {
    for (const [src, dst] of pairs) {
      expect(decodePageEntry(src).kind).toBe(KV_PAGE_KIND.quant);
      expect(decodePageEntry(dst).kind).toBe(KV_PAGE_KIND.f16);
    }
    this.promotions += pairs.length;
  }
}

/** The pool's bookkeeping surface, over a ledger (writeStep is its planStep). */
class LedgerPool {
  readonly ledger: KvPageLedger;
  readonly mirror = new GpuMirror();
  demotions = 0;

  constructor(options: KvPoolOptions, bindingBytes = 1 << 30) {
    this.ledger = new KvPageLedger(kvPoolGeometry(options, bindingBytes), this.mirror);
  }

  get mode() {
    return this.ledger.tiering.mode;
  }
  get pageTokens() {
    return this.ledger.pageTokens;
  }
  get sinkPages() {
    return this.ledger.tiering.sinkPages;
  }
  get maxSequences() {
    return this.ledger.book.maxSequences;
  }
  createSequence() {
    return this.ledger.createSequence();
  }
  reserve(seq: KvSequence, length: number) {
    this.ledger.reserve(seq, length);
  }
  writeStep(seq: KvSequence, position: number, tokens: number) {
    this.demotions += this.ledger.planStep(seq, position, tokens).length;
  }
  fork(seq: KvSequence) {
    return this.ledger.fork(seq);
  }
  truncate(seq: KvSequence, length: number) {
    this.ledger.truncate(seq, length);
  }
  free(seq: KvSequence) {
    this.ledger.free(seq);
  }
  stats() {
    return this.ledger.stats();
  }
  audit() {
    return this.ledger.audit();
  }

  /** The mirrored page table holds every live sequence's pages in its slice. */
  expectTableMatches(live: readonly KvSequence[]): void {
    for (const seq of live) {
      const table = seq.pages.map((_, i) => this.mirror.table.get(seq.tableOffset + i));
      expect(table).toEqual(seq.pages);
    }
  }
}

function smallPool(budgetPages: number, slabPages = 5, maxSequences = 4): LedgerPool {
  return new LedgerPool(smallPoolOptions(budgetPages, slabPages, maxSequences));
}

function quantPool(f16Pages: number, quantPages: number, maxStepTokens?: number): LedgerPool {
  return new LedgerPool(quantPoolOptions(f16Pages, quantPages, maxStepTokens));
}

type Op =
  | { op: 'create' }
  | { op: 'reserve'; seq: number; length: number }
  | { op: 'step'; seq: number; back: number; tokens: number }
  | { op: 'fork'; seq: number }
  | { op: 'truncate'; seq: number; keep: number }
  | { op: 'free'; seq: number };

// Weighted toward steps and forks so that writes into shared pages (copy-on-write) and overflow are common.
const opArb: fc.Arbitrary<Op> = fc.oneof(
  { weight: 2, arbitrary: fc.constant<Op>({ op: 'create' }) },
  { weight: 1, arbitrary: fc.record({ op: fc.constant('reserve' as const), seq: fc.nat(7), length: fc.nat(90) }) },
  {
    weight: 5,
    arbitrary: fc.record({
      op: fc.constant('step' as const),
      seq: fc.nat(7),
      back: fc.nat(6),
      tokens: fc.integer({ min: 1, max: 12 }),
    }),
  },
  { weight: 3, arbitrary: fc.record({ op: fc.constant('fork' as const), seq: fc.nat(7) }) },
  {
    weight: 2,
    arbitrary: fc.record({
      op: fc.constant('truncate' as const),
      seq: fc.nat(7),
      keep: fc.double({ min: 0, max: 1, noNaN: true }),
    }),
  },
  { weight: 1, arbitrary: fc.record({ op: fc.constant('free' as const), seq: fc.nat(7) }) },
);

/** How often the interesting paths ran, so a change that stops exercising them fails loudly. */
const coverage = { copyOnWrite: 0, overflow: 0, forkShared: 0, quantPages: 0 };

function owners(live: readonly KvSequence[], entry: number): number {
  let n = 0;
  for (const s of live) for (const e of s.pages) if (e === entry) n++;
  return n;
}

/** Applies one op; overflow must leave the pool exactly as it was. */
function apply(pool: LedgerPool, live: KvSequence[], op: Op): void {
  if (op.op === 'create') {
    if (live.length === pool.maxSequences) {
      expect(() => pool.createSequence()).toThrow(InvalidRequestError);
      return;
    }
    live.push(pool.createSequence());
    return;
  }
  if (live.length === 0) return;
  const index = op.seq % live.length;
  const seq = live[index];
  const before = { pages: [...seq.pages], length: seq.length, stats: pool.stats() };
  try {
    switch (op.op) {
      case 'reserve':
        pool.reserve(seq, op.length);
        // quant mode checks capacity only; writeStep takes the pages.
        if (pool.mode === 'f16')
          expect(seq.pages.length).toBeGreaterThanOrEqual(Math.ceil(op.length / pool.pageTokens));
        expect(seq.length).toBe(before.length);
        break;
      case 'step': {
        const position = Math.max(0, seq.length - op.back);
        const writesShared = seq.pages
          .slice(Math.floor(position / pool.pageTokens), Math.ceil((position + op.tokens) / pool.pageTokens))
          .some((e) => owners(live, e) > 1);
        pool.writeStep(seq, position, op.tokens);
        expect(seq.length).toBe(position + op.tokens);
        // Every page the step writes is private to this sequence (copy-on-write happened).
        const first = Math.floor(position / pool.pageTokens);
        for (let i = first; i < Math.ceil(seq.length / pool.pageTokens); i++) {
          expect(owners(live, seq.pages[i])).toBe(1);
          expect(decodePageEntry(seq.pages[i]).kind).toBe(KV_PAGE_KIND.f16);
        }
        if (pool.mode === 'quant') {
          // Pages that left the window are quantized (up to the step's demotion budget), the sink never.
          for (let i = 0; i < seq.pages.length; i++) {
            const kind = decodePageEntry(seq.pages[i]).kind;
            if (i < pool.sinkPages) expect(kind).toBe(KV_PAGE_KIND.f16);
            if (kind === KV_PAGE_KIND.quant) coverage.quantPages++;
          }
        }
        if (writesShared) coverage.copyOnWrite++;
        break;
      }
      case 'fork': {
        if (live.length === pool.maxSequences) return;
        const child = pool.fork(seq);
        expect(child.length).toBe(seq.length);
        const full = Math.floor(seq.length / pool.pageTokens);
        expect(child.pages.slice(0, full)).toEqual(seq.pages.slice(0, full));
        if (seq.length % pool.pageTokens) expect(child.pages[full]).not.toBe(seq.pages[full]);
        if (full > 0) coverage.forkShared++;
        live.push(child);
        break;
      }
      case 'truncate': {
        const length = Math.floor(seq.length * op.keep);
        pool.truncate(seq, length);
        expect(seq.length).toBe(length);
        expect(seq.pages.length).toBe(Math.ceil(length / pool.pageTokens));
        break;
      }
      case 'free':
        pool.free(seq);
        live.splice(index, 1);
        expect(() => pool.truncate(seq, 0)).toThrow(InvalidRequestError);
        break;
    }
  } catch (error) {
    if (!(error instanceof ContextOverflowError)) throw error;
    coverage.overflow++;
    expect(error.tokensNeeded).toBeGreaterThan(0);
    expect(error.tokensAvailable).toBeLessThan(error.tokensNeeded);
    expect(seq.pages).toEqual(before.pages);
    expect(seq.length).toBe(before.length);
    expect(pool.stats().pagesUsed).toBe(before.stats.pagesUsed);
  }
}

/**
 * Runs `ops` on a fresh pool, auditing after each and checking the pool's stats with `checkStats`; at the end the
 * mirrored page table must match and freeing every sequence must leave no page used. Returns what the ledger did.
 */
function runOps(
  pool: LedgerPool,
  ops: readonly Op[],
  checkStats: (stats: ReturnType<LedgerPool['stats']>, live: readonly KvSequence[]) => void,
): { copies: number; demotions: number } {
  const live: KvSequence[] = [];
  for (const op of ops) {
    apply(pool, live, op);
    expect(pool.audit()).toEqual([]);
    const stats = pool.stats();
    expect(stats.pagesUsed + stats.pagesFree).toBe(stats.pagesReserved);
    checkStats(stats, live);
  }
  pool.expectTableMatches(live);
  for (const seq of live.splice(0)) pool.free(seq);
  expect(pool.audit()).toEqual([]);
  expect(pool.stats().pagesUsed).toBe(0);
  return { copies: pool.mirror.copies, demotions: pool.demotions };
}

describe('KvPageLedger (no GPU)', () => {
  it('never leaks or double-owns a page under random create/reserve/step/fork/truncate/free', () => {
    let copies = 0;
    fc.assert(
      fc.property(fc.array(opArb, { minLength: 20, maxLength: 50 }), fc.integer({ min: 3, max: 24 }), (ops, budget) => {
        copies += runOps(smallPool(budget), ops, (stats, live) => {
          expect(stats.pagesReserved).toBeLessThanOrEqual(stats.pagesBudget);
          expect(stats.slabs).toBeLessThanOrEqual(MAX_KV_SLABS);
          expect(stats.tokensHeld).toBe(live.reduce((n, s) => n + s.length, 0));
        }).copies;
      }),
      { numRuns: 60, seed: 20261129 },
    );
    expect(coverage.copyOnWrite).toBeGreaterThan(5);
    expect(coverage.overflow).toBeGreaterThan(10);
    expect(coverage.forkShared).toBeGreaterThan(10);
    expect(copies).toBeGreaterThan(5);
  });

  it('quant mode: never leaks or double-owns a page of either kind under random ops with demotion', () => {
    let demotions = 0;
    coverage.overflow = 0;
    fc.assert(
      fc.property(
        fc.array(opArb, { minLength: 20, maxLength: 50 }),
        fc.integer({ min: 8, max: 24 }),
        fc.integer({ min: 2, max: 30 }),
        (ops, f16Pages, quantPages) => {
          demotions += runOps(quantPool(f16Pages, quantPages), ops, (stats) => {
            expect(stats.f16.pagesReserved).toBeLessThanOrEqual(stats.f16.pagesBudget);
            expect(stats.quant.pagesReserved).toBeLessThanOrEqual(stats.quant.pagesBudget);
            expect(stats.f16.slabs + stats.quant.slabs).toBeLessThanOrEqual(MAX_KV_SLABS);
          }).demotions;
        },
      ),
      { numRuns: 60, seed: 20261130 },
    );
    expect(demotions).toBeGreaterThan(20);
    expect(coverage.quantPages).toBeGreaterThan(20);
    expect(coverage.overflow).toBeGreaterThan(5);
  });

  it('a freed sequence and a restored one get their pages of each kind in increasing order (one copy per run)', () => {
    const increasing = (entries: number[]) => entries.every((e, i) => i === 0 || e > entries[i - 1]);
    // Two sequences written in turns interleave their pages; a new one after a free gets the freed pages in order.
    const plain = smallPool(40, 40);
    const a = plain.createSequence();
    const b = plain.createSequence();
    for (let position = 0; position < 64; position += 4) {
      plain.writeStep(a, position, 4);
      plain.writeStep(b, position, 4);
    }
    plain.free(b);
    const c = plain.createSequence();
    plain.writeStep(c, 0, 64);
    expect(c.pages.length).toBe(16);
    expect(increasing(c.pages)).toBe(true);
    // A restore takes pages in the free list's order (here two freed sequences', interleaved) and hands each kind
    // out sorted, the kinds where the image has them.
    const pool = quantPool(40, 40);
    const seqs = [pool.createSequence(), pool.createSequence()];
    for (let position = 0; position < 64; position += 4) for (const seq of seqs) pool.writeStep(seq, position, 4);
    for (const seq of seqs) pool.free(seq);
    const ofKind = (seq: KvSequence, kind: number) => seq.pages.filter((e) => decodePageEntry(e).kind === kind);
    const kinds = Uint8Array.from([KV_PAGE_KIND.f16, ...Array(12).fill(KV_PAGE_KIND.quant), KV_PAGE_KIND.f16]);
    const restored = pool.ledger.book.adoptPages(kinds, kinds.length * pool.pageTokens, () => 0);
    expect(Array.from(restored.pages, (e) => decodePageEntry(e).kind)).toEqual(Array.from(kinds));
    expect(increasing(ofKind(restored, KV_PAGE_KIND.f16))).toBe(true);
    expect(increasing(ofKind(restored, KV_PAGE_KIND.quant))).toBe(true);
    pool.audit();
  });
});
