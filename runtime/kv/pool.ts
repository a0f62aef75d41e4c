/**
 * KvPagePool: the paged KV cache. One pool per loaded model; sequences own lists of pages.
 *
 * ## Page (kind 'f16', the only kind so far)
 * A page holds `pageTokens` consecutive positions of ONE sequence for EVERY layer, so one page table serves all
 * layers. K and V are f16, two per u32 (`pack2x16float`, element 2i in the low half). Word layout of a page:
 *
 *     [layer][kv: 0 = K, 1 = V][kvHead][token in page][headDim / 2]
 *
 * i.e. K of (layer l, head h, token t, dims 2w..2w+1) is word `((l*2 + 0)*kvHeads + h)*pageTokens*headDim/2 +
 * t*headDim/2 + w`, so one head's keys of a page are contiguous. `pageWords = layers*2*kvHeads*pageTokens*headDim/2`.
 *
 * ## Slabs
 * Pages live in up to MAX_KV_SLABS GPU buffers ("slabs", category 'kv', each <= maxStorageBufferBindingSize),
 * created one at a time as `reserve` needs pages, never copied; each slab holds a quarter of the budget. A fixed
 * slab count keeps every kernel at <= 7 storage bindings (4 slabs + page table + 2 activations) under the spec
 * default of 8. So the usable budget is capped at 4 x maxStorageBufferBindingSize (`stats().pagesBudget` says what
 * was granted; 512 MiB where a browser keeps the 128 MiB default). Until a slab exists its binding is a 16-byte
 * placeholder; kernels re-create their bind group lazily when `generation` changes (which happens only inside
 * `reserve`/`writeStep` when the pool grows, never in a steady decode loop).
 *
 * ## Page table
 * ONE u32 storage buffer for all sequences: sequence slot s owns entries
 * [s*maxPagesPerSequence, (s+1)*maxPagesPerSequence). Entry = kind << 28 | slab << 24 | page index in slab.
 * Kinds other than 0 (f16) are reserved for the INT2 page kind (its own slabs, its own free list).
 * The table is rewritten with `queue.writeBuffer` only when a sequence's pages change.
 *
 * ## Step uniform (`KvStep`, 16 bytes, `pool.step`)
 *     struct KvStep { position: u32, tokens: u32, tableOffset: u32, length: u32 }
 * `position` is the first position this submit writes, `tokens` how many, `tableOffset` the sequence's slice of the
 * page table (in entries), `length = position + tokens` the sequence length after the step. The caller writes it
 * once per submit with `pool.writeStep(seq, position, tokens)`; every layer's append and attention dispatch binds
 * the same buffer, so the whole forward is prepared once and re-encoded every token with nothing allocated.
 * `tokens` must not exceed the maxTokens the submitted dispatches were prepared with (their grid): prepare one
 * graph for decode (maxTokens 1) and one for prefill chunks.
 *
 * ## Wiring (see runtime/kv/paged-attention.ts)
 *     const pool = new KvPagePool(gpu, { layers, kvHeads, headDim, budgetBytes });
 *     const kv = new PagedKvAttention(gpu, pool, { heads });      // kv.prepareLayer(layer, {q,k,v,output}, maxTokens)
 *     const seq = pool.createSequence();
 *     pool.writeStep(seq, seq.length, ids.length);                // before each submit; throws ContextOverflowError
 *     pool.fork(seq) / pool.truncate(seq, n) / pool.free(seq)     // branches share full pages copy-on-write
 */

import { ContextOverflowError, InvalidRequestError } from '../errors.ts';
import type { GpuContext } from '../gpu/device.ts';

export const MAX_KV_SLABS = 4;
export const KV_STEP_BYTES = 16;

/** Page kinds; the code goes into the top 4 bits of a page-table entry. */
export const KV_PAGE_KIND = { f16: 0 } as const;
export type KvPageKind = keyof typeof KV_PAGE_KIND;

const ENTRY_KIND_SHIFT = 28;
const ENTRY_SLAB_SHIFT = 24;
const ENTRY_PAGE_MASK = 0xffffff;

export function encodePageEntry(kind: number, slab: number, page: number): number {
  return ((kind << ENTRY_KIND_SHIFT) | (slab << ENTRY_SLAB_SHIFT) | page) >>> 0;
}

export function decodePageEntry(entry: number): { kind: number; slab: number; page: number } {
  return { kind: entry >>> ENTRY_KIND_SHIFT, slab: (entry >>> ENTRY_SLAB_SHIFT) & 0xf, page: entry & ENTRY_PAGE_MASK };
}

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
}

