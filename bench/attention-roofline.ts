/**
 * The roofline of one layer's decode attention (`bench/attention-kernels.ts --roofline`): the K and V bytes a decode
 * step at a context reads from the pool as the pool holds them, the device's copy bandwidth, the time those bytes
 * take at it (the floor), and the table that sets the decode kernel's time and its phase ablations against it.
 */
import type { GpuContext } from '../core/gpu/device.ts';
import { decodePageEntry, KV_PAGE_KIND, type KvPagePool, type KvSequence } from '../runtime/kv/pool.ts';
import { gpuTimestamps, warmUp } from './gpu-timing.ts';
import type { LayerShape } from './models.ts';

/**
 * GQA group 8 beside the bench models' group 4 (llama-3.2-1b, qwen3-4b): 64 query heads on the same 8 KV heads, so
 * the same bytes to read (hd128-g8 is Llama-3.1-70B's attention).
 */
export const ROOFLINE_SHAPES: readonly LayerShape[] = [
  { name: 'hd64-g8', heads: 64, kvHeads: 8, headDim: 64 },
  { name: 'hd128-g8', heads: 64, kvHeads: 8, headDim: 128 },
];
export const ROOFLINE_DEFAULTS = { shapes: 'llama-3.2-1b,hd64-g8,qwen3-4b,hd128-g8', contexts: '8192,32768,131072' };

/** What one layer's decode step over `context` positions reads of K and V. */
export interface KvBytesRead {
  f16Positions: number;
  quantPositions: number;
  /** K and V of one position in an f16 page: the f16 page's bytes over its tokens and layers. */
  f16BytesPerPosition: number;
  /** K and V rows of one position in a quant page (codes + a (lo, scale) word per group): the layout's rowWords. */
  quantBytesPerPosition: number;
  bytes: number;
}

/** The K and V bytes of `layer` a step attending to the first `context` positions of `seq` reads, page by page. */
export function kvBytesRead(pool: KvPagePool, seq: KvSequence, context: number, layer = 0): KvBytesRead {
  const f16BytesPerPosition = pool.pageBytes / (pool.pageTokens * pool.layers);
  const quantBytesPerPosition = pool.quant
    ? (pool.quant.rows(layer, 0).rowWords + pool.quant.rows(layer, 1).rowWords) * 4
    : 0;
  let f16Positions = 0;
  let quantPositions = 0;
  for (let page = 0; page * pool.pageTokens < context; page++) {
    const positions = Math.min(pool.pageTokens, context - page * pool.pageTokens);
    if (decodePageEntry(seq.pages[page]).kind === KV_PAGE_KIND.quant) quantPositions += positions;
    else f16Positions += positions;
  }
  return {
    f16Positions,
    quantPositions,
    f16BytesPerPosition,
    quantBytesPerPosition,
    bytes: f16Positions * f16BytesPerPosition + quantPositions * quantBytesPerPosition,
  };
}

/** The device's copy bandwidth: copyBufferToBuffer of one large buffer into another. */
export interface CopyBandwidth {
  bytes: number;
  method: 'gpu-timestamps' | 'n/5n wall clock';
  /** Per copy, by `method`. */
  ms: number;
  /** (bytes read + bytes written) / ms: what the memory moves, the rate the floor is computed at. */
  gbs: number;
  /** Per copy by the n/5n wall clock (also where timestamps serve). */
  wallMs: number;
}

/**
 * Times copies of `bytes` (at most the device's maxBufferSize) from a buffer of random words into another: GPU
 * timestamps around `copies` copies in one submit (empty compute passes carry them; the fastest of 5 submits), where
 * the device has them; and always the n/5n wall clock (fastest of three 5n submits − fastest of three n) / 4n.
 */
export async function measureCopyBandwidth(gpu: GpuContext, bytes: number, copies = 8): Promise<CopyBandwidth> {
  const size = Math.floor(Math.min(bytes, gpu.limits.maxBufferSize) / 2 ** 20) * 2 ** 20;
  const usage = GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
  const src = gpu.allocator.createBuffer({ label: 'bench.copy.src', category: 'scratch', size, usage });
  const dst = gpu.allocator.createBuffer({ label: 'bench.copy.dst', category: 'scratch', size, usage });
  try {
    // Random words (not zeros a memory system might compress): one 16 MiB block, written along the buffer.
    const block = Math.min(size, 16 << 20);
    const words = new Uint32Array(block / 4);
    let x = 0x9e3779b9;
    for (let i = 0; i < words.length; i++) {
      x ^= x << 13;
      x ^= x >>> 17;
      x ^= x << 5;
      words[i] = x >>> 0;
    }
    for (let at = 0; at < size; at += block)
      gpu.device.queue.writeBuffer(src, at, words, 0, Math.min(words.length, (size - at) / 4));
    const wall = async (n: number) => {
      const e = gpu.device.createCommandEncoder();
      for (let i = 0; i < n; i++) e.copyBufferToBuffer(src, 0, dst, 0, size);
      const t0 = performance.now();
      gpu.device.queue.submit([e.finish()]);
      await gpu.device.queue.onSubmittedWorkDone();
      return performance.now() - t0;
    };
    await warmUp(() => wall(2));
    let short = Number.POSITIVE_INFINITY;
    let long = Number.POSITIVE_INFINITY;
    for (let k = 0; k < 3; k++) {
      short = Math.min(short, await wall(2));
      long = Math.min(long, await wall(10));
    }
    const wallMs = (long - short) / 8;
    let ms = wallMs;
    if (gpu.features.timestampQuery) {
      ms = Number.POSITIVE_INFINITY;
      for (let k = 0; k < 5; k++) {
        const ticks = await gpuTimestamps(gpu, 2, (e, querySet) => {
          e.beginComputePass({ timestampWrites: { querySet, endOfPassWriteIndex: 0 } }).end();
          for (let i = 0; i < copies; i++) e.copyBufferToBuffer(src, 0, dst, 0, size);
          e.beginComputePass({ timestampWrites: { querySet, beginningOfPassWriteIndex: 1 } }).end();
        });
        ms = Math.min(ms, Number(ticks[1] - ticks[0]) / 1e6 / copies);
      }
    }
    return {
      bytes: size,
      method: gpu.features.timestampQuery ? 'gpu-timestamps' : 'n/5n wall clock',
      ms,
      gbs: (2 * size) / (ms * 1e-3) / 1e9,
      wallMs,
    };
  } finally {
    gpu.allocator.release(src);
    gpu.allocator.release(dst);
  }
}

