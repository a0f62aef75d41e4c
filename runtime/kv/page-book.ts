/**
 * The paged cache's bookkeeping, with no GPU in it: which pages exist (per kind: slabs, refcounts, free lists), which
 * sequence owns which, and the page-table entries that name them. Whatever must happen to GPU memory because of it
 * (a slab to create, table entries to upload, pages to copy or promote) is told to `PageBookEvents`, which the GPU
 * storage (runtime/kv/page-storage.ts) implements; the property tests implement it with a CPU mirror.
 *
 * Entry = kind << 28 | slot << 24 | page index in slab. Each kind's store owns a range of slab slots; a page's
 * global id within its store is (slot - firstSlot) * pagesPerSlab + page.
 */
import { type ContextLimit, ContextOverflowError, InvalidRequestError } from '../../core/errors.ts';

/** Page kinds; the code goes into the top 4 bits of a page-table entry. */
export const KV_PAGE_KIND = { f16: 0, quant: 1 } as const;
export type KvPageKind = keyof typeof KV_PAGE_KIND;

const ENTRY_KIND_SHIFT = 28;
const ENTRY_SLAB_SHIFT = 24;
export const ENTRY_PAGE_MASK = 0xffffff;

export function encodePageEntry(kind: number, slab: number, page: number): number {
  return ((kind << ENTRY_KIND_SHIFT) | (slab << ENTRY_SLAB_SHIFT) | page) >>> 0;
}

export function decodePageEntry(entry: number): { kind: number; slab: number; page: number } {
  return { kind: entry >>> ENTRY_KIND_SHIFT, slab: (entry >>> ENTRY_SLAB_SHIFT) & 0xf, page: entry & ENTRY_PAGE_MASK };
}

export interface KvKindStats {
  /** Bytes of a page. */
  pageBytes: number;
  /** Pages referenced by at least one sequence. */
  pagesUsed: number;
  /** Pages in allocated slabs that nobody references (retiring pages count as free). */
  pagesFree: number;
  /** Pages in allocated slabs (used + free). */
  pagesReserved: number;
  /** Pages the budget allows once every slab exists. */
  pagesBudget: number;
  /** Bytes of the used pages. */
  bytesUsed: number;
  slabs: number;
}

/** A sequence's handle. Its pages and length belong to the pool; read them, never write. */
export class KvSequence {
  readonly id: number;
  /** Page-table slot; `tableOffset = slot * maxPagesPerSequence`. */
  readonly slot: number;
  readonly tableOffset: number;
  /** Positions whose K/V are written (or will be by the submitted step). */
  length = 0;
  /** Page-table entries, one per pageTokens positions (may run past `length` in f16 mode: reserved ahead). */
  readonly pages: number[] = [];
  alive = true;

  constructor(id: number, slot: number, tableOffset: number) {
    this.id = id;
    this.slot = slot;
    this.tableOffset = tableOffset;
  }
}

/** How many pages of one kind there may be and how they fall into slabs. */
export interface PageStoreGeometry {
  kind: number;
  pageBytes: number;
  pagesPerSlab: number;
  maxPages: number;
  /** Slab slot of this store's first slab (the kernels' slab binding index). */
  firstSlot: number;
  maxSlabs: number;
}

/** The pages of one kind: refcounts and a free list (LIFO, so recently freed pages are reused first). */
export class PageStore implements PageStoreGeometry {
  readonly kind: number;
  readonly pageBytes: number;
  readonly pagesPerSlab: number;
  readonly maxPages: number;
  readonly firstSlot: number;
  readonly maxSlabs: number;
  readonly free: number[] = [];
  /** Released pages that a submitted-next step still reads (demotion sources): free at the next step. */
  readonly retiring: number[] = [];
  /** Indexed by global page id = slab * pagesPerSlab + page. */
  readonly refcounts: Int32Array;
  /** Slabs that exist (their pages are allocated). */
  slabs = 0;
  allocatedPages = 0;
  usedPages = 0;

  constructor(geometry: PageStoreGeometry) {
    this.kind = geometry.kind;
    this.pageBytes = geometry.pageBytes;
    this.pagesPerSlab = geometry.pagesPerSlab;
    this.maxPages = geometry.maxPages;
    this.firstSlot = geometry.firstSlot;
    this.maxSlabs = geometry.maxSlabs;
    this.refcounts = new Int32Array(geometry.maxSlabs * geometry.pagesPerSlab);
  }

