/**
 * The paged cache's bookkeeping as one object, with no GPU in it: the page book (runtime/kv/page-book.ts) and the
 * tiering of its positions (runtime/kv/tiering.ts), for the geometry the pool options give. Every operation of the
 * pool that decides pages happens here (a step's pages, copy-on-write, promotions, demotions, flushes, capacity);
 * KvPagePool (runtime/kv/pool.ts) adds the GPU storage and writes what the bookkeeping decided. The property tests
 * run it without a device (runtime/kv/page-ledger.test.ts).
 */
import { InvalidRequestError } from '../../core/errors.ts';
import {
  ENTRY_PAGE_MASK,
  KV_PAGE_KIND,
  type KvKindStats,
  KvPageBook,
  type KvSequence,
  type PageBookEvents,
  type PageStore,
  type PageStoreGeometry,
} from './page-book.ts';
import type { KvPrecisionPlan } from './precision-plan.ts';
import { type KvQuantPageLayout, type KvRowFormatOptions, quantPageLayout } from './quant-layout.ts';
import { F16Tiering, type KvPageCounts, type KvPoolMode, type KvTiering, QuantTiering } from './tiering.ts';

/** Slab slots the kernels bind: f16 pages take all of them in f16 mode, half of them in quant mode. */
export const MAX_KV_SLABS = 4;

/** Pages one `flush` batch demotes at most (one demotion dispatch per layer a batch). */
export const FLUSH_BATCH_PAGES = 64;

export interface KvPoolOptions {
  layers: number;
  kvHeads: number;
  /** Even (two f16 per u32). */
  headDim: number;
  /** Positions per page (default 16). */
  pageTokens?: number;
  /** Upper bound on page memory (slabs); the page table and step uniform come on top (small). */
  budgetBytes: number;
  /** Live sequences at once (default 8): each owns a fixed slice of the page table. */
  maxSequences?: number;
  /** Longest sequence (default: the whole budget). Sizes each sequence's page-table slice. */
  maxSequenceTokens?: number;
  /** Caps a slab below maxStorageBufferBindingSize (tests use it to exercise several slabs). */
  maxSlabBytes?: number;
  /** 'f16' (default): every page f16. 'quant': an f16 sink and window, quantized pages for the rest. */
  kv?: KvPoolMode;
  /** quant: positions kept f16 at the start of each sequence, rounded up to whole pages (default 64). */
  sink?: number;
  /** quant: recent positions kept f16 (default 256). */
  window?: number;
  /** quant: K row format (default 2 bits, groupSize min(128, width), clipQuantile 1). */
  keyFormat?: KvRowFormatOptions;
  /** quant: V row format (same defaults). */
  valueFormat?: KvRowFormatOptions;
  /** quant: layers whose K and V rows are 4-bit, in the K format's groups, unclipped (default none). */
  boostLayers?: readonly number[];
  /** quant: per layer K and V code bits and clip (runtime/kv/precision-plan.ts); replaces the formats' bits and clip. */
  plan?: KvPrecisionPlan;
  /** quant: bytes of the budget for f16 pages (see the doc comment for the default). */
  f16BudgetBytes?: number;
  /**
   * quant: most positions one step writes (the prefill chunk); sizes the default f16 budget and the demotions every
   * step may carry (maxStepDemotions).
   */
  maxStepTokens?: number;
}

/**
 * The pool's counts: the KvKindStats fields are totals over both kinds (pageBytes is an f16 page's), the kinds' own
 * counts are under `f16` and `quant` (quant's are zero in f16 mode).
 */
export interface KvPoolStats extends KvKindStats {
  pageTokens: number;
  bytesReserved: number;
  /** Sum of the live sequences' lengths (shared pages counted once per sequence). */
  tokensHeld: number;
  sequences: number;
  mode: KvPoolMode;
  f16: KvKindStats;
  quant: KvKindStats;
}

/** Positions per page where the pool's options name none. */
export const DEFAULT_PAGE_TOKENS = 16;

/**
 * The f16 share of a 'quant' pool unless f16BudgetBytes is given: the sink and window pages of up to two live
 * sequences, plus a step's new pages and the pages it demotes (which return to the free list only at the next step).
 */
