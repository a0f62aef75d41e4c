import { rmsnormReference } from './rmsnorm.ts';
import { type RopeReferenceOptions, ropeReference } from './rope.ts';
import { rotateReference } from './rotate.ts';

/**
 * CPU reference for kernels/rope-append.wgsl, one decode token: q and k normalized per head (headNorm), RoPE'd, then
 * q and k multiplied by their KV head's R_K and v by R_V (rotation). Returns the finished q, k and v in f32; the
 * kernel stores k and v as f16.
 */
export function ropeAppendReference(
  input: Omit<RopeReferenceOptions, 'tokens'> & {
    q: Float32Array;
    k: Float32Array;
    v: Float32Array;
    kvHeads: number;
    headNorm?: { q: Float32Array; k: Float32Array; eps: number };
    /** Matrices [n, headDim, headDim] row-major; KV head h uses matrix firstMatrix + h. */
    rotation?: { key: Float32Array; value: Float32Array; firstMatrix: number };
  },
): { q: Float32Array; k: Float32Array; v: Float32Array } {
  const { heads, kvHeads, headDim, headNorm, rotation } = input;
  const rope = { ...input, tokens: 1 };
  const qNormed = headNorm ? rmsnormReference(input.q, headNorm.q, heads, headDim, headNorm.eps) : input.q;
  const kNormed = headNorm ? rmsnormReference(input.k, headNorm.k, kvHeads, headDim, headNorm.eps) : input.k;
  const q = ropeReference(qNormed, { ...rope, heads });
  const k = ropeReference(kNormed, { ...rope, heads: kvHeads });
  if (!rotation) return { q, k, v: Float32Array.from(input.v) };
  const rotate = (x: Float32Array, matrices: Float32Array, n: number) =>
    rotateReference(x, matrices, {
      tokens: 1,
      heads: n,
      headDim,
      headsPerMatrix: n / kvHeads,
      firstMatrix: rotation.firstMatrix,
      transpose: false,
    });
  return {
    q: rotate(q, rotation.key, heads),
    k: rotate(k, rotation.key, kvHeads),
    v: rotate(input.v, rotation.value, kvHeads),
  };
}