  get name(): KvPageKind {
    return this.kind === KV_PAGE_KIND.f16 ? 'f16' : 'quant';
  }

  globalId(entry: number): number {
    const { slab, page } = decodePageEntry(entry);
    return (slab - this.firstSlot) * this.pagesPerSlab + page;
  }

  entryOf(globalId: number): number {
    return encodePageEntry(
      this.kind,
      this.firstSlot + Math.floor(globalId / this.pagesPerSlab),
      globalId % this.pagesPerSlab,
    );
  }

  /** Pages obtainable now: free ones plus what the remaining budget can still allocate. */
  available(): number {
    return this.free.length + (this.maxPages - this.allocatedPages);
  }

  /** Retiring pages become free: the submit that read them precedes anything submitted from now on. */
  settleRetiring(): void {
    for (const id of this.retiring) this.free.push(id);
    this.retiring.length = 0;
  }

  stats(): KvKindStats {
    return {
      pageBytes: this.pageBytes,
      pagesUsed: this.usedPages,
      pagesFree: this.allocatedPages - this.usedPages,
      pagesReserved: this.allocatedPages,
      pagesBudget: this.maxPages,
      bytesUsed: this.usedPages * this.pageBytes,
      slabs: this.slabs,
    };
  }
}

/** What GPU memory must do because of the bookkeeping; the GPU storage carries it out (or a test records it). */
export interface PageBookEvents {
  /** Slab `slab` of `store` now exists with `pages` pages: its buffer must exist before the next submit. */
  slabAdded(store: PageStore, slab: number): void;
  /** Trailing slab `slab` of `store` holds no page in use: its buffer may go. */
  slabRemoved(store: PageStore, slab: number): void;
  /** `seq.pages[from, to)` changed: the page table's entries must follow. */
  tableChanged(seq: KvSequence, from: number, to: number): void;
  /** Each pair's first page must be copied into its second (same kind) before anything reads the second. */
  pagesCopied(pairs: ReadonlyArray<readonly [number, number]>): void;
  /** Each pair's quant page must be dequantized into its f16 page before anything reads the f16 page. */
  pagesPromoted(pairs: ReadonlyArray<readonly [number, number]>): void;
}

/** The book's sequences and page stores. */
export class KvPageBook {
  readonly pageTokens: number;
  readonly maxSequences: number;
  readonly maxPagesPerSequence: number;
  /** The longest sequence the model allows (its context), when the pool was given one. */
  readonly maxSequenceTokens: number | null;
  readonly f16: PageStore;
  /** The quant pages' store (null when every page is f16). */
  readonly quant: PageStore | null;
  private readonly events: PageBookEvents;
  private readonly sequences = new Map<number, KvSequence>();
  private readonly freeSlots: number[] = [];
  private nextId = 1;

  constructor(
    geometry: {
      pageTokens: number;
      maxSequences: number;
      maxSequenceTokens?: number;
      f16: PageStoreGeometry;
      quant: PageStoreGeometry | null;
    },
    events: PageBookEvents,
  ) {
    this.pageTokens = geometry.pageTokens;
    this.f16 = new PageStore(geometry.f16);
    this.quant = geometry.quant ? new PageStore(geometry.quant) : null;
    this.events = events;
    this.maxSequences = geometry.maxSequences;
    const maxPagesAll = this.f16.maxPages + (this.quant?.maxPages ?? 0);
    this.maxSequenceTokens = geometry.maxSequenceTokens ?? null;
    const maxSequenceTokens = geometry.maxSequenceTokens ?? maxPagesAll * this.pageTokens;
    this.maxPagesPerSequence = Math.max(1, Math.min(maxPagesAll, Math.ceil(maxSequenceTokens / this.pageTokens)));
    for (let s = this.maxSequences - 1; s >= 0; s--) this.freeSlots.push(s);
  }