export function defaultQuantF16Bytes(options: KvPoolOptions): number {
  const pageTokens = options.pageTokens ?? DEFAULT_PAGE_TOKENS;
  const pageBytes = options.layers * 2 * options.kvHeads * pageTokens * options.headDim * 2;
  const sinkPages = Math.ceil((options.sink ?? 64) / pageTokens);
  const windowPages = Math.ceil((options.window ?? 256) / pageTokens) + 2;
  const sequencesWithF16 = Math.min(2, options.maxSequences ?? 2);
  const stepPages = Math.ceil((options.maxStepTokens ?? 512) / pageTokens);
  return (sequencesWithF16 * (sinkPages + windowPages) + 2 * stepPages + 2) * pageBytes;
}

/** Most demotions a step of up to `maxStepTokens` carries: as many as the largest step makes due. */
export function maxStepDemotionsOf(maxStepTokens: number, pageTokens: number): number {
  return Math.ceil(maxStepTokens / pageTokens) + 1;
}

/** The page geometry of a pool: how many pages of each kind, in how many slabs, and the quant layout. */
export interface KvPoolGeometry {
  pageTokens: number;
  /** Words of an f16 page. */
  pageWords: number;
  maxStepTokens: number;
  maxSequences: number;
  maxSequenceTokens?: number;
  f16: PageStoreGeometry;
  quant: (PageStoreGeometry & { layout: KvQuantPageLayout }) | null;
  sinkPages: number;
  window: number;
}

/**
 * The geometry `options` give on a device whose bindings hold `slabLimit` bytes: the one place the options'
 * shape, budget and formats are checked (each throws InvalidRequestError naming what to change). Pure.
 */
export function kvPoolGeometry(options: KvPoolOptions, bindingBytes: number): KvPoolGeometry {
  const { layers, kvHeads, headDim, budgetBytes } = options;
  const pageTokens = options.pageTokens ?? DEFAULT_PAGE_TOKENS;
  const maxStepTokens = options.maxStepTokens ?? 512;
  for (const [name, value] of Object.entries({ layers, kvHeads, headDim, pageTokens, maxStepTokens })) {
    if (!Number.isInteger(value) || value < 1) throw new InvalidRequestError(`KV pool: ${name} must be >= 1`);
  }
  if (headDim % 2 !== 0) throw new InvalidRequestError(`KV pool: headDim ${headDim} must be even (f16 pairs)`);
  const mode = options.kv ?? 'f16';
  if (mode !== 'f16' && mode !== 'quant') {
    throw new InvalidRequestError(`KV pool: kv must be 'f16' or 'quant', got ${String(mode)}`);
  }
  const sink = options.sink ?? 64;
  const window = options.window ?? 256;
  for (const [name, value] of Object.entries({ sink, window })) {
    if (!Number.isInteger(value) || value < 0) throw new InvalidRequestError(`KV pool: ${name} must be >= 0`);
  }
  const pageWords = (layers * 2 * kvHeads * pageTokens * headDim) / 2;
  const pageBytes = pageWords * 4;
  const slabLimit = Math.min(bindingBytes, options.maxSlabBytes ?? Number.POSITIVE_INFINITY);
  const tooBig = (bytes: number, budget: number, what: string) =>
    new InvalidRequestError(
      `KV pool: one ${what} page is ${bytes} bytes (${pageTokens} tokens x ${layers} layers), more than ` +
        `${budget < bytes ? `the KV budget of ${budget} bytes` : `a GPU buffer binding (${slabLimit} bytes)`}. ` +
        'Raise kvBudgetBytes or use fewer pageTokens.',
      { pageBytes: bytes, budgetBytes, slabLimit },
    );
  const store = (kind: number, bytes: number, budget: number, firstSlot: number, slabs: number): PageStoreGeometry => {
    const perSlabLimit = Math.min(Math.floor(slabLimit / bytes), ENTRY_PAGE_MASK + 1);
    const budgetPages = Math.floor(budget / bytes);
    if (perSlabLimit < 1 || budgetPages < 1) throw tooBig(bytes, budget, kind === KV_PAGE_KIND.f16 ? 'f16' : 'quant');
    const maxPages = Math.min(budgetPages, slabs * perSlabLimit);
    const pagesPerSlab = Math.min(perSlabLimit, Math.ceil(maxPages / slabs));
    return { kind, pageBytes: bytes, pagesPerSlab, maxPages, firstSlot, maxSlabs: slabs };
  };
  const common = {
    pageTokens,
    pageWords,
    maxStepTokens,
    maxSequences: options.maxSequences ?? 8,
    maxSequenceTokens: options.maxSequenceTokens,
    window,
  };
  if (mode === 'f16') {
    return {
      ...common,
      f16: store(KV_PAGE_KIND.f16, pageBytes, budgetBytes, 0, MAX_KV_SLABS),
      quant: null,
      sinkPages: 0,
    };
  }
  const layout = quantPageLayout({ ...options, pageTokens });
  const f16Budget = Math.min(
    options.f16BudgetBytes ?? Math.min(defaultQuantF16Bytes(options), Math.floor(budgetBytes / 2)),
    budgetBytes - layout.pageWords * 4,
  );
  const f16 = store(KV_PAGE_KIND.f16, pageBytes, f16Budget, 0, MAX_KV_SLABS / 2);
  const quant = store(
    KV_PAGE_KIND.quant,
    layout.pageWords * 4,
    budgetBytes - f16.maxPages * pageBytes,
    MAX_KV_SLABS / 2,
    MAX_KV_SLABS / 2,
  );
  return { ...common, f16, quant: { ...quant, layout }, sinkPages: Math.ceil(sink / pageTokens) };
}

