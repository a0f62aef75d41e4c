/**
 * The paged cache's GPU memory: the slabs that hold the pages (category 'kv', each <= maxStorageBufferBindingSize,
 * created one at a time as pages are needed, never copied), the one page table of every sequence, the KvStep uniform
 * and the demotion jobs. It carries out what the bookkeeping (runtime/kv/page-book.ts) tells it.
 *
 * It submits nothing of its own: page copies and promotions are recorded as pending work, which the step runner
 * records at the head of the next step's submit (`encodePending`), before the forward that may read them; a caller
 * that needs them done outside a step submits them explicitly (`submitPending`). Table entries and uniforms go up
 * with `queue.writeBuffer`, which the queue orders before any later submit.
 */
import type { GpuContext } from '../../core/gpu/device.ts';
import { encodeDispatches, type PreparedDispatch, releaseDispatches } from '../../core/gpu/dispatch.ts';
import { decodePageEntry, type KvSequence, type PageBookEvents, type PageStore } from './page-book.ts';
import { MAX_KV_SLABS } from './page-ledger.ts';

export const KV_STEP_BYTES = 16;

/** Most bytes one staging buffer of a sequence's read-back holds (bigger sequences take several). */
export const STAGING_BYTES = 32 * 2 ** 20;

/** GPU work the bookkeeping asked for, recorded into the next submit. */
interface PendingWork {
  encode(encoder: GPUCommandEncoder): void;
  /** Buffers of its own (dispatch parameters, jobs), released once the submit carrying it is made. */
  release(): void;
}

export class KvPageStorage implements PageBookEvents {
  /** The page table of every sequence (u32 entries). */
  readonly pageTable: GPUBuffer;
  /** The KvStep uniform every KV kernel binds. */
  readonly step: GPUBuffer;
  /** Bumped whenever a slab is added or removed: bind groups made before it must be re-created. */
  generation = 0;
  private readonly gpu: GpuContext;
  private readonly slabs = new Map<PageStore, GPUBuffer[]>();
  private readonly placeholders: GPUBuffer[] = [];
  private readonly bounce = new Map<number, GPUBuffer>();
  private readonly adopted: GPUBuffer[] = [];
  private readonly owned: GPUBuffer[] = [];
  private pending: PendingWork[] = [];
  /** Work recorded into a submit that its caller is about to make: released at the next call that records or submits. */
  private recorded: PendingWork[] = [];
  /** The store of a page entry (set by the pool once its book exists). */
  storeOf: (entry: number) => PageStore = () => {
    throw new RangeError('KV storage: no page book attached');
  };
  /** Promotions: dispatches that dequantize quant pages into f16 pages (set by the pool, which knows the layout). */
  promote: ((pairs: ReadonlyArray<readonly [number, number]>) => PreparedDispatch[]) | null = null;

  constructor(gpu: GpuContext, shape: { maxSequences: number; maxPagesPerSequence: number }) {
    this.gpu = gpu;
    this.pageTable = this.create({
      label: 'kv.pageTable',
      size: shape.maxSequences * shape.maxPagesPerSequence * 4,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC,
    });
    this.step = this.create({
      label: 'kv.step',
      size: KV_STEP_BYTES,
      usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
    });
    // Distinct buffers: Dawn rejects one buffer bound to two writable storage bindings.
    for (let i = 0; i < MAX_KV_SLABS; i++) {
      this.placeholders.push(
        this.create({ label: `kv.slab${i}.placeholder`, size: 16, usage: GPUBufferUsage.STORAGE }),
      );
    }
  }

  /** A buffer of category 'kv' that lives as long as the storage. */
  create(request: { label: string; size: number; usage: GPUBufferUsageFlags }): GPUBuffer {
    const buffer = this.gpu.allocator.createBuffer({ ...request, category: 'kv' });
    this.owned.push(buffer);
    return buffer;
  }

  /** Makes `buffer` live as long as the storage (e.g. the rotation matrices of what it stores). */
  adopt(buffer: GPUBuffer): void {
    this.adopted.push(buffer);
  }

  /** The slab buffer of `store`'s slab `slab`. */
  slab(store: PageStore, slab: number): GPUBuffer {
    return (this.slabs.get(store) ?? [])[slab];
  }

  /** The slabs to bind at the kernels' slab slots 0..MAX_KV_SLABS-1 (placeholders where none exists yet). */
  slabBindings(storeOfSlot: (slot: number) => PageStore | null): GPUBuffer[] {
    return this.placeholders.map((placeholder, slot) => {
      const store = storeOfSlot(slot);
      return (store && this.slabs.get(store)?.[slot - store.firstSlot]) ?? placeholder;
    });
  }

