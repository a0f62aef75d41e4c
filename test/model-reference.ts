/**
 * A whole-model CPU reference for the oracle tests: the llama/qwen2/qwen3/gemma3/smollm3 forward pass in f64 over
 * dequantized weights (kernels/reference/dequantize.ts), with the KV cache rounded to f16 as both engines store it (or
 * kept in f64 with `exactKv`).
 *
 * `emulateLlamaCpp` adds the conversions llama.cpp's CPU backend applies to activations, so the reference can say
 * which part of a difference to llama.cpp is llama.cpp's own rounding and which is ours:
 * - each matmul input becomes the weight type's "vec_dot" type first: f16 for F16, bf16 for BF16, int8 blocks of 32
 *   with an f16 scale (Q8_0/Q8_1) for Q4_0..Q8_0 and IQ4_NL, int8 blocks of 256 with an f32 scale (Q8_K) for K-quants
 *   and IQ4_XS;
 * - attention (no flash attention) multiplies f16 K by q rounded to f16, and f16 V by the softmax rounded to f16.
 */

import { readFile } from 'node:fs/promises';
import { GgmlType } from '../core/gguf-types.ts';
import { bf16ToF32, dequantize, f16ToF32, f32ToF16Bits } from '../kernels/reference/dequantize.ts';
import { ropeAngleReference } from '../kernels/reference/rope.ts';
import type { RopeScaling } from '../kernels/rope.ts';
import { sourceFromPath } from '../runtime/gguf/node-source.ts';
import { parseGguf } from '../runtime/gguf/parse.ts';
import type { KvPrecisionPlan } from '../runtime/kv/precision-plan.ts';
import { roundTripRows } from '../runtime/kv/quant-format.ts';

interface Matrix {
  type: GgmlType;
  /** Row length (GGUF ne0). */
  k: number;
  rows: number;
  values: Float32Array;
  /** Q4_1/Q5_1: each block's f16 min `m`, [rows × k/32]. */
  mins?: Float32Array;
}

const roundF16 = (x: number) => f16ToF32(f32ToF16Bits(x));
const scratch = new DataView(new ArrayBuffer(4));
function roundBf16(x: number): number {
  scratch.setFloat32(0, x);
  const u = scratch.getUint32(0);
  return bf16ToF32((u + 0x7fff + ((u >>> 16) & 1)) >>> 16);
}

