import { InvalidRequestError } from '../core/errors.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from '../core/gpu/dispatch.ts';
import { rmsnormSource } from './rmsnorm.wgsl.ts';

export interface RmsNormBinding {
  input: GPUBuffer;
  weight: GPUBuffer;
  output: GPUBuffer;
  rows: number;
  dim: number;
  eps: number;
  /** Add the normalized rows into `output` instead of writing them (Gemma's post-norms, into the residual stream). */
  add?: boolean;
}

/**
 * Prepares an RMSNorm dispatch over `rows` rows of `dim` f32 values into `output` (not `input`: Qwen3's per-head
 * q/k norm, the one in-place use, is done by the RoPE dispatch, kernels/rope.ts).
 */
export function prepareRmsNorm(gpu: GpuContext, label: string, b: RmsNormBinding): PreparedDispatch {
  if (b.input === b.output) {
    throw new InvalidRequestError(`RMSNorm '${label}' cannot write its input in place; give it another output buffer.`);
  }
  const pipeline = b.add
    ? computePipeline(gpu, 'rmsnorm-add', rmsnormSource(true))
    : computePipeline(gpu, 'rmsnorm', rmsnormSource(false));
  const params = uniformBuffer(gpu, `${label}.params`, [b.rows, b.dim, b.eps, 0], 'uufu');
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [b.input, b.weight, b.output, params]),
    workgroups: [b.rows, 1, 1],
    owned: [params],
  };
}