/** The tiering of a book's positions for a geometry: the mode as a type. */
export function kvTiering(book: KvPageBook, geometry: KvPoolGeometry): KvTiering {
  if (!geometry.quant) return new F16Tiering(book, geometry.window);
  const maxDemotions = maxStepDemotionsOf(geometry.maxStepTokens, geometry.pageTokens);
  return new QuantTiering(book, geometry.sinkPages, geometry.window, geometry.maxStepTokens, maxDemotions);
}

/** A step's demotion: the f16 page that left the window and the quant page its rows go to. */
export type KvDemotion = readonly [f16Entry: number, quantEntry: number];

const NO_DEMOTIONS: readonly KvDemotion[] = [];

/** The quant counts of an f16 pool. */
const NO_QUANT_PAGES: KvKindStats = {
  pageBytes: 0,
  pagesUsed: 0,
  pagesFree: 0,
  pagesReserved: 0,
  pagesBudget: 0,
  bytesUsed: 0,
  slabs: 0,
};

export class KvPageLedger {
  readonly book: KvPageBook;
  readonly tiering: KvTiering;
  readonly geometry: KvPoolGeometry;
  /** Most demotions a step carries, whatever its size: as many as the largest step makes due. */
  readonly maxStepDemotions: number;

  constructor(geometry: KvPoolGeometry, events: PageBookEvents) {
    this.geometry = geometry;
    this.book = new KvPageBook(geometry, events);
    this.tiering = kvTiering(this.book, geometry);
    this.maxStepDemotions = maxStepDemotionsOf(geometry.maxStepTokens, geometry.pageTokens);
  }

  get pageTokens(): number {
    return this.book.pageTokens;
  }

  /** The most tokens one more sequence could hold now (free pages plus unallocated budget). */
  get tokensAvailable(): number {
    return this.tiering.longestFor(0, 0);
  }

  createSequence(): KvSequence {
    return this.book.createSequence();
  }

  fork(parent: KvSequence): KvSequence {
    return this.book.fork(parent, () => this.tokensAvailable);
  }

  free(seq: KvSequence): void {
    this.book.free(seq);
  }

  reserve(seq: KvSequence, newLength: number): void {
    this.book.assertAlive(seq);
    this.tiering.reserve(seq, newLength);
  }

  truncate(seq: KvSequence, length: number): void {
    this.book.truncate(seq, length);
  }

  /**
   * The bookkeeping of a step that writes `tokens` positions of `seq` from `position` (<= seq.length; a smaller
   * position rewrites, as after a rollback): frees the last step's retiring pages, checks capacity (throwing
   * ContextOverflowError before changing anything), replaces the pages it would write but may not (copy-on-write,
   * promotion), takes its new pages, demotes the pages that left the window, and sets `seq.length`. Returns the
   * demotions the step's forward must carry.
   */
  planStep(seq: KvSequence, position: number, tokens: number): readonly KvDemotion[] {
    const { book } = this;
    book.assertAlive(seq);
    if (!Number.isInteger(position) || position < 0 || position > seq.length) {
      throw new InvalidRequestError(`KV step: position ${position} must be within 0..${seq.length} (no gaps)`);
    }
    if (!Number.isInteger(tokens) || tokens < 1)
      throw new InvalidRequestError(`KV step: tokens ${tokens} must be >= 1`);
    // The previous submit, which read the retiring pages, precedes anything this step submits.
    book.settleRetiring();
    const end = position + tokens;
    const first = Math.floor(position / book.pageTokens);
    const last = Math.ceil(end / book.pageTokens);
    // Pages this step writes that it must replace: shared ones (copy-on-write) and quant ones (promotion).
    let f16Needed = Math.max(0, last - seq.pages.length);
    let rewrite = false;
    for (let i = first; i < Math.min(last, seq.pages.length); i++) {
      if (book.storeOf(seq.pages[i]) !== book.f16 || book.isShared(seq.pages[i])) {
        f16Needed++;
        rewrite = true;
      }
    }
    if (last > book.maxPagesPerSequence || f16Needed > book.f16.available()) {
      this.tiering.checkStep(seq, end, f16Needed, first);
    }
    const demote = this.tiering.pagesToDemote(seq, position);
    if (rewrite) book.rewritePages(seq, first, Math.min(last, seq.pages.length));
    book.appendF16Pages(seq, last - seq.pages.length);
    const demotions = this.demote(seq, demote, true);
    seq.length = end;
    return demotions;
  }

