import { NO_ROPE_SCALING, type RopeLayout, type RopeScaling } from '../rope.ts';

/**
 * Angle and magnitude of rotated pair `i` at `position`, in f64, written the way ggml computes them (rope_yarn): the
 * unscaled ("extrapolated") angle, the interpolated one (divided by the factor), YaRN's ramp between the two over
 * the correction dims, and llama.cpp's attn_factor with YaRN's magnitude correction. Deliberately not through
 * kernels/rope.ts's per-pair divisors, so the kernel's tests check those too.
 */
export function ropeAngleReference(
  i: number,
  position: number,
  options: { ropeDim: number; base: number; freqFactor?: number; scaling?: RopeScaling },
): { theta: number; magnitude: number } {
  const { ropeDim, base } = options;
  const s = options.scaling ?? NO_ROPE_SCALING;
  const extrapolated = (position * base ** ((-2 * i) / ropeDim)) / (options.freqFactor ?? 1);
  const freqScale = s.type === 'none' ? 1 : 1 / s.factor;
  const interpolated = extrapolated * freqScale;
  if (s.type !== 'yarn') return { theta: interpolated, magnitude: s.attnFactor };
  // Pairs that turn more than betaFast times over the original context keep their angle, fewer than betaSlow are
  // interpolated, linearly in between.
  const correctionDim = (rotations: number) =>
    (ropeDim * Math.log(s.originalContext / (rotations * 2 * Math.PI))) / (2 * Math.log(base));
  const low = Math.max(0, Math.floor(correctionDim(s.betaFast)));
  const high = Math.min(ropeDim - 1, Math.ceil(correctionDim(s.betaSlow)));
  const y = (i - low) / Math.max(0.001, high - low);
  const mix = 1 - Math.min(1, Math.max(0, y));
  // llama.cpp's context sets attn_factor = mscale(factor) / (1 + 0.1 ln factor) · rope.scaling.attn_factor, and
  // ggml multiplies it by 1 + 0.1 ln(1 / freqScale) again.
  const mscale = s.factor <= 1 ? 1 : 0.1 * Math.log(s.factor) + 1;
  const contextAttnFactor = (mscale / (1 + 0.1 * Math.log(s.factor))) * s.attnFactor;
  return {
    theta: interpolated * (1 - mix) + extrapolated * mix,
    magnitude: contextAttnFactor * (1 + 0.1 * Math.log(1 / freqScale)),
  };
}

/** What ropeReference rotates: `tokens` rows of `heads` heads from `position`, and the model's RoPE. */
export interface RopeReferenceOptions {
  tokens: number;
  heads: number;
  headDim: number;
  ropeDim: number;
  base: number;
  layout: RopeLayout;
  position: number;
  freqFactors?: Float32Array;
  scaling?: RopeScaling;
}

/** CPU reference for kernels/rope.wgsl (f64 trigonometry). Returns a rotated copy. */
export function ropeReference(x: Float32Array, options: RopeReferenceOptions): Float32Array {
  const { tokens, heads, headDim, ropeDim, base, layout, position } = options;
  const y = Float32Array.from(x);
  const half = ropeDim / 2;
  for (let t = 0; t < tokens; t++) {
    for (let h = 0; h < heads; h++) {
      const row = t * heads * headDim + h * headDim;
      for (let i = 0; i < half; i++) {
        const { theta, magnitude } = ropeAngleReference(i, position + t, {
          ropeDim,
          base,
          freqFactor: options.freqFactors?.[i],
          scaling: options.scaling,
        });
        const c = Math.cos(theta) * magnitude;
        const s = Math.sin(theta) * magnitude;
        const [a, b] = layout === 'neox' ? [row + i, row + i + half] : [row + 2 * i, row + 2 * i + 1];
        const x0 = x[a];
        const x1 = x[b];
        y[a] = x0 * c - x1 * s;
        y[b] = x0 * s + x1 * c;
      }
    }
  }
  return y;
}
