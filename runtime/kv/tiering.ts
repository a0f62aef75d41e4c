/**
 * Where a sequence's positions live, as a type: `F16Tiering` keeps every page f16; `QuantTiering` keeps an f16 sink
 * and recent window and demotes the pages that leave the window to quant pages, a whole page at a time. Each answers
 * the capacity questions of its layout (does a length fit, what does a run take at its peak, how long could a
 * sequence get), so the pool asks them without a branch on the mode. Pure bookkeeping over `KvPageBook`.
 */
import { ContextOverflowError } from '../../core/errors.ts';
import type { KvPageBook, KvSequence } from './page-book.ts';

export type KvPoolMode = 'f16' | 'quant';

/** A number of pages of each kind (quant is 0 in f16 mode). */
export interface KvPageCounts {
  f16: number;
  quant: number;
}

export interface KvTiering {
  readonly mode: KvPoolMode;
  /** Whole f16 pages kept at the start of each sequence (0 in f16 mode). */
  readonly sinkPages: number;
  /** Recent positions kept f16. */
  readonly window: number;
  /**
   * Makes sure `newLength` positions of `seq` fit: f16 mode allocates the pages now; quant mode checks the final
   * layout against the pages free now (writeStep takes them step by step). Throws ContextOverflowError, before
   * changing anything, when they do not.
   */
  reserve(seq: KvSequence, newLength: number): void;
  /** Throws ContextOverflowError when a step writing up to `end` from page `first` cannot get its `f16Needed` pages. */
  checkStep(seq: KvSequence, end: number, f16Needed: number, first: number): void;
  /** Indices of `seq`'s f16 pages that leave the window at a step from `position` (oldest first, as many as it carries). */
  pagesToDemote(seq: KvSequence, position: number): readonly number[];
  /** Indices of `seq`'s full, unshared f16 pages past the sink, oldest first, at most `max` (what `flush` demotes). */
  flushCandidates(seq: KvSequence, max: number): number[];
  /** Peak pages of each kind a run of `seq` from `position` to `newLength` takes (KvPagePool.pagesNeeded). */
  pagesNeeded(seq: KvSequence | null, position: number, newLength: number): KvPageCounts;
  /** The longest a sequence holding `f16Held`/`quantHeld` pages could get with what is free now. */
  longestFor(f16Held: number, quantHeld: number): number;
}

/** What F16Tiering demotes at every step: nothing, without an allocation. */
const NO_PAGES: readonly number[] = [];

/** Pages kept and their kinds: the part of `seq` before `position` that a run from there keeps. */
function keptPages(book: KvPageBook, seq: KvSequence | null, position: number) {
  const keep = seq ? Math.min(seq.pages.length, Math.floor(Math.min(position, seq.length) / book.pageTokens)) : 0;
  let quant = 0;
  for (let i = 0; i < keep; i++) if (book.storeOf((seq as KvSequence).pages[i]) !== book.f16) quant++;
  return { keep, f16: keep - quant, quant };
}

/** Every page f16. */
export class F16Tiering implements KvTiering {
  readonly mode = 'f16' as const;
  readonly sinkPages = 0;

  constructor(
    private readonly book: KvPageBook,
    readonly window: number,
  ) {}

  reserve(seq: KvSequence, newLength: number): void {
    const needed = Math.ceil(newLength / this.book.pageTokens) - seq.pages.length;
    if (needed <= 0) return;
    this.checkStep(seq, newLength, needed, seq.pages.length);
    this.book.appendF16Pages(seq, needed);
  }

  checkStep(seq: KvSequence, end: number, f16Needed: number, first: number): void {
    const { book } = this;
    const f16 = book.f16;
    if (f16Needed <= f16.available() && Math.ceil(end / book.pageTokens) <= book.maxPagesPerSequence) return;
    // The longest this sequence could get: walk its pages, paying one free page per shared page it would write.
    let free = f16.available();
    let pages = first;
    for (; pages < seq.pages.length; pages++) {
      if (f16.refcounts[f16.globalId(seq.pages[pages])] > 1) {
        if (free === 0) break;
        free--;
      }
    }
    if (pages === seq.pages.length) pages += free;
    const available = Math.min(pages, book.maxPagesPerSequence) * book.pageTokens;
    throw new ContextOverflowError(end, available, book.limitAt(available));
  }

  pagesToDemote(): readonly number[] {
    return NO_PAGES;
  }

  flushCandidates(): number[] {
    return [];
  }

  pagesNeeded(seq: KvSequence | null, position: number, newLength: number): KvPageCounts {
    const { keep } = keptPages(this.book, seq, position);
    // Every page past the kept ones is taken at most once over the whole run.
    return { f16: Math.max(0, Math.ceil(newLength / this.book.pageTokens) - keep), quant: 0 };
  }

  longestFor(f16Held: number): number {
    const { book } = this;
    const pages = f16Held + book.f16.available() + book.f16.retiring.length;
    return Math.min(pages, book.maxPagesPerSequence) * book.pageTokens;
  }
}

/**
 * An f16 sink and window, quant pages for the rest:
 * - positions [0, sinkPages*pageTokens) stay f16 (`sink` rounded up to whole pages), and so does every page that is
 *   not entirely older than `window` positions before the step's first position;
 * - a step from `position` demotes each full page i >= sinkPages with (i+1)*pageTokens <= position - window (oldest
 *   first, at most `maxStepDemotions` a step, so that no step leaves a backlog behind).
 */
