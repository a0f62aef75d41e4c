/** CPU reference for kernels/rmsnorm.wgsl (f64 accumulation). */
export function rmsnormReference(
  x: Float32Array,
  weight: Float32Array,
  rows: number,
  dim: number,
  eps: number,
): Float32Array {
  const y = new Float32Array(rows * dim);
  for (let r = 0; r < rows; r++) {
    let sum = 0;
    for (let i = 0; i < dim; i++) sum += x[r * dim + i] * x[r * dim + i];
    const scale = 1 / Math.sqrt(sum / dim + eps);
    for (let i = 0; i < dim; i++) y[r * dim + i] = x[r * dim + i] * scale * weight[i];
  }
  return y;
}
