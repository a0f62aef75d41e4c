/**
 * CPU reference for kernels/matmul: y[t, n] = Σ_k W[n, k]·x[t, k] (+ bias[n]) in f64, with W already dequantized
 * (row-major [N, K]). Also returns Σ_k |W[n, k]·x[t, k]| per output, the scale f32 rounding errors grow with.
 */
export function matmulReference(
  w: Float32Array,
  x: Float32Array,
  K: number,
  N: number,
  tokens: number,
  bias?: Float32Array,
): { y: Float32Array; magnitude: Float64Array } {
  const y = new Float32Array(tokens * N);
  const magnitude = new Float64Array(tokens * N);
  for (let t = 0; t < tokens; t++) {
    for (let n = 0; n < N; n++) {
      let sum = bias ? bias[n] : 0;
      let abs = bias ? Math.abs(bias[n]) : 0;
      for (let k = 0; k < K; k++) {
        const p = w[n * K + k] * x[t * K + k];
        sum += p;
        abs += Math.abs(p);
      }
      y[t * N + n] = sum;
      magnitude[t * N + n] = abs;
    }
  }
  return { y, magnitude };
}

/** Largest |actual - expected| / (atol + rtol·magnitude); <= 1 means within tolerance. */
export function maxErrorRelativeToMagnitude(
  actual: ArrayLike<number>,
  expected: ArrayLike<number>,
  magnitude: ArrayLike<number>,
  rtol: number,
  atol = 1e-6,
): number {
  if (actual.length !== expected.length) throw new Error(`length ${actual.length} != ${expected.length}`);
  let worst = 0;
  for (let i = 0; i < actual.length; i++) {
    const r = Math.abs(actual[i] - expected[i]) / (atol + rtol * magnitude[i]);
    if (!(r <= worst)) worst = Number.isNaN(r) ? Number.POSITIVE_INFINITY : r;
  }
  return worst;
}
