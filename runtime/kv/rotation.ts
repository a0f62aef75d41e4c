/**
 * Orthogonal rotations for the 2-bit KV cache (OSCAR, QuaRot). A rotation R (headDim × headDim, row-major,
 * applied as x · R) spreads outlier channels over all channels so token-wise 2-bit groups lose less. K and Q are
 * rotated by the same R after RoPE (q·k is unchanged); V is rotated before it is stored and the attention output is
 * rotated back by Rᵀ (applied at run time for every weight format: see docs/kv-cache.md).
 */
import { InvalidRequestError } from '../../core/errors.ts';

export type RotationKind = 'calibrated' | 'hadamard' | 'none';

/**
 * What the cache stores K/V rotated by: nothing, Sylvester's Hadamard matrix, or matrices calibrated to the model
 * (f32 [layers × kvHeads × headDim × headDim] each for K and V, runtime/calibration/calibrate.ts). The forward pass
 * applies it around the pool (createKvAttention); the pool itself stores whatever rows it is given.
 */
export type KvRotation =
  | { kind: 'none' }
  | { kind: 'hadamard' }
  | { kind: 'calibrated'; key: Float32Array; value: Float32Array };

/** Normalized Sylvester Hadamard matrix of order n (a power of two): orthogonal, entries ±1/√n. */
export function hadamardMatrix(n: number): Float64Array {
  if (!Number.isInteger(n) || n < 1 || (n & (n - 1)) !== 0) {
    throw new InvalidRequestError(`A Hadamard rotation needs a power-of-two head dimension, got ${n}.`);
  }
  const h = new Float64Array(n * n);
  const scale = 1 / Math.sqrt(n);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < n; j++) {
      // Sylvester: H[i][j] = (-1)^popcount(i & j)
      let bits = i & j;
      let parity = 0;
      while (bits) {
        parity ^= bits & 1;
        bits >>>= 1;
      }
      h[i * n + j] = parity ? -scale : scale;
    }
  }
  return h;
}

export function identityMatrix(n: number): Float64Array {
  const m = new Float64Array(n * n);
  for (let i = 0; i < n; i++) m[i * n + i] = 1;
  return m;
}

/** Bit-reversal order of 0..n-1 (n a power of two). */
export function bitReversalOrder(n: number): number[] {
  const bits = Math.round(Math.log2(n));
  return Array.from({ length: n }, (_, i) => {
    let r = 0;
    for (let b = 0; b < bits; b++) if (i & (1 << b)) r |= 1 << (bits - 1 - b);
    return r;
  });
}

export function multiply(a: Float64Array, b: Float64Array, n: number): Float64Array {
  const c = new Float64Array(n * n);
  for (let i = 0; i < n; i++) {
    for (let k = 0; k < n; k++) {
      const aik = a[i * n + k];
      if (aik === 0) continue;
      for (let j = 0; j < n; j++) c[i * n + j] += aik * b[k * n + j];
    }
  }
  return c;
}

export function transpose(a: Float64Array, n: number): Float64Array {
  return transposedMatrices(a, n);
}

/**
 * Eigendecomposition of a symmetric matrix by cyclic Jacobi rotations (n ≤ 256: fast enough, and exact to f64).
 * Returns eigenvalues (descending) and eigenvectors as the COLUMNS of `vectors`.
 */
export function symmetricEigen(matrix: Float64Array, n: number): { values: Float64Array; vectors: Float64Array } {
  const a = Float64Array.from(matrix);
  const v = identityMatrix(n);
  for (let sweep = 0; sweep < 60; sweep++) {
    let off = 0;
    for (let p = 0; p < n; p++) for (let q = p + 1; q < n; q++) off += a[p * n + q] ** 2;
    if (
      off <
      1e-22 *
        Math.max(
          1,
          a.reduce((s, x) => s + x * x, 0),
        )
    )
      break;
    for (let p = 0; p < n - 1; p++) {
      for (let q = p + 1; q < n; q++) {
        const apq = a[p * n + q];
        if (Math.abs(apq) < 1e-300) continue;
        const theta = (a[q * n + q] - a[p * n + p]) / (2 * apq);
        const t = Math.sign(theta || 1) / (Math.abs(theta) + Math.sqrt(theta * theta + 1));
        const c = 1 / Math.sqrt(t * t + 1);
        const s = t * c;
        for (let k = 0; k < n; k++) {
          const akp = a[k * n + p];
          const akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (let k = 0; k < n; k++) {
          const apk = a[p * n + k];
          const aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
        for (let k = 0; k < n; k++) {
          const vkp = v[k * n + p];
          const vkq = v[k * n + q];
          v[k * n + p] = c * vkp - s * vkq;
          v[k * n + q] = s * vkp + c * vkq;
        }
      }
    }
  }
  const order = Array.from({ length: n }, (_, i) => i).sort((x, y) => a[y * n + y] - a[x * n + x]);
  const values = Float64Array.from(order, (i) => a[i * n + i]);
  const vectors = new Float64Array(n * n);
  for (let col = 0; col < n; col++) for (let row = 0; row < n; row++) vectors[row * n + col] = v[row * n + order[col]];
  return { values, vectors };
}

/**
 * OSCAR's rotation from a target covariance Σ: R = U · H · P, with U the eigenvectors of Σ (descending
 * eigenvalues), H the Hadamard matrix and P a permutation that sends the bit-reversal order of eigen-directions to
 * consecutive channels — so high-variance directions are spread evenly over the quantization groups.
 * Applied as x · R: x · U projects onto the eigenbasis, H mixes within it, P reorders channels.
 */
export function covarianceRotation(covariance: Float64Array, n: number): Float64Array {
  const { vectors } = symmetricEigen(covariance, n);
  // Columns of U in bit-reversal order first, so that consecutive Hadamard outputs draw evenly from the spectrum.
  const order = bitReversalOrder(n);
  const u = new Float64Array(n * n);
  for (let col = 0; col < n; col++) for (let row = 0; row < n; row++) u[row * n + col] = vectors[row * n + order[col]];
  return multiply(u, hadamardMatrix(n), n);
}

/** The rotation of each (layer, kv head), as f32 matrices [layers × kvHeads × headDim × headDim] for the GPU. */
export function rotationSet(kind: RotationKind, layers: number, kvHeads: number, headDim: number): Float32Array {
  const one = kind === 'none' ? identityMatrix(headDim) : hadamardMatrix(headDim);
  const out = new Float32Array(layers * kvHeads * headDim * headDim);
  for (let m = 0; m < layers * kvHeads; m++) out.set(one, m * headDim * headDim);
  return out;
}

/** Each n×n matrix of a set (row-major, back to back) transposed. */
export function transposedMatrices(set: Float32Array, n: number): Float32Array;
export function transposedMatrices(set: Float64Array, n: number): Float64Array;
export function transposedMatrices(set: Float32Array | Float64Array, n: number): Float32Array | Float64Array {
  const out = set.slice();
  for (let at = 0; at < set.length; at += n * n) {
    for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) out[at + j * n + i] = set[at + i * n + j];
  }
  return out;
}
