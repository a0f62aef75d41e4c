/**
 * KvPagePool: the paged KV cache. One pool per loaded model; sequences own lists of pages. It is made of four parts,
 * each in a file of its own: the page bookkeeping (runtime/kv/page-book.ts, no GPU), the tiering of positions
 * between f16 and quant pages (runtime/kv/tiering.ts, a type per mode), the quant page layout
 * (runtime/kv/quant-layout.ts) and the GPU storage (runtime/kv/page-storage.ts), which submits nothing of its own:
 * page copies, promotions and flushed demotions go into the next step's submit (`encodePending`, which the step
 * runner calls) or into an explicit `submitPending()`.
 *
 * ## Page kind 'f16' (kind 0)
 * A page holds `pageTokens` consecutive positions of ONE sequence for EVERY layer, so one page table serves all
 * layers. K and V are f16, two per u32 (`pack2x16float`, element 2i in the low half). Word layout of a page:
 *
 *     [layer][kv: 0 = K, 1 = V][kvHead][token in page][headDim / 2]
 *
 * i.e. K of (layer l, head h, token t, dims 2w..2w+1) is word `((l*2 + 0)*kvHeads + h)*pageTokens*headDim/2 +
 * t*headDim/2 + w`, so one head's keys of a page are contiguous. `pageWords = layers*2*kvHeads*pageTokens*headDim/2`.
 *
 * ## Page kind 'quant' (kind 1; pool option `kv: 'quant'`)
 * Also `pageTokens` positions of one sequence for every layer, in the layout of runtime/kv/quant-layout.ts.
 * Quant pages are never written by kv-append:
 * positions land in f16 pages and are DEMOTED later, a whole page at a time:
 * - positions [0, sinkPages*pageTokens) stay f16 (`sink` rounded up to whole pages), and so does every page that is
 *   not entirely older than `window` positions before the step's first position;
 * - `writeStep(seq, position, tokens)` demotes each full page i >= sinkPages with (i+1)*pageTokens <= position - window
 *   (oldest first, at most `maxStepDemotions` = ceil(maxStepTokens/pageTokens) + 1 per step, decode steps too, so
 *   no step leaves a backlog behind; the rest wait for the next step): a quant page is allocated, the job (f16 entry,
 *   quant entry) goes into the jobs storage buffer (`quant.jobs`, by queue.writeBuffer), the page-table entry is
 *   switched and the f16 page is released. The demotion kernel
 *   (kernels/kv-demote.ts) is part of every layer's `append` dispatch list (PagedKvAttention prepends it), so it runs
 *   in the SAME submit as the step's forward, before that layer's attention, with no extra submit and no engine hook.
 *   (Deviation from the first design, which had the engine call `encodePendingDemotions(encoder)`: the engine
 *   records forwards in several places (generation, teacher forcing, calibration) and any one that forgot the call
 *   would read unwritten quant pages. A step with no job leaves the dispatch out (its `idle`, from `stepDemotions`),
 *   so a graph must be encoded after its step's `writeStep`, as every forward already is.)
 * - A demoted f16 page whose last owner let go is "retiring": it returns to the free list only at the next
 *   `writeStep`, i.e. after the submit that reads it, so no copy (fork / copy-on-write) can overwrite it first.
 * - Writing into a quant page (a rewrite after `truncate` into the quantized region) first PROMOTES it: a private f16
 *   page is filled with its dequantized values (at the head of the step's submit) and replaces it, so history is
 *   never lost.
 * A long prompt prefilled chunk by chunk therefore ends up quantized except its sink and last window; peak f16 use of
 * a sequence is about sink + window + chunk + 2 pages. Pages of a prompt's last chunk leave the window only after it:
 * the first decode step demotes them all, in one dispatch per layer (demoting a decode step's own two pages a step
 * kept the first decode steps after a long chunk paying for demotions and f16 reads: measured slower,
 * bench/results/2026-12-01-nvidia-h200-session18-qwen3-32k-chunk1024-demote2.json).
 * The effective bits per element follow from the pool's stats (runtime/kv/pool.test.ts measures them at a bench shape).
 * f16 pages are a separate share of the budget, so idle sequences each holding their sink and window can fill it
 * while quant pages are free. Whoever keeps idle sequences (runtime/engine/conversations.ts) asks
 * `pagesNeeded(seq, position, length)` (per kind, at the run's peak) against `pagesObtainable()` before a request,
 * and makes room: `flush(idle)` demotes an idle sequence's full window pages (in the next submit; it keeps its
 * contents, the window at 2 bits as if it had aged out), and freeing a sequence returns pages of both kinds.
 *
 * ## Slabs
 * Pages live in GPU buffers ("slabs", category 'kv', each <= maxStorageBufferBindingSize), created one at a time as
 * pages are needed, never copied; `releaseFreeSlabs()` destroys trailing slabs none of whose pages is in use (the
 * conversation cache calls it once every conversation is deleted). Kernels bind MAX_KV_SLABS = 4 slab slots, so
 * every kernel stays at <= 7 storage bindings (4 slabs + page table + 2 activations) under the spec default of 8,
 * for both kinds together (the one exception, the fused decode store of kernels/rope-append.ts, needs 9 to 13 and
 * gives way to separate dispatches on an adapter that has fewer):
 * - mode 'f16': slots 0..3 are f16 slabs (a quarter of the budget each), exactly as before;
 * - mode 'quant': slots 0..1 are f16 slabs, slots 2..3 quant slabs. The budget is split: `f16BudgetBytes` (default:
 *   min(2, maxSequences) sequences' sink + window + 2 pages plus `maxStepTokens` (default 512) positions, at most
 *   half of the budget) for f16 pages,
 *   the rest for quant pages.
 * The slab field of a page-table entry is the SLOT, so f16 code paths (kv-append, the f16 attention loads) are the
 * same in both modes, and a quant entry names slot 2 or 3. `stats().pagesBudget` says what was granted. Until a slab
 * exists its binding is a 16-byte placeholder; kernels re-create their bind group lazily when `generation` changes
 * (which happens only inside `reserve`/`writeStep`/`fork` when the pool grows, never in a steady decode loop).
 *
 * ## Page table
 * ONE u32 storage buffer for all sequences: sequence slot s owns entries
 * [s*maxPagesPerSequence, (s+1)*maxPagesPerSequence). Entry = kind << 28 | slot << 24 | page index in slab.
 * Each kind has its own PageStore (slabs, refcounts, free list); forks share full pages of either kind.
 * The table is rewritten with `queue.writeBuffer` only when a sequence's pages change.
 *
 * ## Step uniform (`KvStep`, 16 bytes, `pool.step`)
 *     struct KvStep { position: u32, tokens: u32, tableOffset: u32, length: u32 }
 * `position` is the first position this submit writes, `tokens` how many, `tableOffset` the sequence's slice of the
 * page table (in entries), `length = position + tokens` the sequence length after the step. The caller writes it
 * once per submit with `pool.writeStep(seq, position, tokens)`; every layer's append and attention dispatch binds
 * the same buffer, so the whole forward is prepared once and re-encoded every token with nothing allocated.
 * `tokens` must not exceed the maxTokens the submitted dispatches were prepared with (their grid): prepare one
 * graph for decode (maxTokens 1) and one for prefill chunks. Call `writeStep` once per submitted forward, in order.
 *
 * ## Capacity
 * In quant mode `reserve(seq, L)` only checks that L positions can fit in their final layout (f16 sink + window +
 * a page, quant for the rest; pages held keep their kind, so a flushed window stays quantized) with the pages free
 * now, and throws ContextOverflowError otherwise; pages are taken by `writeStep`, which throws ContextOverflowError,
 * before changing anything, when a step cannot get its pages. `pagesNeeded` bounds a whole run's peak instead.
 *
 * ## Wiring (see runtime/kv/paged-attention.ts)
 *     const pool = new KvPagePool(gpu, { layers, kvHeads, headDim, budgetBytes, kv: 'quant', sink, window });
 *     const kv = new PagedKvAttention(gpu, pool, { heads });      // kv.prepareLayer(layer, {q,k,v,output}, maxTokens)
 *     const seq = pool.createSequence();
 *     pool.writeStep(seq, seq.length, ids.length);                // before each submit; throws ContextOverflowError
 *     pool.fork(seq) / pool.truncate(seq, n) / pool.free(seq)     // branches share full pages copy-on-write
 */

