import { UnsupportedModelError } from '../core/errors.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import {
  bindBuffers,
  computePipeline,
  linearInvocationGrid,
  type PreparedDispatch,
  uniformBuffer,
} from '../core/gpu/dispatch.ts';
import { ROPE_HEAD_NORM_MAX_DIM, ropeHeadNormWgsl, ropeWgsl } from './rope.wgsl.ts';

export type RopeLayout = 'normal' | 'neox';

export interface RopeBinding {
  /** f32 [tokens, heads * headDim], rotated in place. */
  q: GPUBuffer;
  /** f32 [tokens, kvHeads * headDim], rotated in place. */
  k: GPUBuffer;
  /** f32 [ropeDim / 2]: Llama 3 frequency divisors, or ones. */
  freqFactors: GPUBuffer;
  /** Uniform { position, tokens }: the first token's position and this step's token count. */
  step: GPUBuffer;
  tokens: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  ropeDim: number;
  base: number;
  layout: RopeLayout;
  /**
   * Qwen3's RMSNorm of each q and k head before RoPE (f32 [headDim] weights), done by the same dispatch
   * (ropeHeadNormWgsl).
   */
  headNorm?: { q: GPUBuffer; k: GPUBuffer; eps: number };
}

/** RoPE on a step's q and k (in place) as one dispatch, after their per-head RMSNorm when `headNorm` is given. */
export function prepareRope(gpu: GpuContext, label: string, b: RopeBinding): PreparedDispatch {
  const norm = b.headNorm;
  if (norm && b.headDim > ROPE_HEAD_NORM_MAX_DIM) {
    throw new UnsupportedModelError(
      `RoPE '${label}' normalizes heads of at most ${ROPE_HEAD_NORM_MAX_DIM} dims, got ${b.headDim}.`,
    );
  }
  const pipeline = norm
    ? computePipeline(gpu, 'rope-head-norm', ropeHeadNormWgsl)
    : computePipeline(gpu, 'rope', ropeWgsl);
  const params = uniformBuffer(
    gpu,
    `${label}.params`,
    [b.tokens, b.heads, b.kvHeads, b.headDim, b.ropeDim, b.layout === 'neox' ? 1 : 0, b.base, norm?.eps ?? 0],
    'uuuuuuff',
  );
  const buffers = [b.q, b.k, b.freqFactors, params, b.step];
  if (norm) buffers.push(norm.q, norm.k);
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, buffers),
    // With head norms one workgroup per (token, head of q or k); otherwise one invocation per rotated pair.
    workgroups: norm
      ? linearInvocationGrid(b.tokens * (b.heads + b.kvHeads), 1)
      : linearInvocationGrid((b.tokens * (b.heads + b.kvHeads) * b.ropeDim) / 2, 64),
    owned: [params],
  };
}
