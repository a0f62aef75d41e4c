import type { GpuContext } from '../core/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from '../core/gpu/dispatch.ts';
import { kvAppendWgsl } from './kv-append.wgsl.ts';

/**
 * What the KV kernels need from a page pool (runtime/kv/pool.ts `KvPagePool` implements it; kernels/ may not
 * import runtime/kv).
 */
export interface KvPageSource {
  readonly layers: number;
  readonly kvHeads: number;
  readonly headDim: number;
  readonly pageTokens: number;
  readonly pageWords: number;
  /** Page-table entries of a sequence: its most keys are maxPagesPerSequence × pageTokens. */
  readonly maxPagesPerSequence: number;
  readonly pageTable: GPUBuffer;
  /** The KvStep uniform. */
  readonly step: GPUBuffer;
  /** Changes when slabs are added; bind groups are re-created when it does. */
  readonly generation: number;
  slabBindings(): GPUBuffer[];
  layerOffsetWords(layer: number, kv: 0 | 1): number;
}

/**
 * A PreparedDispatch whose bind group includes the pool's slabs. The bind group is re-created (at encode time, once)
 * only after the pool grew, so dispatches prepared before growth stay valid.
 */
export function kvPoolDispatch(
  gpu: GpuContext,
  label: string,
  pipeline: GPUComputePipeline,
  pool: KvPageSource,
  buffers: readonly GPUBuffer[],
  workgroups: readonly [number, number, number],
  owned: GPUBuffer[],
): PreparedDispatch {
  let generation = -1;
  let group: GPUBindGroup | null = null;
  return {
    label,
    pipeline,
    workgroups,
    owned,
    get bindGroup(): GPUBindGroup {
      if (group === null || generation !== pool.generation) {
        group = bindBuffers(gpu, label, pipeline, [...buffers, ...pool.slabBindings()]);
        generation = pool.generation;
      }
      return group;
    },
  };
}

/** Spreads `count` workgroups over x and y so neither exceeds the per-dimension limit. */
export function workgroupGrid(gpu: GpuContext, count: number): [number, number, number] {
  const maxX = gpu.limits.maxComputeWorkgroupsPerDimension;
  const x = Math.max(1, Math.min(count, maxX));
  return [x, Math.ceil(count / x), 1];
}

export interface KvAppendBinding {
  pool: KvPageSource;
  layer: number;
  /** f32 [tokens, kvHeads*headDim], RoPE applied. */
  k: GPUBuffer;
  v: GPUBuffer;
  /** Most tokens one step writes with this dispatch (its grid); the step uniform says how many it does. */
  tokens: number;
}

/** Prepares the write of one layer's K/V rows into the pages at positions step.position..+step.tokens. */
export function prepareKvAppend(gpu: GpuContext, label: string, b: KvAppendBinding): PreparedDispatch {
  const { pool } = b;
  const pipeline = computePipeline(gpu, 'kv-append', kvAppendWgsl);
  const headPairs = pool.headDim / 2;
  const params = uniformBuffer(
    gpu,
    `${label}.params`,
    [
      pool.layerOffsetWords(b.layer, 0),
      pool.layerOffsetWords(b.layer, 1),
      pool.pageWords,
      pool.pageTokens,
      pool.kvHeads,
      headPairs,
      b.tokens,
      0,
    ],
    'uuuuuuuu',
  );
  const invocations = b.tokens * pool.kvHeads * headPairs;
  return kvPoolDispatch(
    gpu,
    label,
    pipeline,
    pool,
    [b.k, b.v, pool.pageTable, pool.step, params],
    workgroupGrid(gpu, Math.ceil(invocations / 64)),
    [params],
  );
}