import { type ContextLimit, InvalidRequestError } from '../../core/errors.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { prepareKvDemote, prepareKvPromote } from '../../kernels/kv-demote.ts';
import { decodePageEntry, KV_PAGE_KIND, type KvSequence } from './page-book.ts';
import {
  defaultQuantF16Bytes,
  FLUSH_BATCH_PAGES,
  type KvDemotion,
  KvPageLedger,
  type KvPoolOptions,
  type KvPoolStats,
  kvPoolGeometry,
} from './page-ledger.ts';
import { KvPageStorage } from './page-storage.ts';
import type { KvQuantPageLayout } from './quant-layout.ts';
import type { KvPageCounts, KvPoolMode } from './tiering.ts';

export {
  decodePageEntry,
  encodePageEntry,
  KV_PAGE_KIND,
  type KvKindStats,
  type KvPageKind,
  KvSequence,
} from './page-book.ts';
export {
  defaultQuantF16Bytes,
  FLUSH_BATCH_PAGES,
  type KvPoolOptions,
  type KvPoolStats,
  MAX_KV_SLABS,
} from './page-ledger.ts';
export { KV_STEP_BYTES } from './page-storage.ts';
export type { KvQuantRows, KvRowFormatOptions } from './quant-layout.ts';
export type { KvPageCounts, KvPoolMode } from './tiering.ts';