export class QuantTiering implements KvTiering {
  readonly mode = 'quant' as const;

  constructor(
    private readonly book: KvPageBook,
    readonly sinkPages: number,
    readonly window: number,
    /** Most positions one step writes (the prefill chunk). */
    private readonly maxStepTokens: number,
    /** Most demotions one step carries. */
    private readonly maxStepDemotions: number,
  ) {}

  private get quant() {
    return this.book.quant as NonNullable<KvPageBook['quant']>;
  }

  /** The f16 and quant pages a sequence of `length` positions holds once its old pages are demoted. */
  private layoutPages(length: number): KvPageCounts {
    const pages = Math.ceil(length / this.book.pageTokens);
    const quant = Math.max(0, Math.floor((length - this.window) / this.book.pageTokens) - this.sinkPages - 1);
    return { f16: pages - quant, quant };
  }

  reserve(seq: KvSequence, newLength: number): void {
    const { book } = this;
    const needed = Math.ceil(newLength / book.pageTokens);
    if (needed <= seq.pages.length) return;
    // Final layout: pages [sinkPages, quantEnd) quantized, the others f16. Pages held keep their kind (a flushed
    // window stays quantized) except f16 ones in the quantized range, which are demoted and free their f16 page.
    const quantEnd = this.sinkPages + this.layoutPages(newLength).quant;
    const inQuant = (i: number) => i >= this.sinkPages && i < quantEnd;
    let newQuant = 0;
    for (let i = seq.pages.length; i < needed; i++) if (inQuant(i)) newQuant++;
    const newF16 = needed - seq.pages.length - newQuant;
    let demoted = 0;
    for (let i = this.sinkPages; i < Math.min(seq.pages.length, quantEnd); i++) {
      if (book.storeOf(seq.pages[i]) === book.f16) demoted++;
    }
    const fits =
      needed <= book.maxPagesPerSequence &&
      newF16 - demoted <= book.f16.available() + book.f16.retiring.length &&
      newQuant + demoted <= this.quant.available();
    if (!fits) throw this.overflow(seq, newLength);
  }

  checkStep(seq: KvSequence, end: number): void {
    throw this.overflow(seq, end);
  }

  pagesToDemote(seq: KvSequence, position: number): number[] {
    const { book } = this;
    const limit = Math.floor((position - this.window) / book.pageTokens);
    const out: number[] = [];
    const max = Math.min(this.maxStepDemotions, this.quant.available());
    for (let i = this.sinkPages; i < Math.min(limit, seq.pages.length) && out.length < max; i++) {
      if (book.storeOf(seq.pages[i]) === book.f16) out.push(i);
    }
    return out;
  }

  flushCandidates(seq: KvSequence, max: number): number[] {
    const { book } = this;
    const out: number[] = [];
    const full = Math.min(seq.pages.length, Math.floor(seq.length / book.pageTokens));
    for (let i = this.sinkPages; i < full && out.length < max; i++) {
      const entry = seq.pages[i];
      if (book.storeOf(entry) === book.f16 && book.f16.refcounts[book.f16.globalId(entry)] === 1) out.push(i);
    }
    return out;
  }

  /**
   * The f16 peak is the sink, the window, the previous step's pages not yet old enough to demote and the step's own
   * new pages (one more where it starts inside a page it must copy or promote); pages kept f16 count toward it.
   */
  pagesNeeded(seq: KvSequence | null, position: number, newLength: number): KvPageCounts {
    const P = this.book.pageTokens;
    const kept = keptPages(this.book, seq, position);
    const fresh = Math.max(0, Math.ceil(newLength / P) - kept.keep);
    const chunk = Math.ceil(this.maxStepTokens / P);
    // The worst case runtime/kv/pool-pressure.test.ts finds is one page less: a page of margin.
    const peak = this.sinkPages + Math.ceil(this.window / P) + 2 * chunk + 2;
    const f16 = Math.min(fresh, Math.max(peak - kept.f16, chunk + 2));
    // Demotion quantizes pages [sinkPages, floor((step position - window) / P)), the kept f16 ones among them too,
    // never the ones kept quant again.
    const quant = Math.max(0, Math.floor((newLength - this.window) / P) - this.sinkPages - kept.quant);
    return { f16, quant };
  }

  longestFor(f16Held: number, quantHeld: number): number {
    const { book } = this;
    const f16 = f16Held + book.f16.available() + book.f16.retiring.length;
    // Steady state needs sink + window + 2 f16 pages; the rest can be quantized.
    const f16Steady = this.sinkPages + Math.ceil(this.window / book.pageTokens) + 2;
    const pages = f16 < f16Steady ? f16 : f16Steady + quantHeld + this.quant.available();
    return Math.min(pages, book.maxPagesPerSequence) * book.pageTokens;
  }

  private overflow(seq: KvSequence, newLength: number): ContextOverflowError {
    const held = this.book.heldPages(seq);
    const available = Math.min(this.longestFor(held.f16, held.quant), newLength - 1);
    return new ContextOverflowError(newLength, Math.max(0, available), this.book.limitAt(available));
  }
}
