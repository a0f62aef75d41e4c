/**
 * KvPagePool: the paged KV cache. One pool per loaded model; sequences own lists of pages.
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
 * Also `pageTokens` positions of one sequence for every layer, each row (one token's K or V of one layer, `width =
 * kvHeads*headDim` values) in the format of runtime/kv/quant-format.ts (codes, then one (lo, scale) f16 pair per group;
 * K and V may have different formats). Word layout:
 *
 *     [layer][kv: 0 = K, 1 = V][token in page][rowWords(layer, kv)]
 *
 * `quantPageWords = pageTokens * Σ_layers (keyRowWords + valueRowWords)`. Layers listed in `boostLayers` store K and
 * V at 4 bits, unclipped, in the K format's groups; the others use `keyFormat` / `valueFormat`: KITTY's boosted
 * precision at the grain of a layer, for the few layers whose 2-bit cache costs the model most (docs/kv-cache.md).
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
 *   page is filled with its dequantized values (one small submit) and replaces it, so history is never lost.
 * A long prompt prefilled chunk by chunk therefore ends up quantized except its sink and last window; peak f16 use of
 * a sequence is about sink + window + chunk + 2 pages. Pages of a prompt's last chunk leave the window only after it:
 * the first decode step demotes them all, in one dispatch per layer. (At two pages a step, as a decode step's own
 * size would allow, the 64 pages of a 1024-token chunk kept the first 32 decode steps paying for a demotion and for
 * reading f16 pages: Qwen3-4B's 2-bit decode at 32K took 9.4 ms a token (median) instead of 8.2, BENCH.md session 18.)
 * Measured (pool stats, bytesUsed / (tokens × layers × 2 × width)): Llama-3.2-1B shape (16 layers, 8 × 64, group 128,
 * sink 64, window 256, chunks of 128) 8.08 bits at 1K, 2.98 at 8K, 2.43 at 32K; quant rows alone are 2.25.
 * f16 pages are a separate share of the budget, so idle sequences each holding their sink and window can fill it
 * while quant pages are free. Whoever keeps idle sequences (runtime/engine/conversations.ts) asks
 * `pagesNeeded(seq, position, length)` (per kind, at the run's peak) against `pagesObtainable()` before a request,
 * and makes room: `flush(idle)` demotes an idle sequence's full window pages now (one submit; it keeps its contents,
 * the window at 2 bits as if it had aged out), and freeing a sequence returns pages of both kinds.
 *
 * ## Slabs
 * Pages live in GPU buffers ("slabs", category 'kv', each <= maxStorageBufferBindingSize), created one at a time as
 * pages are needed, never copied; `releaseFreeSlabs()` destroys trailing slabs none of whose pages is in use (the
 * conversation cache calls it once every conversation is deleted). Kernels bind MAX_KV_SLABS = 4 slab slots, so
 * every kernel stays at <= 7 storage bindings (4 slabs + page table + 2 activations) under the spec default of 8,
 * for both kinds together:
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

import { ContextOverflowError, InvalidRequestError } from '../../core/errors.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../../core/gpu/dispatch.ts';
import { prepareKvDemote, prepareKvPromote } from '../../kernels/kv-demote.ts';
import { codeWordsPerRow, type QuantRowFormat, rowWords, validateQuantRowFormat } from './quant-format.ts';

export const MAX_KV_SLABS = 4;
export const KV_STEP_BYTES = 16;
/** Pages one `flush` submit demotes at most (its jobs go through the same buffer as a step's). */
export const FLUSH_BATCH_PAGES = 64;

/** Page kinds; the code goes into the top 4 bits of a page-table entry. */
export const KV_PAGE_KIND = { f16: 0, quant: 1 } as const;
export type KvPageKind = keyof typeof KV_PAGE_KIND;
export type KvPoolMode = 'f16' | 'quant';

const ENTRY_KIND_SHIFT = 28;
const ENTRY_SLAB_SHIFT = 24;
const ENTRY_PAGE_MASK = 0xffffff;

export function encodePageEntry(kind: number, slab: number, page: number): number {
  return ((kind << ENTRY_KIND_SHIFT) | (slab << ENTRY_SLAB_SHIFT) | page) >>> 0;
}

export function decodePageEntry(entry: number): { kind: number; slab: number; page: number } {
  return { kind: entry >>> ENTRY_KIND_SHIFT, slab: (entry >>> ENTRY_SLAB_SHIFT) & 0xf, page: entry & ENTRY_PAGE_MASK };
}

/** A quantized row format without its width (the pool knows it: kvHeads × headDim). */
export type KvRowFormatOptions = Partial<Omit<QuantRowFormat, 'width'>>;

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
  /** quant: bytes of the budget for f16 pages (see the doc comment for the default). */
  f16BudgetBytes?: number;
  /**
   * quant: most positions one step writes (the prefill chunk); sizes the default f16 budget and the demotions every
   * step may carry (maxStepDemotions).
   */
  maxStepTokens?: number;
  /**
   * Rotation of what the cache stores (runtime/kv/rotation.ts; applied by `createKvAttention` around the pool):
   * 'hadamard', 'calibrated' (with `calibratedRotations`) or 'none' (default).
   */
  rotation?: 'hadamard' | 'calibrated' | 'none';
  /** f32 [layers × kvHeads × headDim × headDim] each (runtime/calibration/calibrate.ts); required with 'calibrated'. */
  calibratedRotations?: { key: Float32Array; value: Float32Array };
}