/**
 * A sequence copied out of GPU memory (`saveSequence`): its pages as they are (quant pages at their bits, f16 ones at
 * f16), their kinds and its length. Only the pool that saved it can restore it: the bytes are in its page layout and
 * under its rotations.
 */
export interface KvSequenceImage {
  readonly pool: KvPagePool;
  readonly length: number;
  /** KV_PAGE_KIND of each page, in order. */
  readonly kinds: Uint8Array;
  /** The pages' bytes, in order, each at its kind's page size. */
  readonly bytes: Uint8Array<ArrayBuffer>;
}

/** What the demotion kernel and the mixed attention need to know about quant pages: the layout and the jobs. */
export interface KvQuantLayout extends KvQuantPageLayout {
  /** [count, 0, 0, 0, src0, dst0, src1, dst1, ...]: this step's demotions (f16 entry → quant entry). */
  jobs: GPUBuffer;
}

/** The jobs buffer's words for `demotions`: [count, 0, 0, 0, src0, dst0, ...]. */
function jobWordsOf(demotions: readonly KvDemotion[], words = new Uint32Array(4 + 2 * demotions.length)): Uint32Array {
  words[0] = demotions.length;
  for (const [j, [source, target]] of demotions.entries()) {
    words[4 + 2 * j] = source;
    words[5 + 2 * j] = target;
  }
  return words;
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
  readonly mode: KvPoolMode;
  /** quant: whole f16 pages kept at the start of each sequence. */
  readonly sinkPages: number;
  /** quant: recent positions kept f16. */
  readonly window: number;
  /** quant: the layout of quant pages (null in f16 mode). */
  readonly quant: KvQuantLayout | null;
  /** Most positions one step writes (the prefill chunk): sizes the f16 peak of a running sequence. */
  readonly maxStepTokens: number;
  /**
   * Most demotions a step carries, whatever its size: as many as the largest step makes due (the demotion grid of
   * every graph). A demotion dispatch whose step has no job is left out, so a decode graph pays for the size only when
   * it demotes.
   */
  readonly maxStepDemotions: number;
  /** The page table of every sequence (u32 entries). */
  readonly pageTable: GPUBuffer;
  /** The KvStep uniform every KV kernel binds. */
  readonly step: GPUBuffer;

  private readonly gpu: GpuContext;
  private readonly ledger: KvPageLedger;
  private readonly storage: KvPageStorage;
  private readonly stepWords = new Uint32Array(4);
  /** [count, 0, 0, 0, src0, dst0, ...]: the last planned step's demotion jobs. */
  private readonly jobWords: Uint32Array<ArrayBuffer>;
  private jobsWritten = 0;
  /** Demotions since the pool was made (tests check the paths ran). */
  demotions = 0;
  promotions = 0;
  /** Pages demoted by `flush` (idle sequences) since the pool was made. */
  flushed = 0;

  /**
   * Whether a 'quant' pool's default f16 share, at most half the budget, holds prefill steps of `stepTokens` (a
   * bigger step needs more f16 pages at once); an 'f16' pool, or a given f16BudgetBytes, always does.
   */
  static holdsStep(options: KvPoolOptions, stepTokens: number): boolean {
    if ((options.kv ?? 'f16') !== 'quant' || options.f16BudgetBytes !== undefined) return true;
    return defaultQuantF16Bytes({ ...options, maxStepTokens: stepTokens }) <= Math.floor(options.budgetBytes / 2);
  }

  constructor(gpu: GpuContext, options: KvPoolOptions) {
    const geometry = kvPoolGeometry(
      options,
      Math.min(gpu.limits.maxStorageBufferBindingSize, gpu.limits.maxBufferSize),
    );
    this.gpu = gpu;
    this.layers = options.layers;
    this.kvHeads = options.kvHeads;
    this.headDim = options.headDim;
    this.pageTokens = geometry.pageTokens;
    this.pageWords = geometry.pageWords;
    this.pageBytes = geometry.pageWords * 4;
    this.maxStepTokens = geometry.maxStepTokens;
    // The events reach the storage once it exists: the ledger emits none while it is being made.
    const storage = (): KvPageStorage => this.storage;
    this.ledger = new KvPageLedger(geometry, {
      slabAdded: (store, slab) => storage().slabAdded(store, slab),
      slabRemoved: (store, slab) => storage().slabRemoved(store, slab),
      tableChanged: (seq, from, to) => storage().tableChanged(seq, from, to),
      pagesCopied: (pairs) => storage().pagesCopied(pairs),
      pagesPromoted: (pairs) => {
        storage().pagesPromoted(pairs);
        this.promotions += pairs.length;
      },
    });
    const { book, tiering } = this.ledger;
    this.maxSequences = book.maxSequences;
    this.maxPagesPerSequence = book.maxPagesPerSequence;
    this.maxStepDemotions = this.ledger.maxStepDemotions;
    this.mode = tiering.mode;
    this.sinkPages = tiering.sinkPages;
    this.window = tiering.window;
    this.jobWords = new Uint32Array(4 + 2 * Math.max(FLUSH_BATCH_PAGES, this.maxStepDemotions));
    this.storage = new KvPageStorage(gpu, book);
    this.storage.storeOf = (entry) => book.storeOf(entry);
    this.pageTable = this.storage.pageTable;
    this.step = this.storage.step;
    if (geometry.quant) {
      const jobs = this.storage.create({
        label: 'kv.demotions',
        size: this.jobWords.byteLength,
        usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST,
      });
      this.quant = { ...geometry.quant.layout, jobs };
      this.storage.promote = (pairs) => prepareKvPromote(gpu, 'kv.promote', this, pairs);
    } else {
      this.quant = null;
    }
  }

  /** Bumped whenever a slab is added or removed: bind groups made before it must be re-created. */
  get generation(): number {
    return this.storage.generation;
  }

  /** Word offset of K (kv = 0) or V (kv = 1) of `layer`, head 0, token 0 inside an f16 page. */
  layerOffsetWords(layer: number, kv: 0 | 1): number {
    return (layer * 2 + kv) * this.kvHeads * this.pageTokens * (this.headDim / 2);
  }

  /** The slabs to bind at the kernels' slab bindings 0..MAX_KV_SLABS-1 (placeholders where none exists yet). */
  /** What bounds a sequence that can hold at most `tokensAvailable` (the model's context or the budget). */
  limitAt(tokensAvailable: number): ContextLimit {
    return this.ledger.book.limitAt(tokensAvailable);
  }

  slabBindings(): GPUBuffer[] {
    return this.storage.slabBindings((slot) => this.ledger.book.storeOfSlot(slot));
  }

  /** Demotion jobs the last writeStep planned: the demotion dispatches of its forward have work only when > 0. */
  get stepDemotions(): number {
    return this.jobWords[0];
  }

  /** The most tokens one more sequence could hold now (free pages plus unallocated budget). */
  get tokensAvailable(): number {
    return this.ledger.tokensAvailable;
  }

  createSequence(): KvSequence {
    return this.ledger.createSequence();
  }

  /**
   * A new sequence with the same contents: full pages (of either kind) are shared (refcount + 1, copied on the first
   * write), a partly filled last page is copied on the GPU in the next submit.
   */
  fork(parent: KvSequence): KvSequence {
    return this.ledger.fork(parent);
  }

  free(seq: KvSequence): void {
    this.ledger.free(seq);
  }

  /**
   * Copies `seq`'s pages to host memory as they are (after the pending page work), for `restoreSequence` to bring
   * back bit for bit; `seq` itself is untouched. Pages past its length (reserved ahead) are left out. `stagingBytes`:
   * the largest staging buffer (default STAGING_BYTES; a longer sequence takes several).
   */
  async saveSequence(seq: KvSequence, options: { stagingBytes?: number } = {}): Promise<KvSequenceImage> {
    this.ledger.book.assertAlive(seq);
    const entries = seq.pages.slice(0, Math.ceil(seq.length / this.pageTokens));
    const kinds = Uint8Array.from(entries, (entry) => decodePageEntry(entry).kind);
    const length = seq.length;
    return { pool: this, length, kinds, bytes: await this.storage.readPages(entries, options.stagingBytes) };
  }

  /**
   * The bytes of some of `seq`'s pages (indexes into `seq.pages`, in the order given), as `saveSequence` copies them:
   * for a copy kept elsewhere that only adds the pages changed since it was made.
   */
  async readSequencePages(
    seq: KvSequence,
    pages: readonly number[],
    stagingBytes?: number,
  ): Promise<Uint8Array<ArrayBuffer>> {
    this.ledger.book.assertAlive(seq);
    const count = Math.ceil(seq.length / this.pageTokens);
    for (const page of pages) {
      if (!Number.isInteger(page) || page < 0 || page >= count) {
        throw new RangeError(`KV pool: page ${page} of a sequence of ${count} pages`);
      }
    }
    return this.storage.readPages(
      pages.map((page) => seq.pages[page]),
      stagingBytes,
    );
  }

  /** Bytes of one page of each kind (quant 0 in an f16 pool). */
  get pageBytesByKind(): { f16: number; quant: number } {
    return { f16: this.pageBytes, quant: this.quant ? this.quant.pageWords * 4 : 0 };
  }

  /**
   * What a page's bytes mean: the pool's geometry and its quant layout (formats, plan, boosted layers). Two pools
   * with the same key read each other's saved pages alike; the rotation the values were stored under is not part of
   * it (runtime/engine/stored-kv.ts binds that).
   */
  layoutKey(): string {
    const q = this.quant;
    return JSON.stringify({
      mode: this.mode,
      layers: this.layers,
      kvHeads: this.kvHeads,
      headDim: this.headDim,
      pageTokens: this.pageTokens,
      pageWords: this.pageWords,
      sinkPages: this.sinkPages,
      window: this.window,
      quant: q && {
        pageWords: q.pageWords,
        key: q.key,
        value: q.value,
        positionsPerRow: q.positionsPerRow,
        boostLayers: q.boostLayers,
        plan: q.plan,
      },
    });
  }

  /** Pages of each kind restoring `image` takes (compare with `pagesObtainable()`). */
  pagesToRestore(image: KvSequenceImage): KvPageCounts {
    let quant = 0;
    for (const kind of image.kinds) if (kind === KV_PAGE_KIND.quant) quant++;
    return { f16: image.kinds.length - quant, quant };
  }

  /**
   * A new sequence holding what `image` held, on pages of the same kinds; the bytes go up before any later submit.
   * Call it between steps. Throws ContextOverflowError, before taking anything, when the pages are not obtainable, and InvalidRequestError
   * for an image of another pool.
   */
  restoreSequence(image: KvSequenceImage): KvSequence {
    if (image.pool !== this) throw new InvalidRequestError('KV restore: the image was saved by another pool');
    // Pending page work (a flush's demotions) may read pages freed for it: it goes first, the bytes after it; the
    // last step's retiring pages are free once it is submitted (as releaseFreeSlabs, between steps).
    this.storage.submitPending();
    this.ledger.book.settleRetiring();
    const seq = this.ledger.book.adoptPages(image.kinds, image.length, () => this.tokensAvailable);
    this.storage.writePages(seq.pages, image.bytes);
    return seq;
  }

  /**
   * f16 mode: makes sure `seq` has pages for `newLength` positions (allocating, growing the pool if needed).
   * quant mode: checks that `newLength` positions fit in their final layout with the pages free now (pages are taken
   * step by step by writeStep). Does not change `seq.length`. Throws ContextOverflowError, before changing anything,
   * when the budget cannot hold it.
   */
  reserve(seq: KvSequence, newLength: number): void {
    this.ledger.reserve(seq, newLength);
  }

  /** Rolls `seq` back to `length` positions, releasing the pages past it. */
  truncate(seq: KvSequence, length: number): void {
    this.ledger.truncate(seq, length);
  }

  /**
   * Pages of each kind that writing `seq` from `position` up to `newLength` may take from the pool at its peak, in
   * steps of at most `maxStepTokens` (prefill chunks, then decode steps) as `writeStep` takes and demotes them; `seq`
   * null: a sequence created next. An upper bound: the pages `seq` holds from `position` on are not counted as its
   * own (the run truncates, copies or promotes them). Compare with `pagesObtainable()`.
   */
  pagesNeeded(seq: KvSequence | null, position: number, newLength: number): KvPageCounts {
    return this.ledger.pagesNeeded(seq, position, newLength);
  }

  /** Pages of each kind obtainable now: free ones, retiring ones (free at the next step) and unallocated budget. */
  pagesObtainable(): KvPageCounts {
    return this.ledger.pagesObtainable();
  }

  /** Full f16 pages of `seq` past its sink that only it holds: what `flush` would demote (quant mode). */
  flushablePages(seq: KvSequence): number {
    return this.ledger.flushablePages(seq);
  }

  /**
   * quant mode: demotes up to `maxPages` of an IDLE sequence's full f16 pages past its sink (oldest first: its recent
   * window) in the next submit, and frees them at once. The sink and a partly filled last page stay f16, and so do
   * pages shared with another sequence (demoting them for one owner frees nothing). The sequence keeps its contents,
   * the window at 2 bits as if it had aged out; a later rewrite of a flushed page promotes it, as after a rollback.
   * Limited by the quant pages obtainable. Returns the pages demoted.
   */
  flush(seq: KvSequence, maxPages = Number.POSITIVE_INFINITY): number {
    let pages = 0;
    for (const batch of this.ledger.flush(seq, maxPages, FLUSH_BATCH_PAGES)) {
      // A jobs buffer of the batch's own: the pool's holds the jobs of the step that will carry this work.
      const jobs = this.gpu.allocator.createStorage('kv.flush.jobs', 'scratch', jobWordsOf(batch));
      const dispatches = Array.from({ length: this.layers }, (_, layer) =>
        prepareKvDemote(this.gpu, 'kv.flush', { pool: this, layer, maxJobs: batch.length, jobs }),
      );
      dispatches[0].owned.push(jobs);
      this.storage.recordDispatches('kv.flush', dispatches);
      pages += batch.length;
    }
    this.flushed += pages;
    return pages;
  }

  /**
   * Destroys the trailing slabs of each kind none of whose pages is in use (the page ids of a slab are positional, so
   * only the last slabs can go), and a kind's copy bounce buffer once it has no slab. Call it between steps: it first
   * submits any pending page work (which may read those slabs), and returns the last step's retiring pages to the free
   * list (work already submitted keeps a destroyed buffer alive). Bind groups follow through `generation`. Returns
   * the bytes released.
   */
  releaseFreeSlabs(): number {
    this.storage.submitPending();
    const before = this.storage.releasedBytes;
    this.ledger.book.releaseFreeSlabs();
    return this.storage.releasedBytes - before;
  }

  /**
   * Prepares the next submit to write `tokens` positions of `seq` starting at `position` (<= seq.length; a smaller
   * position rewrites, as after a rollback): the ledger's bookkeeping of the step (pages taken, copied, promoted and
   * demoted; `seq.length = position + tokens`), then the step's demotion jobs and the KvStep uniform. The copies and
   * promotions are pending work, which the step's submit records first (`encodePending`). Allocation-free when no
   * page is needed.
   */
  writeStep(seq: KvSequence, position: number, tokens: number): void {
    const demotions = this.ledger.planStep(seq, position, tokens);
    if (this.quant) {
      jobWordsOf(demotions, this.jobWords);
      this.demotions += demotions.length;
      // Skip the write when the previous step also had none: decode writes it once per page, not per token.
      if (demotions.length > 0 || this.jobsWritten > 0) {
        this.gpu.device.queue.writeBuffer(this.quant.jobs, 0, this.jobWords, 0, 4 + 2 * demotions.length);
        this.jobsWritten = demotions.length;
      }
    }
    const w = this.stepWords;
    w[0] = position;
    w[1] = tokens;
    w[2] = seq.tableOffset;
    w[3] = position + tokens;
    this.gpu.device.queue.writeBuffer(this.step, 0, w);
  }

  /** `writeStep(seq, seq.length, tokens)`: the next `tokens` positions of `seq`. Returns the step's position. */
  beginStep(seq: KvSequence, tokens: number): number {
    const position = seq.length;
    this.writeStep(seq, position, tokens);
    return position;
  }

  /**
   * Records the pending page work (copies, promotions, flushed demotions) at the head of `encoder`: the step
   * runner calls it in every step's submit, before the forward that reads those pages.
   */
  encodePending(encoder: GPUCommandEncoder): void {
    this.storage.encodePending(encoder);
  }

  /**
   * Submits the pending page work now, in a submit of its own: for work outside the step runner that reads pages
   * (kernel harnesses, tests) right after a fork, a flush or a writeStep.
   */
  submitPending(): void {
    this.storage.submitPending();
  }

  stats(): KvPoolStats {
    return this.ledger.stats();
  }

  /**
   * Recomputes ownership from the live sequences and compares it with the refcounts and the free lists.
   * Returns the problems found (empty when consistent); tests call it after every operation.
   */
  audit(): string[] {
    return this.ledger.audit();
  }

  /** Makes `buffer` live as long as the pool (the rotation matrices of what it stores): released by destroy(). */
  adopt(buffer: GPUBuffer): void {
    this.storage.adopt(buffer);
  }

  /** Releases every GPU buffer of the pool; sequences become invalid. */
  destroy(): void {
    for (const seq of [...this.ledger.book.liveSequences()]) this.ledger.free(seq);
    this.storage.destroy();
  }
}