  /** What bounds a sequence that can hold at most `tokensAvailable`: the model's context, or the budget. */
  limitAt(tokensAvailable: number): ContextLimit {
    if (this.maxSequenceTokens !== null && tokensAvailable >= this.maxSequenceTokens) {
      return { kind: 'model-context', contextLength: this.maxSequenceTokens };
    }
    return { kind: 'kv-budget', kv: this.quant ? 'int2' : 'f16' };
  }

  stores(): PageStore[] {
    return this.quant ? [this.f16, this.quant] : [this.f16];
  }

  storeOf(entry: number): PageStore {
    return entry >>> ENTRY_KIND_SHIFT === KV_PAGE_KIND.quant && this.quant ? this.quant : this.f16;
  }

  storeOfSlot(slot: number): PageStore | null {
    for (const store of this.stores()) {
      if (slot >= store.firstSlot && slot < store.firstSlot + store.maxSlabs) return store;
    }
    return null;
  }

  isShared(entry: number): boolean {
    const store = this.storeOf(entry);
    return store.refcounts[store.globalId(entry)] > 1;
  }

  liveSequences(): IterableIterator<KvSequence> {
    return this.sequences.values();
  }

  get sequenceCount(): number {
    return this.sequences.size;
  }

  assertAlive(seq: KvSequence): void {
    if (!seq.alive || this.sequences.get(seq.id) !== seq) {
      throw new InvalidRequestError(`KV sequence ${seq.id} was freed or belongs to another pool`);
    }
  }

  createSequence(): KvSequence {
    const slot = this.freeSlots.pop();
    if (slot === undefined) {
      throw new InvalidRequestError(
        `KV pool: all ${this.maxSequences} sequence slots are in use; free a sequence or raise maxSequences.`,
      );
    }
    const seq = new KvSequence(this.nextId++, slot, slot * this.maxPagesPerSequence);
    this.sequences.set(seq.id, seq);
    return seq;
  }

  /**
   * A new sequence with the same contents: full pages (of either kind) are shared (refcount + 1, copied on the first
   * write), a partly filled last page is copied. `tokensAvailable` names what is free in the error when no page is.
   */
  fork(parent: KvSequence, tokensAvailable: () => number): KvSequence {
    this.assertAlive(parent);
    const full = Math.floor(parent.length / this.pageTokens);
    const partial = parent.length % this.pageTokens !== 0;
    const partialStore = partial ? this.storeOf(parent.pages[full]) : null;
    if (partialStore && partialStore.available() < 1) {
      throw new ContextOverflowError(parent.length, tokensAvailable(), {
        kind: 'other',
        hint: 'Forking needs one free KV page.',
      });
    }
    const child = this.createSequence();
    for (let i = 0; i < full; i++) {
      const store = this.storeOf(parent.pages[i]);
      store.refcounts[store.globalId(parent.pages[i])]++;
      child.pages.push(parent.pages[i]);
    }
    if (partialStore) {
      const copy = this.allocatePage(partialStore);
      this.events.pagesCopied([[parent.pages[full], copy]]);
      child.pages.push(copy);
    }
    child.length = parent.length;
    this.events.tableChanged(child, 0, child.pages.length);
    return child;
  }

  /**
   * A new sequence of `length` positions on fresh private pages of `kinds` (one KV_PAGE_KIND per page, in order),
   * whose contents the caller writes: a saved sequence coming back. Throws ContextOverflowError, before taking
   * anything, when a kind has too few pages; `tokensAvailable` names what is free in the error.
   */
  adoptPages(kinds: Uint8Array, length: number, tokensAvailable: () => number): KvSequence {
    if (!Number.isInteger(length) || length < 0 || Math.ceil(length / this.pageTokens) !== kinds.length) {
      throw new InvalidRequestError(`KV restore: ${kinds.length} pages cannot hold ${length} positions`);
    }
    const counts = new Map<PageStore, number>();
    for (const kind of kinds) {
      const store = kind === KV_PAGE_KIND.f16 ? this.f16 : this.quant;
      if (!store) throw new InvalidRequestError('KV restore: quant pages for a pool without them');
      counts.set(store, (counts.get(store) ?? 0) + 1);
    }
    for (const [store, count] of counts) {
      if (store.available() < count) {
        throw new ContextOverflowError(length, tokensAvailable(), {
          kind: 'other',
          hint: `Restoring a saved sequence needs ${count} free ${store.name} KV pages.`,
        });
      }
    }
    const seq = this.createSequence();
    // Each kind's pages in increasing order, so that the caller's copy finds runs of adjacent pages.
    const taken = new Map<PageStore, { entries: number[]; next: number }>();
    for (const [store, count] of counts) {
      const entries = Array.from({ length: count }, () => this.allocatePage(store));
      taken.set(store, { entries: entries.sort((a, b) => a - b), next: 0 });
    }
    for (const kind of kinds) {
      const pages = taken.get(kind === KV_PAGE_KIND.f16 ? this.f16 : this.quant!)!;
      seq.pages.push(pages.entries[pages.next++]);
    }
    seq.length = length;
    this.events.tableChanged(seq, 0, seq.pages.length);
    return seq;
  }