  slabAdded(store: PageStore, slab: number): void {
    const pages = store.allocatedPages - slab * store.pagesPerSlab;
    const buffers = this.slabs.get(store) ?? [];
    this.slabs.set(store, buffers);
    buffers[slab] = this.gpu.allocator.createBuffer({
      label: `kv.${store.name}.slab${slab}`,
      category: 'kv',
      // vec4 loads: a multiple of 16 bytes.
      size: Math.ceil((pages * store.pageBytes) / 16) * 16,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC,
    });
    this.generation++;
  }

  /** Bytes released by slabRemoved since the pool was made (the pool reports them per call). */
  releasedBytes = 0;

  slabRemoved(store: PageStore, slab: number): void {
    const buffers = this.slabs.get(store) ?? [];
    const buffer = buffers.pop();
    if (!buffer || buffers.length !== slab) throw new RangeError(`KV storage: slab ${slab} is not the last one`);
    this.releasedBytes += buffer.size;
    this.gpu.allocator.release(buffer);
    const bounce = this.bounce.get(store.kind);
    if (buffers.length === 0 && bounce) {
      this.releasedBytes += bounce.size;
      this.gpu.allocator.release(bounce);
      this.bounce.delete(store.kind);
    }
    this.generation++;
  }

  tableChanged(seq: KvSequence, from: number, to: number): void {
    if (to <= from) return;
    const entries = Uint32Array.from(seq.pages.slice(from, to));
    this.gpu.device.queue.writeBuffer(this.pageTable, (seq.tableOffset + from) * 4, entries);
  }

  /** Copies pages of one kind (pairs of entries of the same kind), recorded into the next submit. */
  pagesCopied(pairs: ReadonlyArray<readonly [number, number]>): void {
    if (pairs.length === 0) return;
    const copies = pairs.map(([src, dst]) => {
      const store = this.storeOf(src);
      return { store, s: decodePageEntry(src), d: decodePageEntry(dst) };
    });
    this.pending.push({
      encode: (encoder) => {
        for (const { store, s, d } of copies) {
          const bytes = store.pageBytes;
          const from = this.slab(store, s.slab - store.firstSlot);
          const to = this.slab(store, d.slab - store.firstSlot);
          if (from !== to) {
            encoder.copyBufferToBuffer(from, s.page * bytes, to, d.page * bytes, bytes);
            continue;
          }
          // WebGPU forbids copies within one buffer: go through a one-page bounce buffer.
          const bounce = this.bounceFor(store);
          encoder.copyBufferToBuffer(from, s.page * bytes, bounce, 0, bytes);
          encoder.copyBufferToBuffer(bounce, 0, to, d.page * bytes, bytes);
        }
      },
      release: () => {},
    });
  }

  /**
   * The bytes of the pages `entries` (in order, each at its kind's page size), read back after the pending page work:
   * one copy per run of pages adjacent in one slab, through staging buffers of at most `stagingBytes`.
   */
  async readPages(entries: readonly number[], stagingBytes = STAGING_BYTES): Promise<Uint8Array<ArrayBuffer>> {
    // Buffer copies move whole words.
    if (!Number.isInteger(stagingBytes) || stagingBytes < 4 || stagingBytes % 4 !== 0) {
      throw new RangeError(`KV storage: a staging buffer of ${stagingBytes} bytes is not a whole number of words`);
    }
    this.submitPending();
    const runs = this.pageRuns(entries);
    const total = runs.reduce((sum, run) => sum + run.bytes, 0);
    const out = new Uint8Array(total);
    for (let first = 0; first < runs.length; ) {
      // A batch of runs that fits one staging buffer (a run larger than it goes alone, split by bytes).
      let last = first;
      let bytes = runs[first].bytes;
      while (last + 1 < runs.length && bytes + runs[last + 1].bytes <= stagingBytes) bytes += runs[++last].bytes;
      const batch = runs.slice(first, last + 1);
      for (let offset = 0; offset < bytes; offset += stagingBytes) {
        const size = Math.min(stagingBytes, bytes - offset);
        const staging = this.gpu.allocator.createBuffer({
          label: 'kv.save.staging',
          category: 'staging',
          size,
          usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
        });
        try {
          const encoder = this.gpu.device.createCommandEncoder({ label: 'kv.save' });
          let at = 0; // byte of the batch where this run starts
          for (const run of batch) {
            const from = Math.max(offset, at);
            const to = Math.min(offset + size, at + run.bytes);
            if (from < to)
              encoder.copyBufferToBuffer(run.slab, run.offset + from - at, staging, from - offset, to - from);
            at += run.bytes;
          }
          this.gpu.device.queue.submit([encoder.finish()]);
          await staging.mapAsync(GPUMapMode.READ);
          out.set(new Uint8Array(staging.getMappedRange()), runs[first].at + offset);
          staging.unmap();
        } finally {
          this.gpu.allocator.release(staging);
        }
      }
      first = last + 1;
    }
    return out;
  }

