/**
 * CPU reference for the int8 prefill attention (kernels/attention-prefill-int8.wgsl.ts on tensor cores and
 * attention-prefill-dot.wgsl.ts on dot4I8Packed): the same quantization, tiling and f32 steps, so the kernels are
 * checked to the last few codes rather than against exact attention (attention.ts's reference, which it matches only
 * to its 8-bit error).
 *
 * Per query row: q·scale as int8 codes over the head (d_q = max / 127). Per key: k and v (f16 as the pages hold them)
 * as int8 codes over the head (d_k, d_v). The keys of a split are walked in tiles of 64 that start on
 * multiples of the tile (a split's first tile holds only its keys from the split's start); per tile: s = S·d_q·d_k
 * (S the integer dot product), the running maximum, p = exp(s − max), w = p·d_v as codes on the row's 127 steps of
 * the tile (d_w = max w / 127), acc = acc·correction + d_w·Σ c(w)·c(v), l = l·correction + Σ p.
 * Splits merge as the merge pass does: Σ e^(m_s − M)·acc_s / Σ e^(m_s − M)·l_s.
 */
import { type AttentionReferenceInput, roundToF16, windowFirstKey } from './attention.ts';

const TILE_KEYS = 64;

/** Round half to even, as WGSL's round(). */
function roundEven(v: number): number {
  const r = Math.round(v);
  return Math.abs(v % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/** int8 codes of `values` on 127 steps of their largest magnitude, and that step (f32 arithmetic, as the kernel). */
export function int8Codes(values: ArrayLike<number>): { codes: Int8Array; step: number } {
  let amax = 0;
  for (let i = 0; i < values.length; i++) amax = Math.max(amax, Math.abs(values[i]));
  const step = Math.fround(amax / 127);
  const inverse = step > 1e-30 ? Math.fround(1 / step) : 0;
  const out = new Int8Array(values.length);
  for (let i = 0; i < values.length; i++) out[i] = roundEven(Math.fround(values[i] * inverse));
  return { codes: out, step };
}

export interface AttentionInt8ReferenceInput extends AttentionReferenceInput {
  /** The split pass's settings (kernels/attention.ts: splits, minChunkKeys). */
  splits: number;
  minChunkKeys: number;
}

export function attentionInt8Reference(input: AttentionInt8ReferenceInput): Float32Array {
  const { q, k, v, position, tokens, heads, kvHeads, headDim, scale } = input;
  const group = heads / kvHeads;
  const length = position + tokens;
  const kvStride = kvHeads * headDim;
  const stored = (x: number) => (input.stored ? x : roundToF16(x));
  // Codes of every key's and value's head.
  const keyCodes: { codes: Int8Array; step: number }[] = [];
  const valueCodes: { codes: Int8Array; step: number }[] = [];
  for (let j = 0; j < length; j++) {
    for (let kvh = 0; kvh < kvHeads; kvh++) {
      const at = j * kvStride + kvh * headDim;
      keyCodes.push(int8Codes(Array.from(k.subarray(at, at + headDim), stored)));
      valueCodes.push(int8Codes(Array.from(v.subarray(at, at + headDim), stored)));
    }
  }
  const chunk = Math.max(Math.max(input.minChunkKeys, 1), Math.ceil(length / input.splits));
  const f32Scale = Math.fround(scale);
  const out = new Float32Array(tokens * heads * headDim);
  for (let t = 0; t < tokens; t++) {
    const visible = position + t + 1;
    const first = windowFirstKey(position + t, input.window);
    for (let h = 0; h < heads; h++) {
      const kvh = Math.floor(h / group);
      const qBase = (t * heads + h) * headDim;
      const query = int8Codes(Array.from(q.subarray(qBase, qBase + headDim), (x) => Math.fround(x * f32Scale)));
      const partials: { m: number; l: number; acc: Float64Array }[] = [];
      for (let start = 0; start < Math.min(length, visible); start += chunk) {
        let m = Number.NEGATIVE_INFINITY;
        let l = 0;
        const acc = new Float64Array(headDim);
        const end = Math.min(start + chunk, visible);
        for (let tile = start - (start % TILE_KEYS); tile < end; tile += TILE_KEYS) {
          // Keys before the split's start, or the row's window, are masked in the kernel's tile: left out here.
          const block = Math.max(tile, start, first);
          const n = Math.min(tile + TILE_KEYS, end) - block;
          if (n <= 0) continue;
          const s = new Float64Array(n);
          let tileMax = Number.NEGATIVE_INFINITY;
          for (let j = 0; j < n; j++) {
            const key = keyCodes[(block + j) * kvHeads + kvh];
            let dot = 0;
            for (let d = 0; d < headDim; d++) dot += query.codes[d] * key.codes[d];
            s[j] = Math.fround(Math.fround(dot * query.step) * key.step);
            tileMax = Math.max(tileMax, s[j]);
          }
          const best = Math.max(m, tileMax);
          const correction = m === Number.NEGATIVE_INFINITY ? 1 : Math.exp(m - best);
          const w = new Float64Array(n);
          let pSum = 0;
          let wMax = 0;
          for (let j = 0; j < n; j++) {
            const p = Math.exp(s[j] - best);
            pSum += p;
            w[j] = Math.fround(p * valueCodes[(block + j) * kvHeads + kvh].step);
            wMax = Math.max(wMax, w[j]);
          }
          const wStep = Math.fround(wMax / 127);
          const inverse = wMax > 1e-30 ? Math.fround(127 / wMax) : 0;
          for (let d = 0; d < headDim; d++) {
            let sum = 0;
            for (let j = 0; j < n; j++) {
              sum += roundEven(Math.fround(w[j] * inverse)) * valueCodes[(block + j) * kvHeads + kvh].codes[d];
            }
            acc[d] = acc[d] * correction + wStep * sum;
          }
          l = l * correction + pSum;
          m = best;
        }
        partials.push({ m, l, acc });
      }
      const top = Math.max(...partials.map((p) => p.m));
      let total = 0;
      const sum = new Float64Array(headDim);
      for (const p of partials) {
        const weight = Math.exp(p.m - top);
        total += weight * p.l;
        for (let d = 0; d < headDim; d++) sum[d] += weight * p.acc[d];
      }
      for (let d = 0; d < headDim; d++) out[qBase + d] = sum[d] / total;
    }
  }
  return out;
}
