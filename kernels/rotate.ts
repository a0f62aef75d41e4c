import type { GpuContext } from '../runtime/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from './dispatch.ts';
import { rotateWgsl } from './rotate.wgsl.ts';

export interface RotateBinding {
  /** f32 [tokens, heads, headDim], rotated in place. */
  x: GPUBuffer;
  /** f32 matrices [n, headDim, headDim] (row-major); head h uses matrix `first + floor(h / headsPerMatrix)`. */
  rotation: GPUBuffer;
  /** Index of the first matrix this dispatch uses (e.g. layer × kvHeads). */
  firstMatrix: number;
  /** The step uniform ({ position, tokens, ... }): only `tokens` rows are rotated. */
  step: GPUBuffer;
  maxTokens: number;
  heads: number;
  headDim: number;
  /** GQA: query heads sharing one KV head share its rotation. */
  headsPerMatrix: number;
  /** Multiply by Rᵀ instead of R (undo an orthogonal rotation). */
  transpose: boolean;
}

export function prepareRotate(gpu: GpuContext, label: string, b: RotateBinding, source = rotateWgsl): PreparedDispatch {
  const pipeline = computePipeline(gpu, 'rotate', source);
  const params = uniformBuffer(
    gpu,
    `${label}.params`,
    [b.heads, b.headDim, b.headsPerMatrix, b.transpose ? 1 : 0, b.firstMatrix * b.headDim * b.headDim, 0, 0, 0],
    'uuuuuuuu',
  );
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [b.x, b.rotation, params, b.step]),
    workgroups: [b.heads, b.maxTokens, 1],
    owned: [params],
  };
}
