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

/**
 * RoPE scaling of a model extended past its training context, as llama.cpp applies it (ggml's rope with
 * freq_scale = 1 / factor, ext_factor 1 for YaRN and 0 otherwise, attn_factor from the context's setup):
 * - 'linear': every angle divided by `factor` (positions interpolated);
 * - 'yarn': the fast dims (many turns over `originalContext`) keep their angle, the slow ones are divided by
 *   `factor`, with a linear ramp between the dims that turn `betaFast` and `betaSlow` times; cos and sin are
 *   multiplied by 1 + 0.1·ln(factor) (for factor > 1).
 * `attnFactor` (GGUF `rope.scaling.attn_factor`) multiplies cos and sin in every mode.
 */
export interface RopeScaling {
  type: 'none' | 'linear' | 'yarn';
  /** Context extension factor, 1 for none. */
  factor: number;
  /** YaRN: the context the model was trained at before extension. */
  originalContext: number;
  /** YaRN: the ramp runs from the dim that turns betaFast times over originalContext to the one that turns betaSlow. */
  betaFast: number;
  betaSlow: number;
  attnFactor: number;
}

export const NO_ROPE_SCALING: RopeScaling = {
  type: 'none',
  factor: 1,
  originalContext: 0,
  betaFast: 32,
  betaSlow: 1,
  attnFactor: 1,
};

/** The pair whose wavelength turns `rotations` times over `context` positions (fractional; ggml's corr dim). */
function yarnCorrectionDim(ropeDim: number, base: number, context: number, rotations: number): number {
  return (ropeDim * Math.log(context / (rotations * 2 * Math.PI))) / (2 * Math.log(base));
}

/**
 * YaRN's ramp over pairs [low, high]: pair i keeps its unscaled angle with weight mix(i) = 1 below low, 0 above high.
 * The bounds are the correction dims rounded outwards and clamped to the rotated dims, as ggml does.
 */
export function yarnRamp(ropeDim: number, base: number, s: RopeScaling): { low: number; high: number } {
  const low = Math.max(0, Math.floor(yarnCorrectionDim(ropeDim, base, s.originalContext, s.betaFast)));
  const high = Math.min(ropeDim - 1, Math.ceil(yarnCorrectionDim(ropeDim, base, s.originalContext, s.betaSlow)));
  return { low, high };
}

/**
 * Per rotated pair, the divisor of its angle (the kernel's `freqFactors`): theta_i = pos·base^(-2i/ropeDim) / d_i.
 * `freqFactors` are Llama 3's rope_freqs (divisors themselves). Linear and YaRN scaling are per-pair divisors too,
 * since both interpolated and extrapolated angles are linear in the position:
 * theta_i = theta_extrap_i · (mix_i + (1 - mix_i) / factor), with mix_i = 0 for linear scaling.
 */
export function ropeFrequencyDivisors(
  ropeDim: number,
  base: number,
  scaling: RopeScaling,
  freqFactors?: Float32Array,
): Float32Array {
  const divisors = new Float32Array(ropeDim / 2);
  const scale = scaling.type === 'none' ? 1 : 1 / scaling.factor;
  const ramp = scaling.type === 'yarn' ? yarnRamp(ropeDim, base, scaling) : null;
  for (let i = 0; i < divisors.length; i++) {
    const mix = ramp ? 1 - Math.min(1, Math.max(0, (i - ramp.low) / Math.max(0.001, ramp.high - ramp.low))) : 0;
    divisors[i] = (freqFactors ? freqFactors[i] : 1) / (scale * (1 - mix) + mix);
  }
  return divisors;
}

/**
 * What cos and sin are multiplied by: llama.cpp's attn_factor times YaRN's magnitude correction 1 + 0.1·ln(factor)
 * (for factor > 1; its context setup cancels the correction ggml applies below 1).
 */
export function ropeMagnitude(scaling: RopeScaling): number {
  const yarn = scaling.type === 'yarn' && scaling.factor > 1 ? 1 + 0.1 * Math.log(scaling.factor) : 1;
  return scaling.attnFactor * yarn;
}

export interface RopeBinding {
  /** f32 [tokens, heads * headDim], rotated in place. */
  q: GPUBuffer;
  /** f32 [tokens, kvHeads * headDim], rotated in place. */
  k: GPUBuffer;
  /** f32 [ropeDim / 2]: per-pair angle divisors (ropeFrequencyDivisors: Llama 3's rope_freqs, linear or YaRN scaling), or ones. */
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
  /** Multiplies the rotated pairs' cos and sin (ropeMagnitude; 1 without scaling). */
  magnitude?: number;
  /**
   * Qwen3's RMSNorm of each q and k head before RoPE (f32 [headDim] weights), done by the same dispatch
   * (ropeHeadNormWgsl).
   */
  headNorm?: { q: GPUBuffer; k: GPUBuffer; eps: number };
}

/**
 * A layer's RoPE as the model defines it, without the tensors it applies to: what the forward pass hands the KV cache,
 * which applies it to q and k before it stores k (kernels/rope-append.ts fuses it with the store in decode steps).
 */
export type RopeStage = Omit<RopeBinding, 'q' | 'k' | 'tokens'>;

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
    [
      b.tokens,
      b.heads,
      b.kvHeads,
      b.headDim,
      b.ropeDim,
      b.layout === 'neox' ? 1 : 0,
      b.base,
      norm?.eps ?? 0,
      b.magnitude ?? 1,
    ],
    'uuuuuufff',
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

/** RoPE from a stage (`rope`, null: q and k are final) on `tokens` rows of q and k: its one dispatch, or none. */
export function prepareRopeStage(
  gpu: GpuContext,
  label: string,
  rope: RopeStage | null,
  q: GPUBuffer,
  k: GPUBuffer,
  tokens: number,
): PreparedDispatch[] {
  return rope ? [prepareRope(gpu, label, { ...rope, q, k, tokens })] : [];
}
