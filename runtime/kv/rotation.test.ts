import { describe, expect, it } from 'vitest';
import { randomFloats, seededRandom } from '../../test/random.ts';
import {
  bitReversalOrder,
  covarianceRotation,
  hadamardMatrix,
  multiply,
  symmetricEigen,
  transpose,
} from './rotation.ts';

function maxAbsDiffFromIdentity(m: Float64Array, n: number): number {
  let worst = 0;
  for (let i = 0; i < n; i++)
    for (let j = 0; j < n; j++) worst = Math.max(worst, Math.abs(m[i * n + j] - (i === j ? 1 : 0)));
  return worst;
}

function rowTimes(x: Float64Array | Float32Array, r: Float64Array, n: number): Float64Array {
  const y = new Float64Array(n);
  for (let j = 0; j < n; j++) for (let i = 0; i < n; i++) y[j] += x[i] * r[i * n + j];
  return y;
}

function randomCovariance(n: number, seed: number): Float64Array {
  // Σ = AᵀA with a few strong directions, like real key statistics (outlier channels).
  const random = seededRandom(seed);
  const a = Float64Array.from(randomFloats(random, n * n, 1));
  for (let i = 0; i < n; i++) a[i * n + (i % 4)] *= 12;
  return multiply(transpose(a, n), a, n);
}

describe('KV rotations', () => {
  it.each([8, 64, 128])('the Hadamard matrix of order %i is orthogonal', (n) => {
    const h = hadamardMatrix(n);
    expect(maxAbsDiffFromIdentity(multiply(h, transpose(h, n), n), n)).toBeLessThan(1e-12);
  });

  it('bit reversal is a permutation', () => {
    expect(bitReversalOrder(8)).toEqual([0, 4, 2, 6, 1, 5, 3, 7]);
    expect(new Set(bitReversalOrder(64)).size).toBe(64);
  });

  it('the eigendecomposition reconstructs the matrix and orders eigenvalues', () => {
    const n = 16;
    const sigma = randomCovariance(n, 3);
    const { values, vectors } = symmetricEigen(sigma, n);
    for (let i = 1; i < n; i++) expect(values[i]).toBeLessThanOrEqual(values[i - 1]);
    const lambda = new Float64Array(n * n);
    for (let i = 0; i < n; i++) lambda[i * n + i] = values[i];
    const rebuilt = multiply(multiply(vectors, lambda, n), transpose(vectors, n), n);
    let worst = 0;
    for (let i = 0; i < n * n; i++) worst = Math.max(worst, Math.abs(rebuilt[i] - sigma[i]));
    expect(worst / values[0]).toBeLessThan(1e-10);
  });

  it.each([8, 64])('the calibrated rotation (order %i) is orthogonal and keeps q·k', (n) => {
    const r = covarianceRotation(randomCovariance(n, n), n);
    expect(maxAbsDiffFromIdentity(multiply(r, transpose(r, n), n), n)).toBeLessThan(1e-9);
    const random = seededRandom(99);
    for (let trial = 0; trial < 20; trial++) {
      const q = randomFloats(random, n, 3);
      const k = randomFloats(random, n, 3);
      const qr = rowTimes(q, r, n);
      const kr = rowTimes(k, r, n);
      let dot = 0;
      let dotRotated = 0;
      for (let i = 0; i < n; i++) {
        dot += q[i] * k[i];
        dotRotated += qr[i] * kr[i];
      }
      expect(Math.abs(dot - dotRotated)).toBeLessThan(1e-9 * (1 + Math.abs(dot)));
    }
  });

  it('the calibrated rotation spreads a dominant direction evenly over all channels', () => {
    const n = 64;
    const sigma = randomCovariance(n, 5);
    const r = covarianceRotation(sigma, n);
    // Variance of each rotated channel: diag(Rᵀ Σ R). Before rotation a few channels dominate.
    const rotated = multiply(multiply(transpose(r, n), sigma, n), r, n);
    const before = Array.from({ length: n }, (_, i) => sigma[i * n + i]);
    const after = Array.from({ length: n }, (_, i) => rotated[i * n + i]);
    const spread = (v: number[]) => Math.max(...v) / (v.reduce((a, b) => a + b, 0) / n);
    expect(spread(after)).toBeLessThan(spread(before) / 2);
  });
});
