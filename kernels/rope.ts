import type { GpuContext } from '../runtime/gpu/device.ts';
import {
  bindBuffers,
  computePipeline,
  linearInvocationGrid,
  type PreparedDispatch,
  uniformBuffer,
} from './dispatch.ts';
import { ropeWgsl } from './rope.wgsl.ts';

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
}

/** RoPE on a step's q and k (in place) as one dispatch. */
export function prepareRope(gpu: GpuContext, label: string, b: RopeBinding, source = ropeWgsl): PreparedDispatch {
  const pipeline = computePipeline(gpu, 'rope', source);
  const params = uniformBuffer(
    gpu,
    `${label}.params`,
    [b.tokens, b.heads, b.kvHeads, b.headDim, b.ropeDim, b.layout === 'neox' ? 1 : 0, b.base, 0],
    'uuuuuufu',
  );
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [b.q, b.k, b.freqFactors, params, b.step]),
    workgroups: linearInvocationGrid((b.tokens * (b.heads + b.kvHeads) * b.ropeDim) / 2, 64),
    owned: [params],
  };
}