export interface KvPoolStats {
  pageTokens: number;
  pageBytes: number;
  /** Pages referenced by at least one sequence. */
  pagesUsed: number;
  /** Pages in allocated slabs that nobody references. */
  pagesFree: number;
  /** Pages in allocated slabs (used + free). */
  pagesReserved: number;
  /** Pages the budget allows once every slab exists. */
  pagesBudget: number;
  bytesUsed: number;
  bytesReserved: number;
  /** Sum of the live sequences' lengths (shared pages counted once per sequence). */
  tokensHeld: number;
  sequences: number;
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
  /** Page-table entries, one per pageTokens positions (may run past `length`: reserved ahead). */
  readonly pages: number[] = [];
  alive = true;

  constructor(id: number, slot: number, tableOffset: number) {
    this.id = id;
    this.slot = slot;
    this.tableOffset = tableOffset;
  }
}

/** The pages of one kind: slabs, refcounts and a free list (LIFO, so recently freed pages are reused first). */
class PageStore {
  readonly kind: number;
  readonly pageBytes: number;
  readonly pagesPerSlab: number;
  readonly maxPages: number;
  readonly slabs: GPUBuffer[] = [];
  readonly free: number[] = [];
  /** Indexed by global page id = slab * pagesPerSlab + page. */
  readonly refcounts: Int32Array;
  allocatedPages = 0;
  usedPages = 0;

  constructor(kind: number, pageBytes: number, pagesPerSlab: number, maxPages: number) {
    this.kind = kind;
    this.pageBytes = pageBytes;
    this.pagesPerSlab = pagesPerSlab;
    this.maxPages = maxPages;
    this.refcounts = new Int32Array(MAX_KV_SLABS * pagesPerSlab);
  }

  globalId(entry: number): number {
    const { slab, page } = decodePageEntry(entry);
    return slab * this.pagesPerSlab + page;
  }

  entryOf(globalId: number): number {
    return encodePageEntry(this.kind, Math.floor(globalId / this.pagesPerSlab), globalId % this.pagesPerSlab);
  }

  /** Pages obtainable now: free ones plus what the remaining budget can still allocate. */
  available(): number {
    return this.free.length + (this.maxPages - this.allocatedPages);
  }
}

export class KvPagePool {
  readonly layers: number;
  readonly kvHeads: number;
  readonly headDim: number;
  readonly pageTokens: number;
  readonly pageWords: number;
  readonly pageBytes: number;
  readonly maxSequences: number;
  readonly maxPagesPerSequence: number;
  /** The page table of every sequence (u32 entries). */
  readonly pageTable: GPUBuffer;
  /** The KvStep uniform every KV kernel binds. */
  readonly step: GPUBuffer;
  /** Bumped whenever a slab is added: bind groups made before it must be re-created. */
  generation = 0;

  private readonly gpu: GpuContext;
  private readonly f16: PageStore;
  private readonly placeholders: GPUBuffer[] = [];
  private readonly sequences = new Map<number, KvSequence>();
  private readonly freeSlots: number[] = [];
  private readonly stepWords = new Uint32Array(4);
  private bounce: GPUBuffer | null = null;
  private nextId = 1;