  free(seq: KvSequence): void {
    this.assertAlive(seq);
    // Last page first: the free lists are LIFO, so the next sequence gets these pages back in increasing order.
    for (let i = seq.pages.length - 1; i >= 0; i--) this.releasePage(seq.pages[i]);
    seq.pages.length = 0;
    seq.length = 0;
    seq.alive = false;
    this.sequences.delete(seq.id);
    this.freeSlots.push(seq.slot);
  }

  /** Rolls `seq` back to `length` positions, releasing the pages past it. */
  truncate(seq: KvSequence, length: number): void {
    this.assertAlive(seq);
    if (!Number.isInteger(length) || length < 0 || length > seq.length) {
      throw new InvalidRequestError(`KV truncate: length ${length} is outside 0..${seq.length}`);
    }
    const keep = Math.ceil(length / this.pageTokens);
    for (let i = keep; i < seq.pages.length; i++) this.releasePage(seq.pages[i]);
    seq.pages.length = keep;
    seq.length = length;
  }

  /** Entries `indices` of `seq` changed: one table upload over their span. */
  tableEntriesChanged(seq: KvSequence, indices: readonly number[]): void {
    this.events.tableChanged(seq, Math.min(...indices), Math.max(...indices) + 1);
  }

  /** Appends `count` new f16 pages to `seq` (capacity checked by the caller). */
  appendF16Pages(seq: KvSequence, count: number): void {
    const start = seq.pages.length;
    for (let i = 0; i < count; i++) seq.pages.push(this.allocatePage(this.f16));
    this.events.tableChanged(seq, start, seq.pages.length);
  }

  /**
   * Replaces the pages in seq.pages[from, to) that a step would write but may not: shared f16 pages by private
   * copies, quant pages by private f16 pages holding their dequantized values. Capacity was checked by the caller.
   */
  rewritePages(seq: KvSequence, from: number, to: number): void {
    const copies: Array<[number, number]> = [];
    const promotions: Array<[number, number]> = [];
    for (let i = from; i < to; i++) {
      const entry = seq.pages[i];
      const store = this.storeOf(entry);
      if (store === this.f16 && store.refcounts[store.globalId(entry)] <= 1) continue;
      const copy = this.allocatePage(this.f16);
      (store === this.f16 ? copies : promotions).push([entry, copy]);
      // The copy is recorded before anything that may reuse the old page: it may go back to the free list at once.
      this.releasePage(entry);
      seq.pages[i] = copy;
    }
    if (copies.length > 0) this.events.pagesCopied(copies);
    if (promotions.length > 0) this.events.pagesPromoted(promotions);
    this.events.tableChanged(seq, from, to);
  }

  allocatePage(store: PageStore): number {
    if (store.free.length === 0) this.growSlab(store);
    const id = store.free.pop();
    if (id === undefined) {
      throw new ContextOverflowError(0, 0, { kind: 'other', hint: 'KV pool bookkeeping error: no page after growth.' });
    }
    store.refcounts[id] = 1;
    store.usedPages++;
    return store.entryOf(id);
  }

  /** Drops one reference; `retire`: a submit still to come reads the page, so it is reusable only after the next step. */
  releasePage(entry: number, retire = false): void {
    const store = this.storeOf(entry);
    const id = store.globalId(entry);
    if (--store.refcounts[id] === 0) {
      (retire ? store.retiring : store.free).push(id);
      store.usedPages--;
    }
  }