/** One row of the roofline: a shape, a pool kind and a context. */
export interface RooflineRow {
  shape: string;
  heads: number;
  kvHeads: number;
  headDim: number;
  kind: 'f16' | 'int2';
  context: number;
  read: KvBytesRead;
  /** read.bytes at the copy bandwidth (CopyBandwidth.gbs), µs. */
  floorUs: number;
  /** The decode kernel's layer: split pass + merge, each dispatch's median GPU time summed (or n/5n: kernelMethod). */
  kernelUs: number;
  kernelMethod: 'gpu-timestamps' | 'n/5n wall clock';
  /** Per dispatch (its label), µs, where timestamps serve. */
  dispatchUs?: Record<string, number>;
  /** The layer's dispatches in one pass, n/5n wall clock, µs. */
  kernelWallUs: number;
  /** floorUs / kernelUs, %. */
  percentOfFloor: number;
  /** The decode kernel's output against its reference (the CPU's for f16, the split kernel's for int2): ≤ 1 passes. */
  toleranceRatio?: number;
  /** Per ablation (attention-kernels.ts' PHASE_ABLATIONS and the kind's load ablations): its µs, timed as kernelUs. */
  ablationUs: Record<string, number>;
}

/** Table columns of the ablations: the µs the layer takes less without that part (kernel − ablated). */
const ABLATION_COLUMNS: [header: string, ablations: string[]][] = [
  ['−scores (A)', ['abl-noA']],
  ['−values (C)', ['abl-noC']],
  ['−K loads', ['abl-noK', 'abl-noQuantK']],
  ['−K dims', ['abl-noQuantKDims']],
  ['−V loads', ['abl-noV', 'abl-noQuantV']],
  ['−P reads', ['abl-noPReads']],
  ['−combine', ['abl-noCombine']],
  ['−merge', ['abl-noMerge']],
  ['−merge sum', ['abl-noMergeSum']],
];

/** The roofline as a markdown table, with a legend. */
export function rooflineMarkdown(rows: readonly RooflineRow[], copy: CopyBandwidth): string {
  const gbs = Math.round(copy.gbs);
  const header = [
    'shape',
    'kind',
    'context',
    'MB read/layer',
    `floor µs at ${gbs} GB/s`,
    'kernel µs',
    'n/5n µs',
    '% of floor',
    ...ABLATION_COLUMNS.map(([h]) => h),
  ];
  const cell = (row: RooflineRow, names: string[]) => {
    const name = names.find((n) => row.ablationUs[n] !== undefined);
    return name === undefined ? '·' : (row.kernelUs - row.ablationUs[name]).toFixed(1);
  };
  const lines = [
    `| ${header.join(' | ')} |`,
    `| ${header.map((_, i) => (i < 2 ? '---' : '---:')).join(' | ')} |`,
    ...rows
      .map((r) =>
        [
          `${r.shape} (${r.heads}/${r.kvHeads}, hd ${r.headDim})`,
          r.kind,
          r.context >= 1024 && r.context % 1024 === 0 ? `${r.context / 1024}K` : String(r.context),
          (r.read.bytes / 1e6).toFixed(2),
          r.floorUs.toFixed(1),
          `${r.kernelUs.toFixed(1)}${r.toleranceRatio !== undefined && r.toleranceRatio > 1 ? ' ✗' : ''}`,
          r.kernelWallUs.toFixed(1),
          r.percentOfFloor.toFixed(0),
          ...ABLATION_COLUMNS.map(([, names]) => cell(r, names)),
        ].join(' | '),
      )
      .map((l) => `| ${l} |`),
  ];
  const legend =
    `Copy: ${(copy.bytes / 2 ** 30).toFixed(2)} GiB copyBufferToBuffer, ${copy.ms.toFixed(3)} ms (${copy.method}; ` +
    `n/5n wall clock ${copy.wallMs.toFixed(3)} ms), GB/s = bytes read + written per second. MB read: the K and V ` +
    'bytes of the positions the step attends to, f16 or quant as the pool holds them (page table, q and partials not ' +
    `counted). Kernel: decode split pass + merge (${rows[0]?.kernelMethod ?? 'gpu-timestamps'}: each dispatch's median ` +
    'summed; ✗: failed its check); n/5n: both in one pass, wall clock; % of floor: floor / kernel. ' +
    'Ablation columns: µs the layer takes less with that part cut (attention-kernels.ts: A = abl-noA, C = abl-noC, ' +
    'K loads = abl-noK / abl-noQuantK, K dims = abl-noQuantKDims, V loads = abl-noV / abl-noQuantV, P reads = ' +
    'abl-noPReads, combine = abl-noCombine, merge = abl-noMerge, merge sum = abl-noMergeSum); ·: not that kind.';
  return `${lines.join('\n')}\n\n${legend}\n`;
}
