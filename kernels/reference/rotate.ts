/** CPU reference for kernels/rotate.wgsl: x[t,h,:] · R (or Rᵀ) per head, f64 accumulation. */
export function rotateReference(
  x: Float32Array,
  rotation: Float32Array,
  o: {
    tokens: number;
    heads: number;
    headDim: number;
    headsPerMatrix: number;
    firstMatrix: number;
    transpose: boolean;
  },
): Float32Array {
  const d = o.headDim;
  const y = new Float32Array(x.length);
  for (let t = 0; t < o.tokens; t++) {
    for (let h = 0; h < o.heads; h++) {
      const base = (t * o.heads + h) * d;
      const m = (o.firstMatrix + Math.floor(h / o.headsPerMatrix)) * d * d;
      for (let j = 0; j < d; j++) {
        let acc = 0;
        for (let i = 0; i < d; i++)
          acc += x[base + i] * (o.transpose ? rotation[m + j * d + i] : rotation[m + i * d + j]);
        y[base + j] = acc;
      }
    }
  }
  return y;
}
