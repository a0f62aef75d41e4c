import type { GpuContext } from '../core/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from '../core/gpu/dispatch.ts';
import { ROTATE_PREFILL_LAYOUT, type RotateBlockLayout, rotateBlockTokens, rotateSource } from './rotate.wgsl.ts';

/** One tensor a rotate dispatch rotates in place. */
export interface RotatePart {
  /** f32 [tokens, heads, headDim], rotated in place. */
  x: GPUBuffer;
  /** f32 matrices [n, headDim, headDim] (row-major); head h uses matrix `firstMatrix + floor(h / headsPerMatrix)`. */
  rotation: GPUBuffer;
  /** Index of the first matrix this part uses (e.g. layer × kvHeads). */
  firstMatrix: number;
  heads: number;
  /** GQA: query heads sharing one KV head share its rotation. */
  headsPerMatrix: number;
  /** Multiply by Rᵀ instead of R (undo an orthogonal rotation). */
  transpose: boolean;
}

export interface RotateBinding {
  /** 1 to 3 tensors, rotated by one dispatch. */
  parts: readonly RotatePart[];
  /** The step uniform ({ position, tokens, ... }): only `tokens` rows are rotated. */
  step: GPUBuffer;
  maxTokens: number;
  headDim: number;
}

/**
 * A build of the rotate kernel in place of the one `maxTokens` picks (tests, benches): whether it is the blocks
 * build, and that build's layout (default the runtime's). Both size the grid as well as the code.
 */
export interface RotateBuild {
  blocks: boolean;
  layout?: RotateBlockLayout;
}

export function prepareRotate(gpu: GpuContext, label: string, b: RotateBinding, build?: RotateBuild): PreparedDispatch {
  const count = b.parts.length;
  if (count < 1 || count > 3) throw new RangeError(`rotate: 1 to 3 parts, got ${count}`);
  if (b.headDim % 8 !== 0 || b.headDim > 256) {
    throw new RangeError(`rotate: headDim must be a multiple of 8 and at most 256, got ${b.headDim}`);
  }
  // Prefill graphs rotate many rows: blocks of tokens per workgroup, which read their head's matrix once, not once a
  // row (measured faster on a large GPU:
  // bench/results/2026-12-01-nvidia-h200-session17-profile-qwen3-16k-int2-unrotate-dispatch.txt;
  // bench/rotate-kernel.ts times layouts).
  const blocks = build?.blocks ?? b.maxTokens > 1;
  const layout = build?.layout ?? ROTATE_PREFILL_LAYOUT;
  const pipeline = computePipeline(
    gpu,
    `rotate${count}${blocks ? '-blocks' : ''}`,
    rotateSource(count as 1 | 2 | 3, blocks, b.headDim, layout),
  );
  const words = [b.headDim, 0, 0, 0];
  for (const part of b.parts) {
    words.push(part.heads, part.headsPerMatrix, part.transpose ? 1 : 0, part.firstMatrix * b.headDim * b.headDim);
  }
  const params = uniformBuffer(gpu, `${label}.params`, words, 'u'.repeat(words.length));
  const heads = b.parts.reduce((sum, part) => sum + part.heads, 0);
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [
      ...b.parts.map((part) => part.x),
      ...b.parts.map((part) => part.rotation),
      params,
      b.step,
    ]),
    workgroups: [heads, blocks ? Math.ceil(b.maxTokens / rotateBlockTokens(b.headDim, layout)) : b.maxTokens, 1],
    owned: [params],
  };
}
