/** CPU reference for kernels/rmsnorm.wgsl (f64 accumulation). */
export function rmsnormReference(
  x: Float32Array,
  weight: Float32Array,
  rows: number,
  dim: number,
  eps: number,
  /** Added to (Gemma's post-norms: the residual stream the normalized rows join), else zeros. */
  into?: Float32Array,
): Float32Array {
  const y = into ? Float32Array.from(into) : new Float32Array(rows * dim);
  for (let r = 0; r < rows; r++) {
    let sum = 0;
    for (let i = 0; i < dim; i++) sum += x[r * dim + i] * x[r * dim + i];
    const scale = 1 / Math.sqrt(sum / dim + eps);
    for (let i = 0; i < dim; i++) y[r * dim + i] += x[r * dim + i] * scale * weight[i];
  }
  return y;
}