/** Round half to even, as ggml's nearest_int (and x86 rounding) does. */
function roundEven(x: number): number {
  const r = Math.round(x);
  return Math.abs(x - Math.trunc(x)) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/** Emulates the activation conversion llama.cpp's CPU matmul applies before a dot product with `type` weights. */
export function llamaCppActivation(type: GgmlType, x: Float64Array): Float64Array {
  switch (type) {
    case GgmlType.F32:
      return x;
    case GgmlType.F16:
      return x.map(roundF16);
    case GgmlType.BF16:
      return x.map(roundBf16);
    case GgmlType.Q2_K:
    case GgmlType.Q3_K:
    case GgmlType.Q4_K:
    case GgmlType.Q5_K:
    case GgmlType.Q6_K:
    case GgmlType.IQ4_XS:
      return quantizeBlocks(x, 256, (_amax, max) => {
        const inverse = Math.fround(-127 / max);
        return { inverse, scale: Math.fround(1 / inverse) };
      });
    default:
      return quantizeBlocks(x, 32, (amax) => {
        const d = Math.fround(amax / 127);
        return { inverse: d ? Math.fround(1 / d) : 0, scale: roundF16(d) };
      });
  }
}

function quantizeBlocks(
  x: Float64Array,
  block: number,
  scales: (amax: number, max: number) => { inverse: number; scale: number },
): Float64Array {
  const y = new Float64Array(x.length);
  for (let b = 0; b < x.length; b += block) {
    let amax = 0;
    let max = 0;
    for (let j = b; j < b + block; j++) {
      if (Math.abs(x[j]) > amax) {
        amax = Math.abs(x[j]);
        max = x[j];
      }
    }
    if (amax === 0) continue;
    const { inverse, scale } = scales(amax, max);
    for (let j = b; j < b + block; j++) y[j] = Math.min(127, roundEven(Math.fround(x[j] * inverse))) * scale;
  }
  return y;
}

/** Per 32-block of `x`: f16(d·Σq) - f16(d)·Σq, where Q8_1 stores the first and the dequantized codes sum to the second. */
function q8_1SumErrors(x: Float64Array): Float64Array {
  const out = new Float64Array(x.length / 32);
  for (let b = 0; b < out.length; b++) {
    let amax = 0;
    for (let j = b * 32; j < b * 32 + 32; j++) amax = Math.max(amax, Math.abs(x[j]));
    const d = Math.fround(amax / 127);
    const inverse = d ? Math.fround(1 / d) : 0;
    let codes = 0;
    for (let j = b * 32; j < b * 32 + 32; j++) codes += Math.min(127, roundEven(Math.fround(x[j] * inverse)));
    out[b] = roundF16(Math.fround(d * codes)) - roundF16(d) * codes;
  }
  return out;
}

/** The f16 `m` of every 32-block of Q4_1/Q5_1 bytes (bytes 2-3 of each block). */
function blockMins(raw: Uint8Array, type: GgmlType): Float32Array {
  const blockBytes = type === GgmlType.Q4_1 ? 20 : 24;
  const view = new DataView(raw.buffer, raw.byteOffset, raw.byteLength);
  const out = new Float32Array(raw.byteLength / blockBytes);
  for (let b = 0; b < out.length; b++) out[b] = f16ToF32(view.getUint16(b * blockBytes + 2, true));
  return out;
}

export interface ReferenceOptions {
  emulateLlamaCpp: boolean;
  /**
   * Emulates longtab's quantized KV cache as decoding sees it (one token per step): when the query is at position t,
   * a key/value at position j is read dequantized iff j is past the sink pages and its whole page is older than the
   * window ((page + 1) · pageTokens <= t − window). Rows are quantized from their f16-rounded values over the full
   * kvHeads × headDim width (runtime/kv/quant-format.ts), without rotation.
   */
  kvQuant?: {
    sink: number;
    window: number;
    pageTokens: number;
    groupSize: number;
    bits: 1 | 2 | 4;
    /** Per layer K and V bits and clip quantiles (runtime/kv/precision-plan.ts), replacing `bits` and clip 1. */
    plan?: KvPrecisionPlan;
  };
  /** Keeps K/V in f64 instead of rounding them to f16: the exact reference an f16 cache is measured against. */
  exactKv?: boolean;
  /** gemma3: every layer attends to the whole sequence (a model that ignored the sliding window, for contrast). */
  ignoreSlidingWindow?: boolean;
  /** smollm3: every layer applies RoPE (a model that ignored the no-RoPE layers, for contrast). */
  ropeEveryLayer?: boolean;
  /**
   * phi3: the longest sequence the model serves (llama.cpp's n_ctx_seq), which picks the LongRoPE set against the
   * original context; the file's context length by default, as the engine serves it.
   */
  contextTokens?: number;
  /** phi3: a LongRoPE set forced ('none': no factors), for contrast. */
  longRopeFactors?: 'long' | 'short' | 'none';
  /** Rotate every dim of the head, whatever `rope.dimension_count` says (a model that ignored partial rotary). */
  rotateAllDims?: boolean;
}

/** gelu's tanh form in f64. */
function gelu(x: number): number {
  return 0.5 * x * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * (x + 0.044715 * x ** 3)));
}

/**
 * llama.cpp's CPU gelu (ggml's GGML_GELU_FP16): 0 below -10, x above 10, else a table of f16 results looked up by the
 * f16 rounding of x.
 */
function llamaCppGelu(x: number): number {
  if (x <= -10) return 0;
  if (x >= 10) return x;
  return roundF16(Math.fround(gelu(roundF16(x))));
}