  constructor(gpu: GpuContext, options: KvPoolOptions) {
    const { layers, kvHeads, headDim, budgetBytes } = options;
    const pageTokens = options.pageTokens ?? 16;
    for (const [name, value] of Object.entries({ layers, kvHeads, headDim, pageTokens })) {
      if (!Number.isInteger(value) || value < 1) throw new InvalidRequestError(`KV pool: ${name} must be >= 1`);
    }
    if (headDim % 2 !== 0) throw new InvalidRequestError(`KV pool: headDim ${headDim} must be even (f16 pairs)`);
    this.gpu = gpu;
    this.layers = layers;
    this.kvHeads = kvHeads;
    this.headDim = headDim;
    this.pageTokens = pageTokens;
    this.pageWords = (layers * 2 * kvHeads * pageTokens * headDim) / 2;
    this.pageBytes = this.pageWords * 4;

    const slabLimit = Math.min(
      gpu.limits.maxStorageBufferBindingSize,
      gpu.limits.maxBufferSize,
      options.maxSlabBytes ?? Number.POSITIVE_INFINITY,
    );
    const pagesPerSlabLimit = Math.min(Math.floor(slabLimit / this.pageBytes), ENTRY_PAGE_MASK + 1);
    const budgetPages = Math.floor(budgetBytes / this.pageBytes);
    if (pagesPerSlabLimit < 1 || budgetPages < 1) {
      throw new InvalidRequestError(
        `KV pool: one page is ${this.pageBytes} bytes (${pageTokens} tokens x ${layers} layers), more than ` +
          `${budgetPages < 1 ? `the KV budget of ${budgetBytes} bytes` : `a GPU buffer binding (${slabLimit} bytes)`}. ` +
          'Raise kvBudgetBytes or use fewer pageTokens.',
        { pageBytes: this.pageBytes, budgetBytes, slabLimit },
      );
    }
    const maxPages = Math.min(budgetPages, MAX_KV_SLABS * pagesPerSlabLimit);
    const pagesPerSlab = Math.min(pagesPerSlabLimit, Math.ceil(maxPages / MAX_KV_SLABS));
    this.f16 = new PageStore(KV_PAGE_KIND.f16, this.pageBytes, pagesPerSlab, maxPages);

    this.maxSequences = options.maxSequences ?? 8;
    const maxSequenceTokens = options.maxSequenceTokens ?? maxPages * pageTokens;
    this.maxPagesPerSequence = Math.min(maxPages, Math.ceil(maxSequenceTokens / pageTokens));
    for (let s = this.maxSequences - 1; s >= 0; s--) this.freeSlots.push(s);

    this.pageTable = gpu.allocator.createBuffer({
      label: 'kv.pageTable',
      category: 'kv',
      size: this.maxSequences * this.maxPagesPerSequence * 4,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC,
    });
    this.step = gpu.allocator.createBuffer({
      label: 'kv.step',
      category: 'kv',
      size: KV_STEP_BYTES,
      usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
    });
    // Distinct buffers: Dawn rejects one buffer bound to two writable storage bindings.
    for (let i = 0; i < MAX_KV_SLABS; i++) {
      this.placeholders.push(
        gpu.allocator.createBuffer({
          label: `kv.slab${i}.placeholder`,
          category: 'kv',
          size: 16,
          usage: GPUBufferUsage.STORAGE,
        }),
      );
    }
  }

  /** Word offset of K (kv = 0) or V (kv = 1) of `layer`, head 0, token 0 inside a page. */
  layerOffsetWords(layer: number, kv: 0 | 1): number {
    return (layer * 2 + kv) * this.kvHeads * this.pageTokens * (this.headDim / 2);
  }

  /** The f16 slabs to bind at the kernels' slab bindings 0..MAX_KV_SLABS-1 (placeholders where none exists yet). */
  slabBindings(): GPUBuffer[] {
    return this.placeholders.map((p, i) => this.f16.slabs[i] ?? p);
  }