export interface KvKindStats {
  pageBytes: number;
  pagesUsed: number;
  pagesFree: number;
  pagesReserved: number;
  pagesBudget: number;
  bytesUsed: number;
  slabs: number;
}

/** A number of pages of each kind (quant is 0 in f16 mode). */
export interface KvPageCounts {
  f16: number;
  quant: number;
}

export interface KvPoolStats {
  pageTokens: number;
  /** Bytes of an f16 page. */
  pageBytes: number;
  /** Pages referenced by at least one sequence (both kinds). */
  pagesUsed: number;
  /** Pages in allocated slabs that nobody references (both kinds; retiring pages count as free). */
  pagesFree: number;
  /** Pages in allocated slabs (used + free). */
  pagesReserved: number;
  /** Pages the budget allows once every slab exists. */
  pagesBudget: number;
  /** Bytes of the used pages of both kinds. */
  bytesUsed: number;
  bytesReserved: number;
  /** Sum of the live sequences' lengths (shared pages counted once per sequence). */
  tokensHeld: number;
  sequences: number;
  slabs: number;
  mode: KvPoolMode;
  f16: KvKindStats;
  quant: KvKindStats;
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

/** The pages of one kind: slabs, refcounts and a free list (LIFO, so recently freed pages are reused first). */
class PageStore {
  readonly kind: number;
  readonly pageBytes: number;
  readonly pagesPerSlab: number;
  readonly maxPages: number;
  /** Slab slot of this store's first slab (the kernels' slab binding index). */
  readonly firstSlot: number;
  readonly maxSlabs: number;
  readonly slabs: GPUBuffer[] = [];
  readonly free: number[] = [];
  /** Released pages that a submitted-next step still reads (demotion sources): free at the next writeStep. */
  readonly retiring: number[] = [];
  /** Indexed by global page id = slab * pagesPerSlab + page. */
  readonly refcounts: Int32Array;
  allocatedPages = 0;
  usedPages = 0;