  /** Writes `bytes` (the pages `entries` in order, as readPages gives them) into those pages, before any later submit. */
  writePages(entries: readonly number[], bytes: Uint8Array): void {
    const runs = this.pageRuns(entries);
    const total = runs.reduce((sum, run) => sum + run.bytes, 0);
    if (total !== bytes.byteLength) throw new RangeError(`KV storage: ${bytes.byteLength} bytes for ${total} of pages`);
    for (const run of runs) {
      this.gpu.device.queue.writeBuffer(run.slab, run.offset, bytes.buffer, bytes.byteOffset + run.at, run.bytes);
    }
  }

  /** Runs of pages adjacent in one slab: where each lies (slab, byte offset) and where it goes in the bytes (at). */
  private pageRuns(entries: readonly number[]): Array<{ slab: GPUBuffer; offset: number; bytes: number; at: number }> {
    const runs: Array<{ slab: GPUBuffer; offset: number; bytes: number; at: number }> = [];
    let at = 0;
    for (const entry of entries) {
      const store = this.storeOf(entry);
      const { slab: slot, page } = decodePageEntry(entry);
      const slab = this.slab(store, slot - store.firstSlot);
      const offset = page * store.pageBytes;
      const previous = runs[runs.length - 1];
      if (previous && previous.slab === slab && previous.offset + previous.bytes === offset) {
        previous.bytes += store.pageBytes;
      } else runs.push({ slab, offset, bytes: store.pageBytes, at });
      at += store.pageBytes;
    }
    return runs;
  }

  pagesPromoted(pairs: ReadonlyArray<readonly [number, number]>): void {
    if (pairs.length === 0) return;
    if (!this.promote) throw new RangeError('KV storage: a promotion in a pool without quant pages');
    this.recordDispatches('kv.promote', this.promote(pairs));
  }

  /** Records prepared dispatches as pending work (their buffers are released after the submit that carries them). */
  recordDispatches(label: string, dispatches: PreparedDispatch[]): void {
    this.pending.push({
      encode: (encoder) => {
        const pass = encoder.beginComputePass({ label });
        encodeDispatches(pass, dispatches);
        pass.end();
      },
      release: () => releaseDispatches(this.gpu, dispatches),
    });
  }

  /** Whether page work waits for a submit (copies, promotions, flushed demotions). */
  get hasPending(): boolean {
    return this.pending.length > 0;
  }

  /**
   * Records the pending page work at the head of `encoder` (a step's, before its forward). The caller submits the
   * encoder before anything else reads the pages; what the work owns is released at the next record or submit.
   */
  encodePending(encoder: GPUCommandEncoder): void {
    this.releaseRecorded();
    // Most steps have none: nothing is allocated for them.
    if (this.pending.length === 0) return;
    for (const work of this.pending) work.encode(encoder);
    this.recorded = this.pending;
    this.pending = [];
  }

  /** Submits the pending page work now, in one submit of its own: for callers that need it done outside a step. */
  submitPending(): void {
    if (!this.hasPending) {
      this.releaseRecorded();
      return;
    }
    const encoder = this.gpu.device.createCommandEncoder({ label: 'kv.pending' });
    this.encodePending(encoder);
    this.gpu.device.queue.submit([encoder.finish()]);
    this.releaseRecorded();
  }

  /** Releases every GPU buffer of the storage, pending work included. */
  destroy(): void {
    this.releaseRecorded();
    for (const work of this.pending) work.release();
    this.pending = [];
    const buffers = [...[...this.slabs.values()].flat(), ...this.owned, ...this.bounce.values(), ...this.adopted];
    for (const b of buffers) this.gpu.allocator.release(b);
    this.slabs.clear();
    this.bounce.clear();
    this.adopted.length = 0;
    this.owned.length = 0;
  }

  private releaseRecorded(): void {
    if (this.recorded.length === 0) return;
    for (const work of this.recorded) work.release();
    this.recorded = [];
  }

  private bounceFor(store: PageStore): GPUBuffer {
    let bounce = this.bounce.get(store.kind);
    if (!bounce) {
      bounce = this.gpu.allocator.createBuffer({
        label: `kv.copyBounce${store.kind}`,
        category: 'kv',
        size: store.pageBytes,
        usage: GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
      });
      this.bounce.set(store.kind, bounce);
    }
    return bounce;
  }
}
