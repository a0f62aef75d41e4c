import type { GpuContext } from '../core/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from '../core/gpu/dispatch.ts';
import { covarianceWgsl, keyEnergyWgsl } from './covariance.wgsl.ts';

export interface CovarianceBinding {
  /** f32 [tokens, heads, headDim]. */
  x: GPUBuffer;
  /** f32 [tokens, matrices] weights, or null for unweighted. */
  weights: GPUBuffer | null;
  /** f32 [n, headDim, headDim], accumulated into (+=) at matrices firstMatrix..firstMatrix+matrices-1. */
  covariance: GPUBuffer;
  firstMatrix: number;
  matrices: number;
  heads: number;
  headDim: number;
  /** Step uniform: only `tokens` rows count. */
  step: GPUBuffer;
}

export function prepareCovariance(gpu: GpuContext, label: string, b: CovarianceBinding): PreparedDispatch {
  const pipeline = computePipeline(gpu, 'covariance', covarianceWgsl);
  const params = uniformBuffer(
    gpu,
    `${label}.params`,
    [b.heads, b.headDim, b.heads / b.matrices, b.weights ? 1 : 0, b.matrices, b.firstMatrix, 0, 0],
    'uuuuuuuu',
  );
  // An unweighted pass still needs something bound at the weights slot; x is never read through it.
  const weights = b.weights ?? b.x;
  const groups = Math.ceil(b.headDim / 8);
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [b.x, weights, b.covariance, params, b.step]),
    workgroups: [groups, groups, b.matrices],
    owned: [params],
  };
}

export interface KeyEnergyBinding {
  /** f32 [tokens, kvHeads, headDim] keys (RoPE applied). */
  k: GPUBuffer;
  /** f32 [n, headDim, headDim] query second moments; matrices firstMatrix.. are used. */
  queryMoment: GPUBuffer;
  firstMatrix: number;
  /** f32 [tokens, kvHeads] output. */
  energy: GPUBuffer;
  kvHeads: number;
  headDim: number;
  maxTokens: number;
  step: GPUBuffer;
}

export function prepareKeyEnergy(gpu: GpuContext, label: string, b: KeyEnergyBinding): PreparedDispatch {
  const pipeline = computePipeline(gpu, 'key-energy', keyEnergyWgsl);
  const params = uniformBuffer(gpu, `${label}.params`, [b.kvHeads, b.headDim, b.firstMatrix, 0], 'uuuu');
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [b.k, b.queryMoment, b.energy, params, b.step]),
    workgroups: [Math.ceil((b.maxTokens * b.kvHeads) / 64), 1, 1],
    owned: [params],
  };
}
