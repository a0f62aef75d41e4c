import type { RopeLayout } from '../rope.ts';

/** CPU reference for kernels/rope.wgsl (f64 trigonometry). Returns a rotated copy. */
export function ropeReference(
  x: Float32Array,
  options: {
    tokens: number;
    heads: number;
    headDim: number;
    ropeDim: number;
    base: number;
    layout: RopeLayout;
    position: number;
    freqFactors?: Float32Array;
  },
): Float32Array {
  const { tokens, heads, headDim, ropeDim, base, layout, position } = options;
  const y = Float32Array.from(x);
  const half = ropeDim / 2;
  for (let t = 0; t < tokens; t++) {
    for (let h = 0; h < heads; h++) {
      const row = t * heads * headDim + h * headDim;
      for (let i = 0; i < half; i++) {
        const factor = options.freqFactors ? options.freqFactors[i] : 1;
        const theta = ((position + t) * base ** ((-2 * i) / ropeDim)) / factor;
        const [a, b] = layout === 'neox' ? [row + i, row + i + half] : [row + 2 * i, row + 2 * i + 1];
        const x0 = x[a];
        const x1 = x[b];
        y[a] = x0 * Math.cos(theta) - x1 * Math.sin(theta);
        y[b] = x0 * Math.sin(theta) + x1 * Math.cos(theta);
      }
    }
  }
  return y;
}
