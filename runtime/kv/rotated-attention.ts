import type { GpuContext } from '../../core/gpu/device.ts';
import type { OutputRotation } from '../../kernels/attention.ts';
import { prepareRotate, type RotatePart } from '../../kernels/rotate.ts';
import type { KvAttentionBackend } from '../model/transformer.ts';

/** A layer's output rotation: the merge pass's, and the same matrices transposed for graphs without one. */
export interface LayerOutputRotation extends OutputRotation {
  /**
   * The matrices transposed (the same buffer where they are symmetric), for the un-rotation dispatch of graphs
   * without a merge pass: a product with Rᵀ read row-wise from them is a plain product, whose matrix loads coalesce
   * (measured faster than reading R column-wise: bench/results/2026-12-01-nvidia-h200-session22-rotate-kernel.json,
   * from `bench/rotate-kernel.ts`).
   */
  transposed: GPUBuffer;
}

/** The paged attention as the rotation sees it: a backend whose output it can ask to be un-rotated. */
export interface UnrotatingKvAttention {
  prepareLayer(
    layer: number,
    buffers: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer },
    maxTokens: number,
    outputRotation?: LayerOutputRotation,
  ): ReturnType<KvAttentionBackend['prepareLayer']>;
}

export interface KvRotations {
  /** f32 [layers × kvHeads × headDim × headDim]: applied to q and k after RoPE (q·k unchanged). */
  key: GPUBuffer;
  /** f32 [layers × kvHeads × headDim × headDim]: applied to v before storage; Rᵀ undoes it on the output. */
  value: GPUBuffer;
  /**
   * `value` with each matrix transposed (or `value` itself where its matrices are symmetric): the un-rotation
   * dispatch of prefill graphs reads Rᵀ row-wise from it.
   */
  valueTransposed: GPUBuffer;
}

/**
 * Wraps the paged attention so everything the cache stores is rotated: k·R_K and v·R_V go in, q·R_K reads them, and
 * the attention output is rotated back by R_Vᵀ (orthogonal R: exact up to rounding). Applied at run time for every
 * weight format (no folding into W_v/W_o): one small dispatch of per-head matrix products per layer for q, k and v;
 * the paged attention un-rotates its output (PagedKvAttention.prepareLayer's outputRotation).
 */
export class RotatedKvAttention implements KvAttentionBackend {
  constructor(
    private readonly gpu: GpuContext,
    private readonly inner: UnrotatingKvAttention,
    private readonly rotations: KvRotations,
    private readonly shape: { heads: number; kvHeads: number; headDim: number },
    /** A uniform whose second word is this step's token count (the pool's KvStep). */
    private readonly step: GPUBuffer,
  ) {}

  prepareLayer(layer: number, b: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer }, maxTokens: number) {
    const { heads, kvHeads, headDim } = this.shape;
    const firstMatrix = layer * kvHeads;
    const part = (x: GPUBuffer, rotation: GPUBuffer, n: number): RotatePart => ({
      x,
      rotation,
      firstMatrix,
      heads: n,
      headsPerMatrix: n / kvHeads,
      transpose: false,
    });
    const { key, value } = this.rotations;
    const inner = this.inner.prepareLayer(layer, b, maxTokens, {
      matrices: value,
      transposed: this.rotations.valueTransposed,
      firstMatrix,
      headsPerMatrix: heads / kvHeads,
    });
    return {
      // q is final (RoPE applied) before the cache's append runs, so it is rotated with k and v in one dispatch.
      append: [
        prepareRotate(this.gpu, `blk.${layer}.rotate_qkv`, {
          parts: [part(b.q, key, heads), part(b.k, key, kvHeads), part(b.v, value, kvHeads)],
          step: this.step,
          maxTokens,
          headDim,
        }),
        ...inner.append,
      ],
      attention: inner.attention,
    };
  }
}
