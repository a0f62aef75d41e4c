/** CPU references for kernels/covariance.wgsl (f64). */
export function covarianceReference(
  x: Float32Array,
  o: { tokens: number; heads: number; headDim: number; matrices: number; weights?: Float32Array },
): Float64Array {
  const d = o.headDim;
  const hpm = o.heads / o.matrices;
  const cov = new Float64Array(o.matrices * d * d);
  for (let t = 0; t < o.tokens; t++) {
    for (let h = 0; h < o.heads; h++) {
      const m = Math.floor(h / hpm);
      const w = o.weights ? o.weights[t * o.matrices + m] : 1;
      const base = (t * o.heads + h) * d;
      for (let i = 0; i < d; i++) for (let j = 0; j < d; j++) cov[(m * d + i) * d + j] += w * x[base + i] * x[base + j];
    }
  }
  return cov;
}

export function keyEnergyReference(
  k: Float32Array,
  moment: Float32Array,
  tokens: number,
  kvHeads: number,
  d: number,
): Float64Array {
  const out = new Float64Array(tokens * kvHeads);
  for (let t = 0; t < tokens; t++) {
    for (let m = 0; m < kvHeads; m++) {
      const base = (t * kvHeads + m) * d;
      let total = 0;
      for (let i = 0; i < d; i++)
        for (let j = 0; j < d; j++) total += k[base + i] * moment[(m * d + i) * d + j] * k[base + j];
      out[t * kvHeads + m] = total;
    }
  }
  return out;
}