  /**
   * quant mode: demotes up to `maxPages` of an IDLE sequence's full, unshared f16 pages past its sink (oldest first)
   * and frees the f16 pages at once (the demotion that reads them is recorded before anything that reuses them).
   * Returns the demotions in batches of at most `batchPages`.
   */
  flush(seq: KvSequence, maxPages: number, batchPages: number): (readonly KvDemotion[])[] {
    this.book.assertAlive(seq);
    const quant = this.book.quant;
    if (!quant) return [];
    const indices = this.tiering.flushCandidates(seq, Math.min(maxPages, quant.available()));
    const batches: (readonly KvDemotion[])[] = [];
    for (let from = 0; from < indices.length; from += batchPages) {
      batches.push(this.demote(seq, indices.slice(from, from + batchPages), false));
    }
    return batches;
  }

  pagesNeeded(seq: KvSequence | null, position: number, newLength: number): KvPageCounts {
    if (seq) this.book.assertAlive(seq);
    if (!Number.isInteger(position) || !Number.isInteger(newLength) || position < 0 || newLength < position) {
      throw new InvalidRequestError(`KV pages needed: positions ${position}..${newLength} are not a range`);
    }
    return this.tiering.pagesNeeded(seq, position, newLength);
  }

  /** Pages of each kind obtainable now: free ones, retiring ones (free at the next step) and unallocated budget. */
  pagesObtainable(): KvPageCounts {
    const of = (store: PageStore | null) => (store ? store.available() + store.retiring.length : 0);
    return { f16: of(this.book.f16), quant: of(this.book.quant) };
  }

  flushablePages(seq: KvSequence): number {
    this.book.assertAlive(seq);
    return this.tiering.flushCandidates(seq, Number.POSITIVE_INFINITY).length;
  }

  stats(): KvPoolStats {
    const { book } = this;
    let tokensHeld = 0;
    for (const s of book.liveSequences()) tokensHeld += s.length;
    const f = book.f16.stats();
    const q = book.quant?.stats() ?? NO_QUANT_PAGES;
    return {
      pageTokens: book.pageTokens,
      pageBytes: book.f16.pageBytes,
      pagesUsed: f.pagesUsed + q.pagesUsed,
      pagesFree: f.pagesFree + q.pagesFree,
      pagesReserved: f.pagesReserved + q.pagesReserved,
      pagesBudget: f.pagesBudget + q.pagesBudget,
      bytesUsed: f.bytesUsed + q.bytesUsed,
      bytesReserved: f.pagesReserved * f.pageBytes + q.pagesReserved * q.pageBytes,
      tokensHeld,
      sequences: book.sequenceCount,
      slabs: f.slabs + q.slabs,
      mode: this.tiering.mode,
      f16: f,
      quant: q,
    };
  }

  audit(): string[] {
    return this.book.audit(this.tiering.sinkPages);
  }

  /** Switches `seq.pages[i]` for each index to a new quant page; the f16 pages retire (`retire`) or free at once. */
  private demote(seq: KvSequence, indices: readonly number[], retire: boolean): readonly KvDemotion[] {
    // A decode step demotes nothing on most tokens: no allocation for it.
    if (indices.length === 0) return NO_DEMOTIONS;
    const { book } = this;
    const out: KvDemotion[] = [];
    for (const i of indices) {
      const source = seq.pages[i];
      const target = book.allocatePage(book.quant as PageStore);
      out.push([source, target]);
      seq.pages[i] = target;
      book.releasePage(source, retire);
    }
    book.tableEntriesChanged(seq, indices);
    return out;
  }
}