  /** The most tokens one more sequence could hold now (free pages plus unallocated budget). */
  get tokensAvailable(): number {
    return Math.min(this.f16.available(), this.maxPagesPerSequence) * this.pageTokens;
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
   * A new sequence with the same contents: full pages are shared (refcount + 1, copied on the first write),
   * a partly filled last page is copied now on the GPU.
   */
  fork(parent: KvSequence): KvSequence {
    this.assertAlive(parent);
    const full = Math.floor(parent.length / this.pageTokens);
    const partial = parent.length % this.pageTokens !== 0;
    if (partial && this.f16.available() < 1) {
      throw new ContextOverflowError(parent.length, this.tokensAvailable, 'Forking needs one free KV page.');
    }
    const child = this.createSequence();
    for (let i = 0; i < full; i++) {
      this.f16.refcounts[this.f16.globalId(parent.pages[i])]++;
      child.pages.push(parent.pages[i]);
    }
    if (partial) {
      const copy = this.allocatePage();
      this.copyPages([[parent.pages[full], copy]]);
      child.pages.push(copy);
    }
    child.length = parent.length;
    this.uploadTable(child, 0, child.pages.length);
    return child;
  }

  free(seq: KvSequence): void {
    this.assertAlive(seq);
    for (const entry of seq.pages) this.releasePage(entry);
    seq.pages.length = 0;
    seq.length = 0;
    seq.alive = false;
    this.sequences.delete(seq.id);
    this.freeSlots.push(seq.slot);
  }

  /**
   * Makes sure `seq` has pages for `newLength` positions (allocating, growing the pool if needed). Does not change
   * `seq.length`. Throws ContextOverflowError, before changing anything, when the budget cannot hold it.
   */
  reserve(seq: KvSequence, newLength: number): void {
    this.assertAlive(seq);
    const needed = Math.ceil(newLength / this.pageTokens) - seq.pages.length;
    if (needed <= 0) return;
    this.checkCapacity(seq, newLength, needed);
    const start = seq.pages.length;
    for (let i = 0; i < needed; i++) seq.pages.push(this.allocatePage());
    this.uploadTable(seq, start, seq.pages.length);
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

  /**
   * Prepares the next submit to write `tokens` positions of `seq` starting at `position` (<= seq.length; a smaller
   * position rewrites, as after a rollback): reserves pages, copies shared pages it would write, sets
   * `seq.length = position + tokens` and writes the KvStep uniform. Allocation-free when no page is needed.
   */
  writeStep(seq: KvSequence, position: number, tokens: number): void {
    this.assertAlive(seq);
    if (!Number.isInteger(position) || position < 0 || position > seq.length) {
      throw new InvalidRequestError(`KV step: position ${position} must be within 0..${seq.length} (no gaps)`);
    }
    if (!Number.isInteger(tokens) || tokens < 1)
      throw new InvalidRequestError(`KV step: tokens ${tokens} must be >= 1`);
    const end = position + tokens;
    const first = Math.floor(position / this.pageTokens);
    const last = Math.ceil(end / this.pageTokens);
    let shared = 0;
    for (let i = first; i < Math.min(last, seq.pages.length); i++) {
      if (this.f16.refcounts[this.f16.globalId(seq.pages[i])] > 1) shared++;
    }
    const needed = Math.max(0, last - seq.pages.length) + shared;
    if (needed > 0) this.checkCapacity(seq, end, needed, first);
    if (shared > 0) this.copyOnWrite(seq, first, Math.min(last, seq.pages.length));
    this.reserve(seq, end);
    seq.length = end;
    const w = this.stepWords;
    w[0] = position;
    w[1] = tokens;
    w[2] = seq.tableOffset;
    w[3] = end;
    this.gpu.device.queue.writeBuffer(this.step, 0, w);
  }

  /** `writeStep(seq, seq.length, tokens)`: the next `tokens` positions of `seq`. Returns the step's position. */
  beginStep(seq: KvSequence, tokens: number): number {
    const position = seq.length;
    this.writeStep(seq, position, tokens);
    return position;
  }

  stats(): KvPoolStats {
    let tokensHeld = 0;
    for (const s of this.sequences.values()) tokensHeld += s.length;
    const store = this.f16;
    return {
      pageTokens: this.pageTokens,
      pageBytes: this.pageBytes,
      pagesUsed: store.usedPages,
      pagesFree: store.allocatedPages - store.usedPages,
      pagesReserved: store.allocatedPages,
      pagesBudget: store.maxPages,
      bytesUsed: store.usedPages * this.pageBytes,
      bytesReserved: store.allocatedPages * this.pageBytes,
      tokensHeld,
      sequences: this.sequences.size,
      slabs: store.slabs.length,
    };
  }

  /**
   * Recomputes ownership from the live sequences and compares it with the refcounts and the free list.
   * Returns the problems found (empty when consistent); tests call it after every operation.
   */
  audit(): string[] {
    const problems: string[] = [];
    const store = this.f16;
    const counts = new Int32Array(store.refcounts.length);
    for (const seq of this.sequences.values()) {
      if (seq.pages.length < Math.ceil(seq.length / this.pageTokens))
        problems.push(`sequence ${seq.id}: ${seq.pages.length} pages for ${seq.length} tokens`);
      if (seq.pages.length > this.maxPagesPerSequence) problems.push(`sequence ${seq.id}: over its table slice`);
      for (const entry of seq.pages) {
        const id = store.globalId(entry);
        if (id >= store.allocatedPages) problems.push(`sequence ${seq.id}: page ${id} is not allocated`);
        counts[id]++;
      }
    }
    const inFree = new Uint8Array(store.refcounts.length);
    for (const id of store.free) {
      if (inFree[id]) problems.push(`page ${id} is twice in the free list`);
      inFree[id] = 1;
    }
    let used = 0;
    for (let id = 0; id < store.allocatedPages; id++) {
      if (counts[id] !== store.refcounts[id])
        problems.push(`page ${id}: refcount ${store.refcounts[id]}, owners ${counts[id]}`);
      if (counts[id] > 0) used++;
      if ((counts[id] === 0) !== (inFree[id] === 1))
        problems.push(`page ${id}: ${counts[id]} owners but ${inFree[id] ? 'in' : 'not in'} the free list`);
    }
    if (used !== store.usedPages) problems.push(`usedPages ${store.usedPages}, counted ${used}`);
    if (store.free.length + used !== store.allocatedPages) problems.push('free + used != allocated');
    return problems;
  }

  /** Releases every GPU buffer of the pool; sequences become invalid. */
  destroy(): void {
    for (const seq of [...this.sequences.values()]) this.free(seq);
    for (const b of [...this.f16.slabs, ...this.placeholders, this.pageTable, this.step]) this.gpu.allocator.release(b);
    if (this.bounce) this.gpu.allocator.release(this.bounce);
    this.bounce = null;
    this.f16.slabs.length = 0;
  }

  private assertAlive(seq: KvSequence): void {
    if (!seq.alive || this.sequences.get(seq.id) !== seq) {
      throw new InvalidRequestError(`KV sequence ${seq.id} was freed or belongs to another pool`);
    }
  }

  /** Throws ContextOverflowError when writing up to `newLength` from page `firstWritten` needs more than is free. */
  private checkCapacity(
    seq: KvSequence,
    newLength: number,
    pagesNeeded: number,
    firstWritten = seq.pages.length,
  ): void {
    if (pagesNeeded <= this.f16.available() && Math.ceil(newLength / this.pageTokens) <= this.maxPagesPerSequence)
      return;
    // The longest this sequence could get: walk its pages, paying one free page per shared page it would write.
    let free = this.f16.available();
    let pages = firstWritten;
    for (; pages < seq.pages.length; pages++) {
      if (this.f16.refcounts[this.f16.globalId(seq.pages[pages])] > 1) {
        if (free === 0) break;
        free--;
      }
    }
    if (pages === seq.pages.length) pages += free;
    throw new ContextOverflowError(newLength, Math.min(pages, this.maxPagesPerSequence) * this.pageTokens);
  }

  private allocatePage(): number {
    const store = this.f16;
    if (store.free.length === 0) this.growSlab();
    const id = store.free.pop();
    if (id === undefined) throw new ContextOverflowError(0, 0, 'KV pool bookkeeping error: no page after growth.');
    store.refcounts[id] = 1;
    store.usedPages++;
    return store.entryOf(id);
  }

  private releasePage(entry: number): void {
    const store = this.f16;
    const id = store.globalId(entry);
    if (--store.refcounts[id] === 0) {
      store.free.push(id);
      store.usedPages--;
    }
  }

  private growSlab(): void {
    const store = this.f16;
    const slab = store.slabs.length;
    const pages = Math.min(store.pagesPerSlab, store.maxPages - store.allocatedPages);
    if (slab >= MAX_KV_SLABS || pages < 1) return;
    store.slabs.push(
      this.gpu.allocator.createBuffer({
        label: `kv.f16.slab${slab}`,
        category: 'kv',
        size: pages * store.pageBytes,
        usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC,
      }),
    );
    // Push in reverse so pages are handed out in increasing order.
    for (let p = pages - 1; p >= 0; p--) store.free.push(slab * store.pagesPerSlab + p);
    store.allocatedPages += pages;
    this.generation++;
  }

  /** Replaces shared pages in seq.pages[from, to) by private copies. Capacity was checked by the caller. */
  private copyOnWrite(seq: KvSequence, from: number, to: number): void {
    const copies: Array<[number, number]> = [];
    for (let i = from; i < to; i++) {
      const entry = seq.pages[i];
      if (this.f16.refcounts[this.f16.globalId(entry)] <= 1) continue;
      const copy = this.allocatePage();
      copies.push([entry, copy]);
      this.releasePage(entry);
      seq.pages[i] = copy;
    }
    this.copyPages(copies);
    this.uploadTable(seq, from, to);
  }

  private copyPages(pairs: ReadonlyArray<readonly [number, number]>): void {
    if (pairs.length === 0) return;
    const encoder = this.gpu.device.createCommandEncoder({ label: 'kv.copyPages' });
    for (const [src, dst] of pairs) {
      const s = decodePageEntry(src);
      const d = decodePageEntry(dst);
      const from = this.f16.slabs[s.slab];
      const to = this.f16.slabs[d.slab];
      if (from !== to) {
        encoder.copyBufferToBuffer(from, s.page * this.pageBytes, to, d.page * this.pageBytes, this.pageBytes);
        continue;
      }
      // WebGPU forbids copies within one buffer: go through a one-page bounce buffer.
      this.bounce ??= this.gpu.allocator.createBuffer({
        label: 'kv.copyBounce',
        category: 'kv',
        size: this.pageBytes,
        usage: GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
      });
      encoder.copyBufferToBuffer(from, s.page * this.pageBytes, this.bounce, 0, this.pageBytes);
      encoder.copyBufferToBuffer(this.bounce, 0, to, d.page * this.pageBytes, this.pageBytes);
    }
    this.gpu.device.queue.submit([encoder.finish()]);
  }

  private uploadTable(seq: KvSequence, from: number, to: number): void {
    if (to <= from) return;
    const entries = Uint32Array.from(seq.pages.slice(from, to));
    this.gpu.device.queue.writeBuffer(this.pageTable, (seq.tableOffset + from) * 4, entries);
  }
}