  /** Retiring pages of every kind become free (called before each step and before releasing slabs). */
  settleRetiring(): void {
    for (const store of this.stores()) store.settleRetiring();
  }

  /**
   * Drops the trailing slabs of each kind none of whose pages is in use (a slab's page ids are positional, so only
   * the last can go). Returns the slabs dropped per store.
   */
  releaseFreeSlabs(): void {
    this.settleRetiring();
    for (const store of this.stores()) {
      while (store.slabs > 0) {
        const slab = store.slabs - 1;
        const first = slab * store.pagesPerSlab;
        let busy = false;
        for (let id = first; id < store.allocatedPages && !busy; id++) busy = store.refcounts[id] !== 0;
        if (busy) break;
        for (let i = store.free.length - 1; i >= 0; i--) if (store.free[i] >= first) store.free.splice(i, 1);
        store.allocatedPages = first;
        store.slabs--;
        this.events.slabRemoved(store, slab);
      }
    }
  }

  /** Pages of each kind `seq` holds. */
  heldPages(seq: KvSequence): { f16: number; quant: number } {
    let quant = 0;
    for (const e of seq.pages) if (this.storeOf(e) !== this.f16) quant++;
    return { f16: seq.pages.length - quant, quant };
  }

  /**
   * Recomputes ownership from the live sequences and compares it with the refcounts and the free lists.
   * `sinkPages`: pages at the start of a sequence that must stay f16. Returns the problems found (empty when
   * consistent); tests call it after every operation.
   */
  audit(sinkPages: number): string[] {
    const problems: string[] = [];
    const counts = new Map<PageStore, Int32Array>();
    for (const store of this.stores()) counts.set(store, new Int32Array(store.refcounts.length));
    for (const seq of this.sequences.values()) {
      if (seq.pages.length < Math.ceil(seq.length / this.pageTokens))
        problems.push(`sequence ${seq.id}: ${seq.pages.length} pages for ${seq.length} tokens`);
      if (seq.pages.length > this.maxPagesPerSequence) problems.push(`sequence ${seq.id}: over its table slice`);
      for (const [i, entry] of seq.pages.entries()) {
        const store = this.storeOf(entry);
        const id = store.globalId(entry);
        if (id < 0 || id >= store.allocatedPages) problems.push(`sequence ${seq.id}: page ${entry} is not allocated`);
        else (counts.get(store) as Int32Array)[id]++;
        if (store !== this.f16 && (i < sinkPages || (i + 1) * this.pageTokens > seq.length))
          problems.push(`sequence ${seq.id}: page ${i} is quantized inside the sink or not full`);
      }
    }
    for (const store of this.stores()) {
      const owned = counts.get(store) as Int32Array;
      const inFree = new Uint8Array(store.refcounts.length);
      for (const id of [...store.free, ...store.retiring]) {
        if (inFree[id]) problems.push(`${store.name} page ${id} is twice in the free lists`);
        inFree[id] = 1;
      }
      let used = 0;
      for (let id = 0; id < store.allocatedPages; id++) {
        if (owned[id] !== store.refcounts[id])
          problems.push(`${store.name} page ${id}: refcount ${store.refcounts[id]}, owners ${owned[id]}`);
        if (owned[id] > 0) used++;
        if ((owned[id] === 0) !== (inFree[id] === 1))
          problems.push(
            `${store.name} page ${id}: ${owned[id]} owners but ${inFree[id] ? 'in' : 'not in'} the free lists`,
          );
      }
      if (used !== store.usedPages) problems.push(`${store.name}: usedPages ${store.usedPages}, counted ${used}`);
      if (store.free.length + store.retiring.length + used !== store.allocatedPages)
        problems.push(`${store.name}: free + used != allocated`);
    }
    return problems;
  }

  private growSlab(store: PageStore): void {
    const slab = store.slabs;
    const pages = Math.min(store.pagesPerSlab, store.maxPages - store.allocatedPages);
    if (slab >= store.maxSlabs || pages < 1) return;
    // Push in reverse so pages are handed out in increasing order.
    for (let p = pages - 1; p >= 0; p--) store.free.push(slab * store.pagesPerSlab + p);
    store.allocatedPages += pages;
    store.slabs++;
    this.events.slabAdded(store, slab);
  }
}