/**
 * Teacher-forced next-token log-probabilities, [ids.length × vocab], of the GGUF model at `path` (llama, qwen2, qwen3,
 * gemma3 or smollm3; norms and biases F32, matrices any type the reference dequantizer reads). gemma3 as llama.cpp
 * builds it (src/models/gemma3.cpp): embeddings times sqrt(dim), q/k norms, q scaled before the product, local layers
 * in a sliding window with their own RoPE base and no context scaling, post-norms, GeGLU. smollm3 as
 * src/models/smollm3.cpp: llama's, but layer l applies no RoPE where (l + 1) % 4 == 0 (n_no_rope_layer_step = 4).
 * phi3 as src/models/phi3.cpp: q, k, v fused in attn_qkv and gate, up in ffn_up (rows in that order), NEOX RoPE on
 * the first `rope.dimension_count` dims of each head with the LongRoPE set llama_model::get_rope_factors picks
 * (long where the context exceeds `rope.scaling.original_context_length`), q scaled before the product.
 * Every architecture rotates only the first `rope.dimension_count` dims.
 */
export async function referenceLogProbs(
  path: string,
  ids: readonly number[],
  options: ReferenceOptions,
): Promise<Float64Array> {
  const source = await sourceFromPath(path);
  const file = await parseGguf(source);
  await source.close?.();
  const bytes = await readFile(path);
  const meta = file.metadata;
  const tensors = new Map(file.tensors.map((t) => [t.name, t]));
  const data = (name: string) => {
    const t = tensors.get(name);
    if (!t) return null;
    const count = t.shape.reduce((a, b) => a * b, 1);
    const raw = new Uint8Array(bytes.buffer, bytes.byteOffset + t.offset, t.byteLength);
    return { type: t.type, shape: t.shape, raw, values: dequantize(t.type, raw, count) };
  };
  const matrix = (name: string): Matrix => {
    const t = data(name);
    if (!t) throw new Error(`reference: no tensor ${name}`);
    const matrix: Matrix = { type: t.type, k: t.shape[0], rows: t.shape[1], values: t.values };
    if (t.type === GgmlType.Q4_1 || t.type === GgmlType.Q5_1) matrix.mins = blockMins(t.raw, t.type);
    return matrix;
  };
  const vector = (name: string) => data(name)?.values ?? null;
  const num = (key: string) => {
    const v = meta[key];
    return typeof v === 'bigint' ? Number(v) : (v as number | undefined);
  };

  const arch = meta['general.architecture'] as string;
  const dim = num(`${arch}.embedding_length`)!;
  const heads = num(`${arch}.attention.head_count`)!;
  const kvHeads = num(`${arch}.attention.head_count_kv`) ?? heads;
  const headDim = num(`${arch}.attention.key_length`) ?? dim / heads;
  const layers = num(`${arch}.block_count`)!;
  const eps = num(`${arch}.attention.layer_norm_rms_epsilon`)!;
  const base = num(`${arch}.rope.freq_base`) ?? 10000;
  const scaling = ropeScalingOf(meta, arch, num);
  const neox = arch !== 'llama' && arch !== 'smollm3';
  const ropeDim = options.rotateAllDims ? headDim : (num(`${arch}.rope.dimension_count`) ?? headDim);
  const phi3 = arch === 'phi3';
  const originalContext = num(`${arch}.rope.scaling.original_context_length`) ?? num(`${arch}.context_length`)!;
  const contextTokens = options.contextTokens ?? num(`${arch}.context_length`)!;
  const longRope = options.longRopeFactors ?? (contextTokens > originalContext ? 'long' : 'short');
  const freqFactors =
    vector('rope_freqs.weight') ?? (longRope === 'none' ? null : vector(`rope_factors_${longRope}.weight`));
  const embedding = matrix('token_embd.weight');
  const output = tensors.has('output.weight') ? matrix('output.weight') : embedding;
  const vocab = embedding.rows;
  const emulate = options.emulateLlamaCpp;
  const gemma = arch === 'gemma3';
  // gemma3's sliding window (llama.cpp: every period-th layer global, default 6) and its local RoPE base.
  const swa = gemma ? (num(`${arch}.attention.sliding_window`) ?? 0) : 0;
  const period = num(`${arch}.attention.sliding_window_pattern`) ?? 6;
  const localBase = num(`${arch}.rope.freq_base_swa`) ?? 10000;
  const isLocal = (l: number) => swa > 0 && !options.ignoreSlidingWindow && (period === 0 || l % period < period - 1);
  const usesRope = (l: number) => arch !== 'smollm3' || options.ropeEveryLayer || (l + 1) % 4 !== 0;
  // What q is multiplied by: gemma3 and phi3 scale q itself (gemma3 by 1/sqrt(dim/heads) in the 62-layer 27B), others
  // the product.
  const scalesQ = gemma || phi3;
  const attentionScale = 1 / Math.sqrt(gemma && layers === 62 ? dim / heads : headDim);

  const matmul = (w: Matrix, x: Float64Array, bias?: Float32Array | null) => {
    const input = emulate ? llamaCppActivation(w.type, x) : x;
    const y = new Float64Array(w.rows);
    // Q8_1 keeps s = f16(d·Σq) per block and the Q4_1/Q5_1 dot product uses m·s, not m·f16(d)·Σq.
    const sumError = emulate && w.mins ? q8_1SumErrors(x) : null;
    const blocks = w.k / 32;
    for (let r = 0; r < w.rows; r++) {
      let sum = 0;
      for (let k = 0; k < w.k; k++) sum += w.values[r * w.k + k] * input[k];
      if (sumError && w.mins) for (let b = 0; b < blocks; b++) sum += w.mins[r * blocks + b] * sumError[b];
      y[r] = sum + (bias ? bias[r] : 0);
    }
    return y;
  };
  const rmsNorm = (x: Float64Array, weight: Float32Array) => {
    let sum = 0;
    for (const v of x) sum += v * v;
    const scale = 1 / Math.sqrt(sum / x.length + eps);
    return x.map((v, i) => v * scale * weight[i]);
  };
  const rope = (v: Float64Array, count: number, position: number, local: boolean) => {
    for (let h = 0; h < count; h++) {
      for (let i = 0; i < ropeDim / 2; i++) {
        const { theta, magnitude } = ropeAngleReference(i, position, {
          ropeDim,
          base: local ? localBase : base,
          freqFactor: freqFactors?.[i],
          scaling: local ? { ...scaling, type: 'none', factor: 1 } : scaling,
        });
        const [c, s] = [Math.cos(theta) * magnitude, Math.sin(theta) * magnitude];
        const a = neox ? h * headDim + i : h * headDim + 2 * i;
        const b = neox ? a + ropeDim / 2 : a + 1;
        const [x0, x1] = [v[a], v[b]];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
      }
    }
  };

  const n = ids.length;
  const embeddingScale = gemma ? Math.fround(Math.sqrt(dim)) : 1;
  const x = ids.map((id) =>
    Float64Array.from(embedding.values.subarray(id * dim, (id + 1) * dim), (v) => v * embeddingScale),
  );
  const activation = gemma
    ? (g: number) => (emulate ? llamaCppGelu(g) : gelu(g))
    : (g: number) => g / (1 + Math.exp(-g));
  for (let l = 0; l < layers; l++) {
    const p = `blk.${l}.`;
    const local = isLocal(l);
    const attnPostNorm = vector(`${p}post_attention_norm.weight`);
    const ffnPostNorm = vector(`${p}post_ffw_norm.weight`);
    const attnNorm = vector(`${p}attn_norm.weight`)!;
    const ffnNorm = vector(`${p}ffn_norm.weight`)!;
    const qkv = tensors.has(`${p}attn_qkv.weight`) ? matrix(`${p}attn_qkv.weight`) : null;
    const [wq, wk, wv] = qkv
      ? [
          rowsOf(qkv, 0, heads * headDim),
          rowsOf(qkv, heads * headDim, kvHeads * headDim),
          rowsOf(qkv, (heads + kvHeads) * headDim, kvHeads * headDim),
        ]
      : ['attn_q', 'attn_k', 'attn_v'].map((m) => matrix(`${p}${m}.weight`));
    const wo = matrix(`${p}attn_output.weight`);
    const fusedUp = phi3 ? matrix(`${p}ffn_up.weight`) : null;
    const [gate, up] = fusedUp
      ? [rowsOf(fusedUp, 0, fusedUp.rows / 2), rowsOf(fusedUp, fusedUp.rows / 2, fusedUp.rows / 2)]
      : ['ffn_gate', 'ffn_up'].map((m) => matrix(`${p}${m}.weight`));
    const down = matrix(`${p}ffn_down.weight`);
    const qNorm = vector(`${p}attn_q_norm.weight`);
    const kNorm = vector(`${p}attn_k_norm.weight`);
    const qs: Float64Array[] = [];
    const ks: Float64Array[] = [];
    const vs: Float64Array[] = [];
    for (let t = 0; t < n; t++) {
      const h = rmsNorm(x[t], attnNorm);
      const q = matmul(wq, h, vector(`${p}attn_q.bias`));
      const k = matmul(wk, h, vector(`${p}attn_k.bias`));
      const v = matmul(wv, h, vector(`${p}attn_v.bias`));
      if (qNorm && kNorm) {
        for (let i = 0; i < heads; i++) q.set(rmsNorm(q.subarray(i * headDim, (i + 1) * headDim), qNorm), i * headDim);
        for (let i = 0; i < kvHeads; i++)
          k.set(rmsNorm(k.subarray(i * headDim, (i + 1) * headDim), kNorm), i * headDim);
      }
      if (usesRope(l)) {
        rope(q, heads, t, local);
        rope(k, kvHeads, t, local);
      }
      // gemma3 and phi3 scale q before the product (llama.cpp rounds the scaled q to f16), the others the product.
      if (scalesQ) for (let i = 0; i < q.length; i++) q[i] *= attentionScale;
      qs.push(emulate ? q.map(roundF16) : q);
      ks.push(options.exactKv ? k : k.map(roundF16));
      vs.push(options.exactKv ? v : v.map(roundF16));
    }
    const kq = options.kvQuant;
    const quantized = kq
      ? (rows: Float64Array[], side: 'key' | 'value') => {
          const precision = kq.plan?.[l][side] ?? { bits: kq.bits, clipQuantile: 1 };
          const width = kvHeads * headDim;
          const back = roundTripRows(
            rows.flatMap((row) => Array.from(row)),
            { width, groupSize: kq.groupSize, ...precision },
          );
          return rows.map((_, t) => Float64Array.from(back.subarray(t * width, (t + 1) * width)));
        }
      : null;
    const kq8 = quantized ? { k: quantized(ks, 'key'), v: quantized(vs, 'value') } : null;
    const sinkPages = kq ? Math.ceil(kq.sink / kq.pageTokens) : 0;
    const keyAt = (t: number, j: number, store: 'k' | 'v') => {
      if (
        kq &&
        kq8 &&
        j >= sinkPages * kq.pageTokens &&
        (Math.floor(j / kq.pageTokens) + 1) * kq.pageTokens <= t - kq.window
      ) {
        return kq8[store][j];
      }
      return (store === 'k' ? ks : vs)[j];
    };
    const productScale = scalesQ ? 1 : attentionScale;
    for (let t = 0; t < n; t++) {
      const attention = new Float64Array(heads * headDim);
      // A local layer's query at t sees keys t - window + 1 .. t (llama.cpp's LLAMA_SWA_TYPE_STANDARD).
      const first = local ? Math.max(0, t + 1 - swa) : 0;
      for (let i = 0; i < heads; i++) {
        const g = Math.floor(i / (heads / kvHeads));
        const scores = new Float64Array(t + 1);
        let max = Number.NEGATIVE_INFINITY;
        for (let j = first; j <= t; j++) {
          let dot = 0;
          const key = keyAt(t, j, 'k');
          for (let e = 0; e < headDim; e++) dot += qs[t][i * headDim + e] * key[g * headDim + e];
          scores[j] = dot * productScale;
          max = Math.max(max, scores[j]);
        }
        let sum = 0;
        for (let j = first; j <= t; j++) {
          scores[j] = Math.exp(scores[j] - max);
          sum += scores[j];
        }
        for (let j = first; j <= t; j++) {
          const weight = emulate ? roundF16(scores[j] / sum) : scores[j] / sum;
          const value = keyAt(t, j, 'v');
          for (let e = 0; e < headDim; e++) attention[i * headDim + e] += weight * value[g * headDim + e];
        }
      }
      const o = matmul(wo, attention, vector(`${p}attn_output.bias`));
      const projected = attnPostNorm ? rmsNorm(o, attnPostNorm) : o;
      x[t] = x[t].map((v, i) => v + projected[i]);
      const h = rmsNorm(x[t], ffnNorm);
      const g = matmul(gate, h, vector(`${p}ffn_gate.bias`));
      const u = matmul(up, h, vector(`${p}ffn_up.bias`));
      const hidden = g.map((a, i) => activation(a) * u[i]);
      const d = matmul(down, hidden, vector(`${p}ffn_down.bias`));
      const y = ffnPostNorm ? rmsNorm(d, ffnPostNorm) : d;
      x[t] = x[t].map((v, i) => v + y[i]);
    }
  }
  const outputNorm = vector('output_norm.weight')!;
  const logProbs = new Float64Array(n * vocab);
  for (let t = 0; t < n; t++) {
    const logits = matmul(output, rmsNorm(x[t], outputNorm), vector('output.bias'));
    let max = Number.NEGATIVE_INFINITY;
    for (const v of logits) max = Math.max(max, v);
    let sum = 0;
    for (const v of logits) sum += Math.exp(v - max);
    const lse = max + Math.log(sum);
    for (let i = 0; i < vocab; i++) logProbs[t * vocab + i] = logits[i] - lse;
  }
  return logProbs;
}

