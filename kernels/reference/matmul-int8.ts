/**
 * CPU reference for kernels/matmul-int8: the activation quantizer, and what the int8 matmul computes, which is the
 * exact product of the weights with the activations as the codes represent them (x̂ = d·q per 32-element block).
 */

/** Round half to even, as WGSL's round(). */
function roundEven(v: number): number {
  const r = Math.round(v);
  return Math.abs(v % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/**
 * Codes q = round(x / d) with d = max|x| / 127 per block of 32, in f32 as the kernel does, and (d, d·Σq) per block.
 * The kernel divides once (1 / d) and multiplies: the same here, so codes agree but for a WGSL division's last ulp.
 */
export function quantizeActivationsReference(
  x: Float32Array,
  tokens: number,
  K: number,
): { codes: Int8Array; scales: Float32Array } {
  const blocks = K / 32;
  const codes = new Int8Array(tokens * K);
  const scales = new Float32Array(tokens * blocks * 2);
  for (let i = 0; i < tokens * blocks; i++) {
    let amax = 0;
    for (let e = 0; e < 32; e++) amax = Math.max(amax, Math.abs(x[32 * i + e]));
    const d = Math.fround(amax / 127);
    const inverse = d > 0 ? Math.fround(1 / d) : 0;
    let sum = 0;
    for (let e = 0; e < 32; e++) {
      const q = roundEven(Math.fround(x[32 * i + e] * inverse));
      codes[32 * i + e] = q;
      sum += q;
    }
    scales[2 * i] = d;
    scales[2 * i + 1] = Math.fround(d * sum);
  }
  return { codes, scales };
}

/** x̂[t, k] = d·q: the activations the int8 matmul multiplies. */
export function dequantizeActivations(codes: Int8Array, scales: Float32Array, tokens: number, K: number): Float32Array {
  const x = new Float32Array(tokens * K);
  for (let i = 0; i < tokens * K; i++) x[i] = scales[2 * Math.floor(i / 32)] * codes[i];
  return x;
}
