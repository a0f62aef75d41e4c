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
  x: GPUBuffer;
  /** f32 [ropeDim / 2]: Llama 3 frequency divisors, or ones. */
  freqFactors: GPUBuffer;
  /** Uniform { position, tokens }: the first token's position and this step's token count. */
  step: GPUBuffer;
  tokens: number;
  heads: number;
  headDim: number;
  ropeDim: number;
  base: number;
  layout: RopeLayout;
}

export function prepareRope(gpu: GpuContext, label: string, b: RopeBinding, source = ropeWgsl): PreparedDispatch {
  const pipeline = computePipeline(gpu, 'rope', source);
  const params = uniformBuffer(
    gpu,
    `${label}.params`,
    [b.tokens, b.heads, b.headDim, b.ropeDim, b.layout === 'neox' ? 1 : 0, b.base, 0, 0],
    'uuuuufuu',
  );
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [b.x, b.freqFactors, params, b.step]),
    workgroups: linearInvocationGrid((b.tokens * b.heads * b.ropeDim) / 2, 64),
    owned: [params],
  };
}