/** Rows `first .. first + count` of a matrix (a fused matrix's part). */
function rowsOf(m: Matrix, first: number, count: number): Matrix {
  const part: Matrix = {
    type: m.type,
    k: m.k,
    rows: count,
    values: m.values.subarray(first * m.k, (first + count) * m.k),
  };
  const blocks = m.k / 32;
  if (m.mins) part.mins = m.mins.subarray(first * blocks, (first + count) * blocks);
  return part;
}

/**
 * RoPE scaling from the file's metadata, read as llama.cpp reads it (llama-model.cpp, llama-context.cpp): the type
 * defaults to linear, the factor is `rope.scaling.factor` or the older `rope.scale_linear` (0 or absent: none), YaRN's
 * original context defaults to the training context, and the beta bounds are llama.cpp's defaults for these
 * architectures (it reads no beta keys for them).
 */
function ropeScalingOf(
  meta: Record<string, unknown>,
  arch: string,
  num: (key: string) => number | undefined,
): RopeScaling {
  const type = (meta[`${arch}.rope.scaling.type`] as string | undefined) ?? 'linear';
  const factor = num(`${arch}.rope.scaling.factor`) ?? num(`${arch}.rope.scale_linear`) ?? 0;
  if (type !== 'none' && type !== 'linear' && type !== 'yarn') throw new Error(`reference: rope scaling ${type}`);
  const scaled = type !== 'none' && factor !== 0;
  return {
    type: type === 'yarn' ? 'yarn' : scaled ? 'linear' : 'none',
    factor: scaled ? factor : 1,
    originalContext: num(`${arch}.rope.scaling.original_context_length`) ?? num(`${arch}.context_length`) ?? 0,
    betaFast: 32,
    betaSlow: 1,
    attnFactor: num(`${arch}.rope.scaling.attn_factor`) ?? 1,
  };
}
