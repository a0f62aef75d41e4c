import type { GpuContext } from '../core/gpu/device.ts';
import { computePipeline, type PreparedDispatch, uniformBuffer } from '../core/gpu/dispatch.ts';
import { type KvPageSource, kvPoolDispatch } from './kv-append.ts';
import type { RopeStage } from './rope.ts';
import { ROPE_HEAD_NORM_MAX_DIM } from './rope.wgsl.ts';
import { type RopeAppendBuild, ropeAppendStorageBindings, ropeAppendWgsl } from './rope-append.wgsl.ts';
import { PREFETCHED_ROW_MAX_DIM } from './rotate.wgsl.ts';

/** The rotated cache's matrices for one layer: f32 [n, headDim, headDim] row-major, KV head h at `firstMatrix + h`. */
export interface RopeAppendRotation {
  key: GPUBuffer;
  value: GPUBuffer;
  firstMatrix: number;
}

export interface RopeAppendBinding {
  pool: KvPageSource;
  layer: number;
  /** f32 [heads × headDim]: finished in place (RoPE, then R_K where rotated). */
  q: GPUBuffer;
  /** f32 [kvHeads × headDim] each, as the projections wrote them: stored into the step's page, the buffers unchanged. */
  k: GPUBuffer;
  v: GPUBuffer;
  rope: RopeStage;
  rotation?: RopeAppendRotation;
}

/**
 * Whether a decode step of this shape can finish q/k/v in one fused dispatch on this device: heads of up to
 * ROPE_HEAD_NORM_MAX_DIM dims (a multiple of 8 where rotated: the row product's vec4s), and its storage bindings within
 * the adapter's limit (9 to 13; the WebGPU default is 8). Otherwise the cache runs RoPE, the rotation and kv-append
 * one after another.
 */
export function ropeAppendFits(
  gpu: GpuContext,
  build: Pick<RopeAppendBuild, 'headNorm' | 'rotate'>,
  headDim: number,
): boolean {
  return (
    headDim <= ROPE_HEAD_NORM_MAX_DIM &&
    headDim % 2 === 0 &&
    (!build.rotate || headDim % 8 === 0) &&
    ropeAppendStorageBindings(build) <= gpu.limits.maxStorageBuffersPerShaderStage
  );
}

/**
 * A decode step's RoPE (with Qwen3's head norm), the rotated cache's rotations and the store of k and v into the
 * step's page, as one dispatch (ropeAppendWgsl). Callers check ropeAppendFits first.
 */
export function prepareRopeAppend(gpu: GpuContext, label: string, b: RopeAppendBinding): PreparedDispatch {
  const { pool, rope } = b;
  const rotate = b.rotation !== undefined;
  const build: RopeAppendBuild = {
    headNorm: rope.headNorm !== undefined,
    rotate,
    prefetch: rotate && rope.headDim <= PREFETCHED_ROW_MAX_DIM,
  };
  if (rope.kvHeads !== pool.kvHeads || rope.headDim !== pool.headDim || rope.heads % rope.kvHeads !== 0) {
    throw new RangeError(
      `rope-append '${label}': ${rope.heads} q heads and ${rope.kvHeads} KV heads of ${rope.headDim} dims do not fit a pool of ${pool.kvHeads} KV heads of ${pool.headDim}`,
    );
  }
  if (!ropeAppendFits(gpu, build, rope.headDim)) {
    throw new RangeError(`rope-append '${label}': this device cannot run the fused build (ropeAppendFits)`);
  }
  const name = `rope-append${build.headNorm ? '-head-norm' : ''}${build.rotate ? '-rotated' : ''}${build.prefetch ? '-prefetched' : ''}`;
  const pipeline = computePipeline(gpu, name, ropeAppendWgsl(build));
  const matrixWords = rope.headDim * rope.headDim;
  const firstMatrixWords = (b.rotation?.firstMatrix ?? 0) * matrixWords;
  const params = uniformBuffer(
    gpu,
    `${label}.params`,
    [
      rope.heads,
      rope.kvHeads,
      rope.headDim,
      rope.ropeDim,
      rope.layout === 'neox' ? 1 : 0,
      rope.base,
      rope.headNorm?.eps ?? 0,
      rope.magnitude ?? 1,
      pool.layerOffsetWords(b.layer, 0),
      pool.layerOffsetWords(b.layer, 1),
      pool.pageWords,
      pool.pageTokens,
      firstMatrixWords,
      firstMatrixWords,
      rope.heads / rope.kvHeads,
      0,
    ],
    'uuuuufffuuuuuuuu',
  );
  return kvPoolDispatch(
    gpu,
    label,
    pipeline,
    pool,
    [
      b.q,
      b.k,
      b.v,
      rope.freqFactors,
      pool.pageTable,
      ...(b.rotation ? [b.rotation.key, b.rotation.value] : []),
      ...(rope.headNorm ? [rope.headNorm.q, rope.headNorm.k] : []),
      params,
      rope.step,
      pool.step,
    ],
    [rope.heads + 2 * rope.kvHeads, 1, 1],
    [params],
  );
}
