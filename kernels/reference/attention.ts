/**
 * CPU reference for kernels/attention*.wgsl, and the f32 → f16 rounding the KV cache applies (`pack2x16float`:
 * round to nearest even, overflow to ±Inf). Node 20 has no Math.f16round.
 */
const scratch = new DataView(new ArrayBuffer(4));

/** The IEEE half bits of `value`, rounded to nearest even. */
export function f16Bits(value: number): number {
  scratch.setFloat32(0, value, true);
  const x = scratch.getUint32(0, true);
  const sign = (x >>> 16) & 0x8000;
  const exp = (x >>> 23) & 0xff;
  const mant = x & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  const e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    // Subnormal half: shift the implicit-1 mantissa right, rounding to nearest even.
    const m = mant | 0x800000;
    const shift = 14 - e;
    const half = 1 << (shift - 1);
    const rest = m & ((1 << shift) - 1);
    let out = m >>> shift;
    if (rest > half || (rest === half && out & 1)) out++;
    return sign | out;
  }
  let out = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && out & 1)) out++;
  return sign | out;
}

export function f16BitsToNumber(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 0x1f) return mant ? Number.NaN : sign * Number.POSITIVE_INFINITY;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}

/** `value` rounded to the nearest f16, as a number. */
export function roundToF16(value: number): number {
  return f16BitsToNumber(f16Bits(value));
}

export interface AttentionReferenceInput {
  /** f32 [tokens, heads*headDim]: the step's queries, already RoPE'd. */
  q: Float32Array;
  /** f32 [length, kvHeads*headDim]: every key of the sequence (positions 0..length-1), before f16 rounding. */
  k: Float32Array;
  v: Float32Array;
  /** Position of the first query token; query t sits at `position + t` and sees keys 0..position+t. */
  position: number;
  /** A sliding window: query t sees only keys position + t − window + 1 .. position + t. */
  window?: number;
  tokens: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  scale: number;
  /** k and v are the values the cache holds (e.g. dequantized rows): use them as they are, no f16 rounding. */
  stored?: boolean;
}

/** The first key the query at `position` sees: 0, or in a sliding window of `window` keys position − window + 1. */
export function windowFirstKey(position: number, window: number | undefined): number {
  return window === undefined ? 0 : Math.max(0, position + 1 - window);
}

/**
 * Plain causal GQA attention in f64 over f16-rounded K/V (the cache stores f16; or over the stored values as given,
 * `stored`, for quantized pages: dequantizeRow of what they hold): query head h reads KV head
 * floor(h / (heads / kvHeads)). Returns f32 [tokens, heads*headDim].
 */
export function attentionReference(input: AttentionReferenceInput): Float32Array {
  const { q, k, v, position, tokens, heads, kvHeads, headDim, scale } = input;
  const group = heads / kvHeads;
  const kvStride = kvHeads * headDim;
  const length = position + tokens;
  const kr = new Float64Array(length * kvStride);
  const vr = new Float64Array(length * kvStride);
  for (let i = 0; i < kr.length; i++) {
    kr[i] = input.stored ? k[i] : roundToF16(k[i]);
    vr[i] = input.stored ? v[i] : roundToF16(v[i]);
  }
  const out = new Float32Array(tokens * heads * headDim);
  const scores = new Float64Array(length);
  for (let t = 0; t < tokens; t++) {
    const visible = position + t + 1;
    const first = windowFirstKey(position + t, input.window);
    for (let h = 0; h < heads; h++) {
      const kvh = Math.floor(h / group);
      const qBase = (t * heads + h) * headDim;
      let max = Number.NEGATIVE_INFINITY;
      for (let j = first; j < visible; j++) {
        const kBase = j * kvStride + kvh * headDim;
        let dot = 0;
        for (let d = 0; d < headDim; d++) dot += q[qBase + d] * kr[kBase + d];
        scores[j] = dot * scale;
        if (scores[j] > max) max = scores[j];
      }
      let sum = 0;
      for (let j = first; j < visible; j++) sum += scores[j] = Math.exp(scores[j] - max);
      for (let d = 0; d < headDim; d++) {
        let acc = 0;
        for (let j = first; j < visible; j++) acc += scores[j] * vr[j * kvStride + kvh * headDim + d];
        out[qBase + d] = acc / sum;
      }
    }
  }
  return out;
}