  constructor(
    kind: number,
    pageBytes: number,
    pagesPerSlab: number,
    maxPages: number,
    firstSlot: number,
    slabs: number,
  ) {
    this.kind = kind;
    this.pageBytes = pageBytes;
    this.pagesPerSlab = pagesPerSlab;
    this.maxPages = maxPages;
    this.firstSlot = firstSlot;
    this.maxSlabs = slabs;
    this.refcounts = new Int32Array(slabs * pagesPerSlab);
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

  stats(): KvKindStats {
    return {
      pageBytes: this.pageBytes,
      pagesUsed: this.usedPages,
      pagesFree: this.allocatedPages - this.usedPages,
      pagesReserved: this.allocatedPages,
      pagesBudget: this.maxPages,
      bytesUsed: this.usedPages * this.pageBytes,
      slabs: this.slabs.length,
    };
  }
}

/** One layer's K or V rows inside a quant page. */
export interface KvQuantRows {
  format: QuantRowFormat;
  rowWords: number;
  codeWords: number;
}

/** What the demotion kernel and the mixed attention need to know about quant pages. */
export interface KvQuantLayout {
  pageWords: number;
  /** The K and V formats of the layers not boosted. */
  key: QuantRowFormat;
  value: QuantRowFormat;
  /** Layers whose K and V use the boost format (ascending). */
  boostLayers: readonly number[];
  /** The rows of K (kv = 0) or V (kv = 1) of `layer`. */
  rows(layer: number, kv: 0 | 1): KvQuantRows;
  /** Word offset of K (kv = 0) or V (kv = 1) of `layer`, token 0 inside a quant page. */
  layerOffsetWords(layer: number, kv: 0 | 1): number;
  /** [count, 0, 0, 0, src0, dst0, src1, dst1, ...]: this step's demotions (f16 entry → quant entry). */
  jobs: GPUBuffer;
}

function resolveFormat(width: number, o: KvRowFormatOptions | undefined, name: string): QuantRowFormat {
  const f: QuantRowFormat = {
    width,
    bits: o?.bits ?? 2,
    groupSize: o?.groupSize ?? Math.min(128, width),
    clipQuantile: o?.clipQuantile ?? 1,
  };
  const problem = validateQuantRowFormat(f);
  if (problem) throw new InvalidRequestError(`KV pool: ${name} format: ${problem}`, { option: name });
  return f;
}

/**
 * The f16 share of a 'quant' pool unless f16BudgetBytes is given: the sink and window pages of up to two live
 * sequences, plus a step's new pages and the pages it demotes (which return to the free list only at the next step).
 */
export function defaultQuantF16Bytes(options: KvPoolOptions): number {
  const pageTokens = options.pageTokens ?? 16;
  const pageBytes = options.layers * 2 * options.kvHeads * pageTokens * options.headDim * 2;
  const sinkPages = Math.ceil((options.sink ?? 64) / pageTokens);
  const windowPages = Math.ceil((options.window ?? 256) / pageTokens) + 2;
  const sequencesWithF16 = Math.min(2, options.maxSequences ?? 2);
  const stepPages = Math.ceil((options.maxStepTokens ?? 512) / pageTokens);
  return (sequencesWithF16 * (sinkPages + windowPages) + 2 * stepPages + 2) * pageBytes;
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
  readonly rotation: 'hadamard' | 'calibrated' | 'none';
  readonly calibratedRotations: { key: Float32Array; value: Float32Array } | null;
  /** The page table of every sequence (u32 entries). */
  readonly pageTable: GPUBuffer;
  /** The KvStep uniform every KV kernel binds. */
  readonly step: GPUBuffer;
  /** Bumped whenever a slab is added: bind groups made before it must be re-created. */
  generation = 0;

  private readonly gpu: GpuContext;
  private readonly f16: PageStore;
  private readonly q: PageStore | null;
  private readonly placeholders: GPUBuffer[] = [];
  private readonly sequences = new Map<number, KvSequence>();
  private readonly freeSlots: number[] = [];
  private readonly stepWords = new Uint32Array(4);
  /** [count, 0, 0, 0, src0, dst0, ...]: the last planned step's demotion jobs (or a flush batch's). */
  private readonly jobWords: Uint32Array<ArrayBuffer>;
  private jobsWritten = 0;
  private readonly bounce = new Map<number, GPUBuffer>();
  private readonly adopted: GPUBuffer[] = [];
  private nextId = 1;
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
    const { layers, kvHeads, headDim, budgetBytes } = options;
    const pageTokens = options.pageTokens ?? 16;
    const maxStepTokens = options.maxStepTokens ?? 512;
    for (const [name, value] of Object.entries({ layers, kvHeads, headDim, pageTokens, maxStepTokens })) {
      if (!Number.isInteger(value) || value < 1) throw new InvalidRequestError(`KV pool: ${name} must be >= 1`);
    }
    if (headDim % 2 !== 0) throw new InvalidRequestError(`KV pool: headDim ${headDim} must be even (f16 pairs)`);
    this.gpu = gpu;
    this.layers = layers;
    this.kvHeads = kvHeads;
    this.headDim = headDim;
    this.pageTokens = pageTokens;
    this.maxStepTokens = maxStepTokens;
    this.jobWords = new Uint32Array(4 + 2 * Math.max(FLUSH_BATCH_PAGES, this.maxStepDemotions));
    this.pageWords = (layers * 2 * kvHeads * pageTokens * headDim) / 2;
    this.pageBytes = this.pageWords * 4;
    this.mode = options.kv ?? 'f16';
    this.rotation = options.rotation ?? 'none';
    if (this.rotation !== 'hadamard' && this.rotation !== 'none' && this.rotation !== 'calibrated') {
      throw new InvalidRequestError(
        `KV pool: rotation must be 'hadamard', 'calibrated' or 'none', got ${String(this.rotation)}`,
      );
    }
    this.calibratedRotations = options.calibratedRotations ?? null;
    const matrixFloats = layers * kvHeads * headDim * headDim;
    if (
      this.rotation === 'calibrated' &&
      (this.calibratedRotations?.key.length !== matrixFloats || this.calibratedRotations?.value.length !== matrixFloats)
    ) {
      throw new InvalidRequestError(
        `KV pool: calibrated rotations must hold ${matrixFloats} floats each for K and for V.`,
      );
    }
    if (this.mode !== 'f16' && this.mode !== 'quant') {
      throw new InvalidRequestError(`KV pool: kv must be 'f16' or 'quant', got ${String(this.mode)}`);
    }
    const sink = options.sink ?? 64;
    const window = options.window ?? 256;
    for (const [name, value] of Object.entries({ sink, window })) {
      if (!Number.isInteger(value) || value < 0) throw new InvalidRequestError(`KV pool: ${name} must be >= 0`);
    }
    this.sinkPages = this.mode === 'quant' ? Math.ceil(sink / pageTokens) : 0;
    this.window = window;

    const slabLimit = Math.min(
      gpu.limits.maxStorageBufferBindingSize,
      gpu.limits.maxBufferSize,
      options.maxSlabBytes ?? Number.POSITIVE_INFINITY,
    );
    const tooBig = (pageBytes: number, budget: number, what: string) =>
      new InvalidRequestError(
        `KV pool: one ${what} page is ${pageBytes} bytes (${pageTokens} tokens x ${layers} layers), more than ` +
          `${budget < pageBytes ? `the KV budget of ${budget} bytes` : `a GPU buffer binding (${slabLimit} bytes)`}. ` +
          'Raise kvBudgetBytes or use fewer pageTokens.',
        { pageBytes, budgetBytes, slabLimit },
      );
    const makeStore = (kind: number, pageBytes: number, budget: number, firstSlot: number, slabs: number) => {
      const perSlabLimit = Math.min(Math.floor(slabLimit / pageBytes), ENTRY_PAGE_MASK + 1);
      const budgetPages = Math.floor(budget / pageBytes);
      if (perSlabLimit < 1 || budgetPages < 1) throw tooBig(pageBytes, budget, kind === 0 ? 'f16' : 'quant');
      const maxPages = Math.min(budgetPages, slabs * perSlabLimit);
      const pagesPerSlab = Math.min(perSlabLimit, Math.ceil(maxPages / slabs));
      return new PageStore(kind, pageBytes, pagesPerSlab, maxPages, firstSlot, slabs);
    };

    if (this.mode === 'f16') {
      this.f16 = makeStore(KV_PAGE_KIND.f16, this.pageBytes, budgetBytes, 0, MAX_KV_SLABS);
      this.q = null;
      this.quant = null;
    } else {
      const width = kvHeads * headDim;
      const key = resolveFormat(width, options.keyFormat, 'keyFormat');
      const value = resolveFormat(width, options.valueFormat, 'valueFormat');
      const requested = Array.from(options.boostLayers ?? []); // holes of a sparse array become undefined
      for (const layer of requested) {
        if (typeof layer !== 'number' || !Number.isInteger(layer) || layer < 0 || layer >= layers) {
          throw new InvalidRequestError(
            `boostLayers names ${String(layer)}, not a layer of this model (0..${layers - 1}).`,
            { option: 'boostLayers' },
          );
        }
      }
      const boostLayers = [...new Set(requested)].sort((a, b) => a - b);
      if (boostLayers.length < requested.length) {
        throw new InvalidRequestError(`boostLayers lists a layer twice: [${requested.join(', ')}].`, {
          option: 'boostLayers',
        });
      }
      const boost = resolveFormat(width, { bits: 4, groupSize: key.groupSize, clipQuantile: 1 }, 'boostLayers');
      const rowsOf = (format: QuantRowFormat): KvQuantRows => ({
        format,
        rowWords: rowWords(format),
        codeWords: codeWordsPerRow(format),
      });
      const plain: [KvQuantRows, KvQuantRows] = [rowsOf(key), rowsOf(value)];
      const boosted: [KvQuantRows, KvQuantRows] = [rowsOf(boost), rowsOf(boost)];
      const layerRows = Array.from({ length: layers }, (_, l) => (boostLayers.includes(l) ? boosted : plain));
      // Word offset of each layer's K rows in a page; V follows its layer's K.
      const layerStart: number[] = [];
      let quantPageWords = 0;
      for (const [k, v] of layerRows) {
        layerStart.push(quantPageWords);
        quantPageWords += pageTokens * (k.rowWords + v.rowWords);
      }
      const f16Budget = Math.min(
        options.f16BudgetBytes ?? Math.min(defaultQuantF16Bytes(options), Math.floor(budgetBytes / 2)),
        budgetBytes - quantPageWords * 4,
      );
      this.f16 = makeStore(KV_PAGE_KIND.f16, this.pageBytes, f16Budget, 0, MAX_KV_SLABS / 2);
      this.q = makeStore(
        KV_PAGE_KIND.quant,
        quantPageWords * 4,
        budgetBytes - this.f16.maxPages * this.pageBytes,
        MAX_KV_SLABS / 2,
        MAX_KV_SLABS / 2,
      );
      const jobs = gpu.allocator.createBuffer({
        label: 'kv.demotions',
        category: 'kv',
        size: this.jobWords.byteLength,
        usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST,
      });
      this.quant = {
        pageWords: quantPageWords,
        key,
        value,
        boostLayers,
        rows: (layer, kv) => layerRows[layer][kv],
        layerOffsetWords: (layer, kv) => layerStart[layer] + kv * pageTokens * layerRows[layer][0].rowWords,
        jobs,
      };
    }

    this.maxSequences = options.maxSequences ?? 8;
    const maxPagesAll = this.f16.maxPages + (this.q?.maxPages ?? 0);
    const maxSequenceTokens = options.maxSequenceTokens ?? maxPagesAll * pageTokens;
    this.maxPagesPerSequence = Math.max(1, Math.min(maxPagesAll, Math.ceil(maxSequenceTokens / pageTokens)));
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

  /** Word offset of K (kv = 0) or V (kv = 1) of `layer`, head 0, token 0 inside an f16 page. */
  layerOffsetWords(layer: number, kv: 0 | 1): number {
    return (layer * 2 + kv) * this.kvHeads * this.pageTokens * (this.headDim / 2);
  }

  /** The slabs to bind at the kernels' slab bindings 0..MAX_KV_SLABS-1 (placeholders where none exists yet). */
  slabBindings(): GPUBuffer[] {
    return this.placeholders.map((placeholder, slot) => {
      const store = this.storeOfSlot(slot);
      return store?.slabs[slot - store.firstSlot] ?? placeholder;
    });
  }

  /** Demotion jobs the last writeStep planned: the demotion dispatches of its forward have work only when > 0. */
  get stepDemotions(): number {
    return this.jobWords[0];
  }

  /**
   * Most demotions a step carries, whatever its size: as many as the largest step makes due (the demotion grid of
   * every graph). A demotion dispatch whose step has no job is left out, so a decode graph pays for the size only when
   * it demotes.
   */
  get maxStepDemotions(): number {
    return Math.ceil(this.maxStepTokens / this.pageTokens) + 1;
  }

  /** The most tokens one more sequence could hold now (free pages plus unallocated budget). */
  get tokensAvailable(): number {
    return this.longestFor(0, 0);
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
   * write), a partly filled last page is copied now on the GPU.
   */
  fork(parent: KvSequence): KvSequence {
    this.assertAlive(parent);
    const full = Math.floor(parent.length / this.pageTokens);
    const partial = parent.length % this.pageTokens !== 0;
    const partialStore = partial ? this.storeOf(parent.pages[full]) : null;
    if (partialStore && partialStore.available() < 1) {
      throw new ContextOverflowError(parent.length, this.tokensAvailable, 'Forking needs one free KV page.');
    }
    const child = this.createSequence();
    for (let i = 0; i < full; i++) {
      const store = this.storeOf(parent.pages[i]);
      store.refcounts[store.globalId(parent.pages[i])]++;
      child.pages.push(parent.pages[i]);
    }
    if (partialStore) {
      const copy = this.allocatePage(partialStore);
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
   * f16 mode: makes sure `seq` has pages for `newLength` positions (allocating, growing the pool if needed).
   * quant mode: checks that `newLength` positions fit in their final layout with the pages free now (pages are taken
   * step by step by writeStep). Does not change `seq.length`. Throws ContextOverflowError, before changing anything,
   * when the budget cannot hold it.
   */
  reserve(seq: KvSequence, newLength: number): void {
    this.assertAlive(seq);
    if (this.q) {
      const needed = Math.ceil(newLength / this.pageTokens);
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
        if (this.storeOf(seq.pages[i]) === this.f16) demoted++;
      }
      const fits =
        needed <= this.maxPagesPerSequence &&
        newF16 - demoted <= this.f16.available() + this.f16.retiring.length &&
        newQuant + demoted <= this.q.available();
      if (!fits) throw this.overflow(seq, newLength);
      return;
    }
    const needed = Math.ceil(newLength / this.pageTokens) - seq.pages.length;
    if (needed <= 0) return;
    this.checkCapacity(seq, newLength, needed);
    const start = seq.pages.length;
    for (let i = 0; i < needed; i++) seq.pages.push(this.allocatePage(this.f16));
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
   * Pages of each kind that writing `seq` from `position` up to `newLength` may take from the pool at its peak, in
   * steps of at most `maxStepTokens` (prefill chunks, then decode steps) as `writeStep` takes and demotes them; `seq`
   * null: a sequence created next. An upper bound: the pages `seq` holds from `position` on are not counted as its
   * own (the run truncates, copies or promotes them). Compare with `pagesObtainable()`. In quant mode the f16 peak
   * is the sink, the window, the previous step's pages not yet old enough to demote and the step's own new pages
   * (one more where it starts inside a page it must copy or promote); pages it keeps f16 from before count toward it.
   */
  pagesNeeded(seq: KvSequence | null, position: number, newLength: number): KvPageCounts {
    if (seq) this.assertAlive(seq);
    if (!Number.isInteger(position) || !Number.isInteger(newLength) || position < 0 || newLength < position) {
      throw new InvalidRequestError(`KV pages needed: positions ${position}..${newLength} are not a range`);
    }
    const P = this.pageTokens;
    const keep = seq ? Math.min(seq.pages.length, Math.floor(Math.min(position, seq.length) / P)) : 0;
    let keptQuant = 0;
    for (let i = 0; i < keep; i++) if (this.storeOf((seq as KvSequence).pages[i]) !== this.f16) keptQuant++;
    const keptF16 = keep - keptQuant;
    // Every page past the kept ones is taken at most once over the whole run.
    const fresh = Math.max(0, Math.ceil(newLength / P) - keep);
    if (!this.q) return { f16: fresh, quant: 0 };
    const chunk = Math.ceil(this.maxStepTokens / P);
    // The worst case runtime/kv/pool-pressure.test.ts finds is one page less: a page of margin.
    const peak = this.sinkPages + Math.ceil(this.window / P) + 2 * chunk + 2;
    const f16 = Math.min(fresh, Math.max(peak - keptF16, chunk + 2));
    // Demotion quantizes pages [sinkPages, floor((step position - window) / P)), the kept f16 ones among them too,
    // never the ones kept quant again.
    const quant = Math.max(0, Math.floor((newLength - this.window) / P) - this.sinkPages - keptQuant);
    return { f16, quant };
  }

  /** Pages of each kind obtainable now: free ones, retiring ones (free at the next step) and unallocated budget. */
  pagesObtainable(): KvPageCounts {
    const of = (store: PageStore | null) => (store ? store.available() + store.retiring.length : 0);
    return { f16: of(this.f16), quant: of(this.q) };
  }

  /** Full f16 pages of `seq` past its sink that only it holds: what `flush` would demote (quant mode). */
  flushablePages(seq: KvSequence): number {
    this.assertAlive(seq);
    return this.q ? this.flushCandidates(seq, Number.POSITIVE_INFINITY).length : 0;
  }

  /**
   * quant mode: demotes up to `maxPages` of an IDLE sequence's full f16 pages past its sink (oldest first: its recent
   * window), now, in one submit per FLUSH_BATCH_PAGES pages, and frees them at once. The sink and a partly
   * filled last page stay f16, and so do pages shared with another sequence (demoting them for one owner frees
   * nothing). The sequence keeps its contents, the window at 2 bits as if it had aged out; a later rewrite of a
   * flushed page promotes it, as after a rollback. Limited by the quant pages obtainable. Safe between any two calls
   * (the jobs buffer of a step written but not yet submitted is put back). Returns the pages demoted.
   */
  flush(seq: KvSequence, maxPages = Number.POSITIVE_INFINITY): number {
    this.assertAlive(seq);
    const quant = this.quant;
    const q = this.q;
    if (!quant || !q) return 0;
    const indices = this.flushCandidates(seq, Math.min(maxPages, q.available()));
    for (let from = 0; from < indices.length; from += FLUSH_BATCH_PAGES) {
      const batch = indices.slice(from, from + FLUSH_BATCH_PAGES);
      const jobs = new Uint32Array(4 + 2 * batch.length);
      jobs[0] = batch.length;
      const sources: number[] = [];
      for (const [j, i] of batch.entries()) {
        const target = this.allocatePage(q);
        jobs[4 + 2 * j] = seq.pages[i];
        jobs[5 + 2 * j] = target;
        sources.push(seq.pages[i]);
        seq.pages[i] = target;
      }
      this.gpu.device.queue.writeBuffer(quant.jobs, 0, jobs);
      const dispatches = Array.from({ length: this.layers }, (_, layer) =>
        prepareKvDemote(this.gpu, 'kv.flush', { pool: this, layer, maxJobs: batch.length }),
      );
      submitDispatches(this.gpu, 'kv.flush', dispatches);
      releaseDispatches(this.gpu, dispatches);
      // The submit above reads the sources: anything that reuses them is queued after it.
      for (const source of sources) this.releasePage(source);
      this.uploadTable(seq, batch[0], batch[batch.length - 1] + 1);
    }
    if (indices.length > 0) {
      // Put back the jobs of the last writeStep, in case its forward is still to be submitted.
      this.gpu.device.queue.writeBuffer(quant.jobs, 0, this.jobWords, 0, 4 + 2 * this.jobWords[0]);
    }
    this.flushed += indices.length;
    return indices.length;
  }

  /**
   * Destroys the trailing slabs of each kind none of whose pages is in use (the page ids of a slab are positional, so
   * only the last slabs can go), and a kind's copy bounce buffer once it has no slab. Call it between steps, once the
   * forward of the last `writeStep` is submitted (as `writeStep` itself, it first returns that step's retiring pages
   * to the free list; work already submitted keeps a destroyed buffer alive). Bind groups follow through
   * `generation`. Returns the bytes released.
   */
  releaseFreeSlabs(): number {
    let released = 0;
    for (const store of this.stores()) {
      for (const id of store.retiring) store.free.push(id);
      store.retiring.length = 0;
      while (store.slabs.length > 0) {
        const slab = store.slabs.length - 1;
        const first = slab * store.pagesPerSlab;
        let busy = false;
        for (let id = first; id < store.allocatedPages && !busy; id++) busy = store.refcounts[id] !== 0;
        if (busy) break;
        const buffer = store.slabs.pop() as GPUBuffer;
        released += buffer.size;
        this.gpu.allocator.release(buffer);
        for (let i = store.free.length - 1; i >= 0; i--) if (store.free[i] >= first) store.free.splice(i, 1);
        store.allocatedPages = first;
        this.generation++;
      }
      const bounce = this.bounce.get(store.kind);
      if (store.slabs.length === 0 && bounce) {
        released += bounce.size;
        this.gpu.allocator.release(bounce);
        this.bounce.delete(store.kind);
      }
    }
    return released;
  }

  /**
   * Prepares the next submit to write `tokens` positions of `seq` starting at `position` (<= seq.length; a smaller
   * position rewrites, as after a rollback): demotes pages that left the window (quant mode), reserves pages,
   * copies shared pages it would write (promoting quant ones), sets `seq.length = position + tokens` and writes the
   * KvStep uniform. Allocation-free when no page is needed.
   */
  writeStep(seq: KvSequence, position: number, tokens: number): void {
    this.assertAlive(seq);
    if (!Number.isInteger(position) || position < 0 || position > seq.length) {
      throw new InvalidRequestError(`KV step: position ${position} must be within 0..${seq.length} (no gaps)`);
    }
    if (!Number.isInteger(tokens) || tokens < 1)
      throw new InvalidRequestError(`KV step: tokens ${tokens} must be >= 1`);
    // The previous submit, which read the retiring pages, precedes anything this step submits.
    for (const store of this.stores()) {
      for (const id of store.retiring) store.free.push(id);
      store.retiring.length = 0;
    }
    const end = position + tokens;
    const first = Math.floor(position / this.pageTokens);
    const last = Math.ceil(end / this.pageTokens);
    // Pages this step writes that it must replace: shared ones (copy-on-write) and quant ones (promotion).
    let f16Needed = Math.max(0, last - seq.pages.length);
    let rewrite = false;
    for (let i = first; i < Math.min(last, seq.pages.length); i++) {
      const store = this.storeOf(seq.pages[i]);
      if (store !== this.f16 || store.refcounts[store.globalId(seq.pages[i])] > 1) {
        f16Needed++;
        rewrite = true;
      }
    }
    if (Math.ceil(end / this.pageTokens) > this.maxPagesPerSequence || f16Needed > this.f16.available()) {
      if (this.q) throw this.overflow(seq, end);
      this.checkCapacity(seq, end, f16Needed, first);
    }
    const demote = this.q ? this.planDemotions(seq, position) : [];
    if (rewrite) this.rewritePages(seq, first, Math.min(last, seq.pages.length));
    const start = seq.pages.length;
    while (seq.pages.length < last) seq.pages.push(this.allocatePage(this.f16));
    this.uploadTable(seq, start, seq.pages.length);
    if (this.q) this.startDemotions(seq, demote);
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
    const f = this.f16.stats();
    const q = this.q?.stats() ?? {
      pageBytes: 0,
      pagesUsed: 0,
      pagesFree: 0,
      pagesReserved: 0,
      pagesBudget: 0,
      bytesUsed: 0,
      slabs: 0,
    };
    return {
      pageTokens: this.pageTokens,
      pageBytes: this.pageBytes,
      pagesUsed: f.pagesUsed + q.pagesUsed,
      pagesFree: f.pagesFree + q.pagesFree,
      pagesReserved: f.pagesReserved + q.pagesReserved,
      pagesBudget: f.pagesBudget + q.pagesBudget,
      bytesUsed: f.bytesUsed + q.bytesUsed,
      bytesReserved: f.pagesReserved * f.pageBytes + q.pagesReserved * q.pageBytes,
      tokensHeld,
      sequences: this.sequences.size,
      slabs: f.slabs + q.slabs,
      mode: this.mode,
      f16: f,
      quant: q,
    };
  }

  /**
   * Recomputes ownership from the live sequences and compares it with the refcounts and the free lists.
   * Returns the problems found (empty when consistent); tests call it after every operation.
   */
  audit(): string[] {
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
        if (store !== this.f16 && (i < this.sinkPages || (i + 1) * this.pageTokens > seq.length))
          problems.push(`sequence ${seq.id}: page ${i} is quantized inside the sink or not full`);
      }
    }
    for (const store of this.stores()) {
      const name = store.kind === 0 ? 'f16' : 'quant';
      const owned = counts.get(store) as Int32Array;
      const inFree = new Uint8Array(store.refcounts.length);
      for (const id of [...store.free, ...store.retiring]) {
        if (inFree[id]) problems.push(`${name} page ${id} is twice in the free lists`);
        inFree[id] = 1;
      }
      let used = 0;
      for (let id = 0; id < store.allocatedPages; id++) {
        if (owned[id] !== store.refcounts[id])
          problems.push(`${name} page ${id}: refcount ${store.refcounts[id]}, owners ${owned[id]}`);
        if (owned[id] > 0) used++;
        if ((owned[id] === 0) !== (inFree[id] === 1))
          problems.push(`${name} page ${id}: ${owned[id]} owners but ${inFree[id] ? 'in' : 'not in'} the free lists`);
      }
      if (used !== store.usedPages) problems.push(`${name}: usedPages ${store.usedPages}, counted ${used}`);
      if (store.free.length + store.retiring.length + used !== store.allocatedPages)
        problems.push(`${name}: free + used != allocated`);
    }
    return problems;
  }

  /** Makes `buffer` live as long as the pool (the rotation matrices of what it stores): released by destroy(). */
  adopt(buffer: GPUBuffer): void {
    this.adopted.push(buffer);
  }

  /** Releases every GPU buffer of the pool; sequences become invalid. */
  destroy(): void {
    for (const seq of [...this.sequences.values()]) this.free(seq);
    const buffers = [...this.f16.slabs, ...(this.q?.slabs ?? []), ...this.placeholders, this.pageTable, this.step];
    if (this.quant) buffers.push(this.quant.jobs);
    for (const b of [...buffers, ...this.bounce.values(), ...this.adopted]) this.gpu.allocator.release(b);
    this.bounce.clear();
    this.adopted.length = 0;
    this.f16.slabs.length = 0;
    if (this.q) this.q.slabs.length = 0;
  }

  private stores(): PageStore[] {
    return this.q ? [this.f16, this.q] : [this.f16];
  }

  private storeOf(entry: number): PageStore {
    return entry >>> ENTRY_KIND_SHIFT === KV_PAGE_KIND.quant && this.q ? this.q : this.f16;
  }

  private storeOfSlot(slot: number): PageStore | null {
    for (const store of this.stores()) {
      if (slot >= store.firstSlot && slot < store.firstSlot + store.maxSlabs) return store;
    }
    return null;
  }

  private assertAlive(seq: KvSequence): void {
    if (!seq.alive || this.sequences.get(seq.id) !== seq) {
      throw new InvalidRequestError(`KV sequence ${seq.id} was freed or belongs to another pool`);
    }
  }

  /** quant mode: the f16 and quant pages a sequence of `length` positions holds once its old pages are demoted. */
  private layoutPages(length: number): { f16: number; quant: number } {
    const pages = Math.ceil(length / this.pageTokens);
    const quant = Math.max(0, Math.floor((length - this.window) / this.pageTokens) - this.sinkPages - 1);
    return { f16: pages - quant, quant };
  }

  private heldPages(seq: KvSequence): { f16: number; quant: number } {
    let quant = 0;
    for (const e of seq.pages) if (this.storeOf(e) !== this.f16) quant++;
    return { f16: seq.pages.length - quant, quant };
  }

  /** The longest a sequence holding `f16Held`/`quantHeld` pages could get with what is free now. */
  private longestFor(f16Held: number, quantHeld: number): number {
    const f16 = f16Held + this.f16.available() + this.f16.retiring.length;
    let pages: number;
    if (!this.q) pages = f16;
    else {
      // Steady state needs sink + window + 2 f16 pages; the rest can be quantized.
      const f16Steady = this.sinkPages + Math.ceil(this.window / this.pageTokens) + 2;
      pages = f16 < f16Steady ? f16 : f16Steady + quantHeld + this.q.available();
    }
    return Math.min(pages, this.maxPagesPerSequence) * this.pageTokens;
  }

  private overflow(seq: KvSequence, newLength: number): ContextOverflowError {
    const held = this.heldPages(seq);
    const available = Math.min(this.longestFor(held.f16, held.quant), newLength - 1);
    return new ContextOverflowError(newLength, Math.max(0, available));
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

  /** Indices of `seq`'s f16 pages that leave the window at this step (oldest first, as many as the step carries). */
  private planDemotions(seq: KvSequence, position: number): number[] {
    const q = this.q as PageStore;
    const limit = Math.floor((position - this.window) / this.pageTokens);
    const out: number[] = [];
    const max = Math.min(this.maxStepDemotions, q.available());
    for (let i = this.sinkPages; i < Math.min(limit, seq.pages.length) && out.length < max; i++) {
      if (this.storeOf(seq.pages[i]) === this.f16) out.push(i);
    }
    return out;
  }

  /** Indices of `seq`'s full, unshared f16 pages past the sink, oldest first, at most `max`. */
  private flushCandidates(seq: KvSequence, max: number): number[] {
    const out: number[] = [];
    const full = Math.min(seq.pages.length, Math.floor(seq.length / this.pageTokens));
    for (let i = this.sinkPages; i < full && out.length < max; i++) {
      const entry = seq.pages[i];
      if (this.storeOf(entry) === this.f16 && this.f16.refcounts[this.f16.globalId(entry)] === 1) out.push(i);
    }
    return out;
  }

  /** Allocates the quant pages, writes the jobs buffer, switches the entries and retires the f16 pages. */
  private startDemotions(seq: KvSequence, indices: readonly number[]): void {
    const quant = this.quant as KvQuantLayout;
    const w = this.jobWords;
    w[0] = indices.length;
    for (const [j, i] of indices.entries()) {
      const source = seq.pages[i];
      const target = this.allocatePage(this.q as PageStore);
      w[4 + 2 * j] = source;
      w[5 + 2 * j] = target;
      seq.pages[i] = target;
      this.releasePage(source, true);
      this.uploadTable(seq, i, i + 1);
    }
    this.demotions += indices.length;
    // Skip the write when the previous step also had none: decode writes it once per page, not per token.
    if (indices.length > 0 || this.jobsWritten > 0) {
      this.gpu.device.queue.writeBuffer(quant.jobs, 0, w, 0, 4 + 2 * indices.length);
      this.jobsWritten = indices.length;
    }
  }

  private allocatePage(store: PageStore): number {
    if (store.free.length === 0) this.growSlab(store);
    const id = store.free.pop();
    if (id === undefined) throw new ContextOverflowError(0, 0, 'KV pool bookkeeping error: no page after growth.');
    store.refcounts[id] = 1;
    store.usedPages++;
    return store.entryOf(id);
  }

  /** Drops one reference; `retire`: a submit still to come reads the page, so it is reusable only after the next step. */
  private releasePage(entry: number, retire = false): void {
    const store = this.storeOf(entry);
    const id = store.globalId(entry);
    if (--store.refcounts[id] === 0) {
      (retire ? store.retiring : store.free).push(id);
      store.usedPages--;
    }
  }

  private growSlab(store: PageStore): void {
    const slab = store.slabs.length;
    const pages = Math.min(store.pagesPerSlab, store.maxPages - store.allocatedPages);
    if (slab >= store.maxSlabs || pages < 1) return;
    store.slabs.push(
      this.gpu.allocator.createBuffer({
        label: `kv.${store.kind === 0 ? 'f16' : 'quant'}.slab${slab}`,
        category: 'kv',
        // vec4 loads: a multiple of 16 bytes.
        size: Math.ceil((pages * store.pageBytes) / 16) * 16,
        usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC,
      }),
    );
    // Push in reverse so pages are handed out in increasing order.
    for (let p = pages - 1; p >= 0; p--) store.free.push(slab * store.pagesPerSlab + p);
    store.allocatedPages += pages;
    this.generation++;
  }

  /**
   * Replaces the pages in seq.pages[from, to) that this step would write but may not: shared f16 pages by private
   * copies, quant pages by private f16 pages holding their dequantized values. Capacity was checked by the caller.
   */
  private rewritePages(seq: KvSequence, from: number, to: number): void {
    const copies: Array<[number, number]> = [];
    const promotions: Array<[number, number]> = [];
    for (let i = from; i < to; i++) {
      const entry = seq.pages[i];
      const store = this.storeOf(entry);
      if (store === this.f16 && store.refcounts[store.globalId(entry)] <= 1) continue;
      const copy = this.allocatePage(this.f16);
      (store === this.f16 ? copies : promotions).push([entry, copy]);
      // The copy reads the old page in a submit made now: it may go back to the free list at once.
      this.releasePage(entry);
      seq.pages[i] = copy;
    }
    this.copyPages(copies);
    if (promotions.length > 0) {
      const dispatches = prepareKvPromote(this.gpu, 'kv.promote', this, promotions);
      submitDispatches(this.gpu, 'kv.promote', dispatches);
      releaseDispatches(this.gpu, dispatches);
      this.promotions += promotions.length;
    }
    this.uploadTable(seq, from, to);
  }

  /** Copies pages of one kind (pairs of entries of the same kind). */
  private copyPages(pairs: ReadonlyArray<readonly [number, number]>): void {
    if (pairs.length === 0) return;
    const encoder = this.gpu.device.createCommandEncoder({ label: 'kv.copyPages' });
    for (const [src, dst] of pairs) {
      const store = this.storeOf(src);
      const s = decodePageEntry(src);
      const d = decodePageEntry(dst);
      const bytes = store.pageBytes;
      const from = store.slabs[s.slab - store.firstSlot];
      const to = store.slabs[d.slab - store.firstSlot];
      if (from !== to) {
        encoder.copyBufferToBuffer(from, s.page * bytes, to, d.page * bytes, bytes);
        continue;
      }
      // WebGPU forbids copies within one buffer: go through a one-page bounce buffer.
      let bounce = this.bounce.get(store.kind);
      if (!bounce) {
        bounce = this.gpu.allocator.createBuffer({
          label: `kv.copyBounce${store.kind}`,
          category: 'kv',
          size: bytes,
          usage: GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
        });
        this.bounce.set(store.kind, bounce);
      }
      encoder.copyBufferToBuffer(from, s.page * bytes, bounce, 0, bytes);
      encoder.copyBufferToBuffer(bounce, 0, to, d.page * bytes, bytes);
    }
    this.gpu.device.queue.submit([encoder.finish()]);
  }

  private uploadTable(seq: KvSequence, from: number, to: number): void {
    if (to <= from) return;
    const entries = Uint32Array.from(seq.pages.slice(from, to));
    this.gpu.device.queue.writeBuffer(this.pageTable, (seq.tableOffset + from) * 4, entries);
  }
}
