import type { PreparedDispatch } from '../../kernels/dispatch.ts';
import { prepareRotate } from '../../kernels/rotate.ts';
import type { GpuContext } from '../gpu/device.ts';
import type { KvAttentionBackend } from '../model/transformer.ts';

export interface KvRotations {
  /** f32 [layers × kvHeads × headDim × headDim]: applied to q and k after RoPE (q·k unchanged). */
  key: GPUBuffer;
  /** f32 [layers × kvHeads × headDim × headDim]: applied to v before storage; Rᵀ undoes it on the output. */
  value: GPUBuffer;
}

/**
 * Wraps a KV backend so everything the cache stores is rotated: k·R_K and v·R_V go in, q·R_K reads them, and the
 * attention output is rotated back by R_Vᵀ (orthogonal R: exact up to rounding). Applied at run time for every
 * weight format (no folding into W_v/W_o), at the cost of four small per-head matrix products per layer.
 */
export class RotatedKvAttention implements KvAttentionBackend {
  constructor(
    private readonly gpu: GpuContext,
    private readonly inner: KvAttentionBackend,
    private readonly rotations: KvRotations,
    private readonly shape: { heads: number; kvHeads: number; headDim: number },
    /** A uniform whose second word is this step's token count (the pool's KvStep). */
    private readonly step: GPUBuffer,
  ) {}

  prepareLayer(layer: number, b: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer }, maxTokens: number) {
    const { heads, kvHeads, headDim } = this.shape;
    const firstMatrix = layer * kvHeads;
    const rotate = (
      label: string,
      x: GPUBuffer,
      rotation: GPUBuffer,
      n: number,
      transpose: boolean,
    ): PreparedDispatch =>
      prepareRotate(this.gpu, `blk.${layer}.${label}`, {
        x,
        rotation,
        firstMatrix,
        step: this.step,
        maxTokens,
        heads: n,
        headDim,
        headsPerMatrix: n / kvHeads,
        transpose,
      });
    const inner = this.inner.prepareLayer(layer, b, maxTokens);
    return {
      append: [
        rotate('rotate_k', b.k, this.rotations.key, kvHeads, false),
        rotate('rotate_v', b.v, this.rotations.value, kvHeads, false),
        ...inner.append,
      ],
      attention: [
        rotate('rotate_q', b.q, this.rotations.key, heads, false),
        ...inner.attention,
        rotate('unrotate_out', b.output, this.rotations.value, heads, true),
      ],
    };
  }
}
