import { InvalidRequestError } from '../core/errors.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import { computePipeline, type PreparedDispatch, uniformBuffer } from '../core/gpu/dispatch.ts';
import { type KvPageSource, kvPoolDispatch, workgroupGrid } from './kv-append.ts';
import { KV_DEMOTE_MAX_WIDTH, kvDemoteWgsl, kvPromoteWgsl } from './kv-demote.wgsl.ts';

/** A quantized row format (runtime/kv/quant-format.ts `QuantRowFormat`; kernels/ may not import runtime/kv). */
export interface KvRowFormat {
  width: number;
  groupSize: number;
  bits: 1 | 2 | 4;
  clipQuantile: number;
}

/** One layer's K or V rows in a quant page (runtime/kv/pool.ts `KvQuantRows`). */
export interface KvQuantRows {
  format: KvRowFormat;
  rowWords: number;
  codeWords: number;
}

/** The quant pages of a pool (runtime/kv/pool.ts `KvQuantLayout`). */
export interface KvQuantPages {
  pageWords: number;
  key: KvRowFormat;
  value: KvRowFormat;
  /** Consecutive positions per stored row (runtime/kv/quant-format.ts `positionsPerRow`): rows of a page = pageTokens / it. */
  positionsPerRow: number;
  rows(layer: number, kv: 0 | 1): KvQuantRows;
  layerOffsetWords(layer: number, kv: 0 | 1): number;
  /** [count, 0, 0, 0, src0, dst0, ...]. */
  jobs: GPUBuffer;
}

export interface KvMixedPageSource extends KvPageSource {
  readonly quant: KvQuantPages | null;
  /** Most demotion jobs one step carries: the grid of every demotion dispatch. */
  readonly maxStepDemotions: number;
}

/** Rank of the (1-q) and q quantiles in a sorted group of n, as quantileOfSorted rounds them. */
export function quantileRanks(n: number, q: number): [number, number] {
  const rank = (x: number) => Math.min(n - 1, Math.max(0, Math.round(x * (n - 1))));
  return [rank(1 - q), rank(q)];
}

function formatWords({ format: f, codeWords, rowWords }: KvQuantRows): number[] {
  const [lo, hi] = quantileRanks(f.groupSize, f.clipQuantile);
  return [f.bits, f.groupSize, codeWords, rowWords, lo, hi, 0, 0];
}

function requireQuant(pool: KvMixedPageSource): KvQuantPages {
  const quant = pool.quant;
  if (!quant) throw new InvalidRequestError('KV demotion needs a pool in quant mode');
  if (quant.key.width * quant.positionsPerRow > KV_DEMOTE_MAX_WIDTH) {
    throw new InvalidRequestError(
      `The quantized KV cache supports rows of at most ${KV_DEMOTE_MAX_WIDTH} values (kvHeads × headDim), got ${quant.key.width * quant.positionsPerRow}.`,
    );
  }
  return quant;
}

/**
 * Prepares the demotion of `layer`'s rows for the jobs a step carries (the pool's jobs buffer says which pages and
 * how many): at most `maxJobs`, by default the pool's maxStepDemotions. Record it before the layer's attention; it
 * reads f16 pages no step writes.
 */
export function prepareKvDemote(
  gpu: GpuContext,
  label: string,
  b: {
    pool: KvMixedPageSource;
    layer: number;
    maxJobs?: number;
    /** Jobs in the layout of the pool's jobs buffer, of a demotion outside a step's (default: the pool's buffer). */
    jobs?: GPUBuffer;
  },
): PreparedDispatch {
  const { pool } = b;
  const quant = requireQuant(pool);
  const maxJobs = b.maxJobs ?? pool.maxStepDemotions;
  const params = uniformBuffer(
    gpu,
    `${label}.params`,
    [
      pool.layerOffsetWords(b.layer, 0),
      pool.layerOffsetWords(b.layer, 1),
      quant.layerOffsetWords(b.layer, 0),
      quant.layerOffsetWords(b.layer, 1),
      pool.pageWords,
      quant.pageWords,
      pool.pageTokens,
      pool.headDim,
      quant.key.width,
      maxJobs,
      quant.positionsPerRow,
      0,
      ...formatWords(quant.rows(b.layer, 0)),
      ...formatWords(quant.rows(b.layer, 1)),
    ],
    'u'.repeat(28),
  );
  return kvPoolDispatch(
    gpu,
    label,
    computePipeline(gpu, 'kv-demote', kvDemoteWgsl),
    pool,
    [b.jobs ?? quant.jobs, params],
    workgroupGrid(gpu, maxJobs * 2 * (pool.pageTokens / quant.positionsPerRow)),
    [params],
  );
}

/**
 * Prepares a one-off promotion of quant pages to f16 pages: pairs of (quant entry, f16 entry), one dispatch per layer
 * (layers may have different row formats). The dispatches own their job and parameter buffers (release them after
 * the submit).
 */
export function prepareKvPromote(
  gpu: GpuContext,
  label: string,
  pool: KvMixedPageSource,
  pairs: ReadonlyArray<readonly [number, number]>,
): PreparedDispatch[] {
  const quant = requireQuant(pool);
  const jobs = gpu.allocator.createBuffer({
    label: `${label}.jobs`,
    category: 'scratch',
    size: Math.max(16, pairs.length * 8),
    usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST,
  });
  gpu.device.queue.writeBuffer(jobs, 0, Uint32Array.from(pairs.flat()));
  const invocations = pairs.length * 2 * pool.pageTokens * (quant.key.width / 2);
  return Array.from({ length: pool.layers }, (_, layer) => {
    const params = uniformBuffer(
      gpu,
      `${label}.layer${layer}.params`,
      [
        pool.layerOffsetWords(layer, 0),
        pool.layerOffsetWords(layer, 1),
        quant.layerOffsetWords(layer, 0),
        quant.layerOffsetWords(layer, 1),
        quant.positionsPerRow,
        pool.headDim,
        pool.pageTokens,
        pool.pageWords,
        quant.pageWords,
        pairs.length,
        quant.key.width,
        0,
        ...formatWords(quant.rows(layer, 0)),
        ...formatWords(quant.rows(layer, 1)),
      ],
      'u'.repeat(28),
    );
    // The last layer's dispatch owns the shared jobs buffer, so it is released once, after all of them.
    const owned = layer === pool.layers - 1 ? [jobs, params] : [params];
    return kvPoolDispatch(
      gpu,
      `${label}.layer${layer}`,
      computePipeline(gpu, 'kv-promote', kvPromoteWgsl),
      pool,
      [jobs, params],
      workgroupGrid(gpu, Math.ceil(invocations / 64)),
      owned,
    );
  });
}
