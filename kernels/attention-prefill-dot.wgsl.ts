/**
 * The int8 prefill attention (attention-prefill-int8.wgsl.ts: the same quantization, tiles and arithmetic, so the
 * same CPU reference, kernels/reference/attention-int8.ts) on core WGSL's dot4I8Packed instead of tensor cores:
 * every adapter with subgroups runs it.
 *
 * Workgroup (split s, kv head, row tile): 128 invocations, 64 query rows; lanes 2m, 2m + 1 of a subgroup of size z
 * take row 16... of the tile, r = subgroup_id·z/2 + m, and split its work in halves: when staging, half of a row's
 * or key's dims; in the scores and softmax, keys 32·half.. of the tile; in p·v, dims half·HD/2.. of the row. The
 * row's q codes, scores, weights, running max and sums and output accumulators stay in registers; per tile of 64 keys:
 *   1. stage the keys' K and V as int8 codes and scales (the shared staging), then V transposed: for each dim, its
 *      64 keys' codes packed 4 to a word (vt), so p·v is dot4I8Packed along keys;
 *   2. 32 scores per invocation, each HD/4 dot4I8Packed of the row's q codes with a key's codes;
 *   3. the softmax of the row (the pair's maxima and sums by subgroupShuffleXor) and its 64 weights' codes;
 *   4. per own dim, 16 dot4I8Packed of the 64 weight codes with the dim's 64 value codes.
 * Output as the split kernel (attentionPartialSource): splits = 1 the normalized rows, else (max, sum, Σ p·V).
 */
import { attentionBindingsWgsl, SPLIT_CHUNK_WGSL, splitTileWgsl } from './attention.wgsl.ts';
import { type DecodeQuantShape, quantGroupsFitHeads } from './attention-decode.wgsl.ts';
import {
  INT8_ATTENTION_ROWS,
  INT8_ATTENTION_TILE_KEYS,
  int8AttentionStagingWgsl,
  transposeTileWgsl,
} from './attention-prefill-int8.wgsl.ts';
import { kvPagesReadableWgsl } from './kv-append.wgsl.ts';

export interface AttentionPrefillDotShape {
  headDim: 64 | 128;
  quant: DecodeQuantShape | null;
  /** Loops with constant bounds (a GPU compiler unrolls them) or run-time ones (CPU drivers): as AttentionDecodeShape. */
  unrolled: boolean;
  /** A sliding-window layer's build (WindowedShape). */
  windowed?: boolean;
}

const BK = INT8_ATTENTION_TILE_KEYS;

/** Workgroup storage: k, v and transposed v codes, the keys' two scales (q's codes live in registers). */
export function attentionPrefillDotWorkgroupBytes(headDim: number): number {
  return 3 * BK * headDim + 4 * 2 * BK;
}

/** The build for a head size and page formats, or null where the kernel does not serve them. */
export function attentionPrefillDotShape(
  headDim: number,
  quant: DecodeQuantShape | null,
  maxWorkgroupBytes: number,
  unrolled = true,
): AttentionPrefillDotShape | null {
  if ((headDim !== 64 && headDim !== 128) || !quantGroupsFitHeads(headDim, quant)) return null;
  if (quant && (32 / quant.kBits > headDim / 2 || 32 / quant.vBits > headDim / 2)) return null;
  return attentionPrefillDotWorkgroupBytes(headDim) <= maxWorkgroupBytes ? { headDim, quant, unrolled } : null;
}

export function attentionPrefillDotSource(shape: AttentionPrefillDotShape): string {
  const { headDim: HD, quant, windowed = false } = shape;
  const HW = HD / 4; // words of a row's or key's codes
  const HALF = HD / 2;
  const { fetchWgsl, codeScaleWgsl, tileLoopHead, tileMask } = int8AttentionStagingWgsl(HD, quant, false, windowed);

  return /* wgsl */ `
enable subgroups;
${attentionBindingsWgsl(quant !== null, windowed)}
${kvPagesReadableWgsl(5)}
${SPLIT_CHUNK_WGSL}
${fetchWgsl}
${codeScaleWgsl}

const HD: u32 = ${HD}u;
const HW: u32 = ${HW}u;
const KS: u32 = HW; // words between keys of the staged code tiles
const BK: u32 = ${BK}u;
const BW: u32 = ${BK / 4}u; // words of a dim's transposed value codes
const NONE: f32 = -1e30;

var<workgroup> kcodes: array<i32, ${BK * HW}>;
var<workgroup> vcodes: array<i32, ${BK * HW}>;
var<workgroup> vt: array<i32, ${HD * (BK / 4)}>; // [dim][key / 4]: 4 keys' value codes per word
var<workgroup> kscale: array<f32, ${BK}>;
var<workgroup> vscale: array<f32, ${BK}>;

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32,
        @builtin(subgroup_size) z: u32) {
${splitTileWgsl(`${INT8_ATTENTION_ROWS}u`, windowed)}
  // Lanes 2m, 2m + 1 share a row (or key): from the subgroup builtins, so the pair's shuffles meet.
  let r = sg * (z / 2u) + lane / 2u;
  let half = lane % 2u;
  let rowT = (firstRow + r) / group;
  let limit = select(0u, step.position + rowT + 1u, rowT < step.tokens); // keys visible to row r (causal)${
    windowed ? "\n  let first = windowStart(step.position + rowT); // ... from its sliding window's first" : ''
  }
  // Row r of q as int8 codes in registers (no workgroup storage: headDim 128 fits 32 KiB): this half's words, and
  // the pair's by shuffle.
  var qr = array<u32, ${HW}>();
  var dq = 0.0;
  {
    var vals: array<vec4<f32>, ${HALF / 4}>;
    if (rowT < step.tokens) {
      let at = (rowT * params.heads + kvh * group + (firstRow + r) % group) * HD + half * ${HALF}u;
      for (var i = 0u; i < ${HALF / 4}u; i++) {
        vals[i] = vec4<f32>(q[at + 4u * i], q[at + 4u * i + 1u], q[at + 4u * i + 2u], q[at + 4u * i + 3u]) * params.scale;
      }
    }
    dq = codeScale(vals);
    let inverse = select(0.0, 1.0 / dq, dq > 1e-30);
    for (var i = 0u; i < ${HALF / 4}u; i++) {
      let own = pack4xI8(vec4<i32>(round(vals[i] * inverse)));
      let other = subgroupShuffleXor(own, 1u);
      qr[half * ${HALF / 4}u + i] = own;
      qr[(1u - half) * ${HALF / 4}u + i] = other;
    }
  }
  // Loop bounds times one: ${shape.unrolled ? 'the constant 1 (a GPU compiler unrolls them)' : 'params.headDim / HD = 1, unknown to the compiler (kept as loops: lavapipe took minutes over the unrolled build)'}.
  let one = ${shape.unrolled ? '1u' : 'params.headDim / HD'};
  var m = NONE;
  var l = 0.0;
  var acc = array<f32, ${HALF}>();

${tileLoopHead}
    // V transposed: word (d, w) holds dim d's codes of keys 4w..4w+3.
${transposeTileWgsl(
  HD,
  (key, word) => `vcodes[(${key}) * HW + ${word}]`,
  (w, value) => `vt[${w}] = ${value};`,
)}
    workgroupBarrier();
    // Scores of keys 32·half + i against row r.
${tileMask('    ')}
    // Initialized explicitly: lavapipe did not zero a loop-local array again on each iteration (matmul-int8.wgsl.ts).
    var dots = array<i32, 32>();
    for (var w = 0u; w < HW * one; w++) {
      let qw = qr[w];
      for (var i = 0u; i < 32u * one; i++) {
        dots[i] += dot4I8Packed(qw, bitcast<u32>(kcodes[(32u * half + i) * HW + w]));
      }
    }
    // Scores, then the weights w = p·d_v in their place.
    var sc = array<f32, 32>();
    var tileMax = NONE;
    for (var i = 0u; i < 32u * one; i++) {
      let j = 32u * half + i;
      sc[i] = select(NONE, f32(dots[i]) * dq * kscale[j], j >= skip && j < visible);
      tileMax = max(tileMax, sc[i]);
    }
    tileMax = max(tileMax, subgroupShuffleXor(tileMax, 1u));
    let best = max(m, tileMax);
    let correction = select(1.0, exp(m - best), m > NONE);
    var pSum = 0.0;
    var wMax = 0.0;
    for (var i = 0u; i < 32u * one; i++) {
      let p = select(0.0, exp(sc[i] - best), sc[i] > NONE);
      pSum += p;
      sc[i] = p * vscale[32u * half + i];
      wMax = max(wMax, sc[i]);
    }
    pSum += subgroupShuffleXor(pSum, 1u);
    wMax = max(wMax, subgroupShuffleXor(wMax, 1u));
    l = l * correction + pSum;
    m = best;
    let inverse = select(0.0, 127.0 / wMax, wMax > 1e-30);
    let wStep = wMax / 127.0;
    // The row's 64 weight codes, 4 keys a word: this half's 8 words and the pair's, keys 0..31 first.
    var cw = array<u32, 16>();
    for (var a = 0u; a < 8u * one; a++) {
      let own = pack4xI8(vec4<i32>(round(vec4<f32>(sc[4u * a], sc[4u * a + 1u], sc[4u * a + 2u], sc[4u * a + 3u]) * inverse)));
      let other = subgroupShuffleXor(own, 1u);
      cw[a] = select(own, other, half == 1u);
      cw[a + 8u] = select(other, own, half == 1u);
    }
    // Dims half·HD/2 + e of the row: 16 dot4I8Packed over the tile's 64 keys.
    for (var e = 0u; e < ${HALF}u * one; e++) {
      let at = (half * ${HALF}u + e) * BW;
      var sum = 0i;
      for (var w = 0u; w < 16u * one; w++) { sum += dot4I8Packed(cw[w], bitcast<u32>(vt[at + w])); }
      acc[e] = acc[e] * correction + wStep * f32(sum);
    }
  }

  if (rowT < step.tokens) {
    let head = kvh * group + (firstRow + r) % group;
    let dim0 = half * ${HALF}u;
    if (params.splits == 1u) {
      let o = (rowT * params.heads + head) * HD + dim0;
      for (var e = 0u; e < ${HALF}u; e++) { dst[o + e] = acc[e] / l; }
    } else {
      let rec = ((rowT * params.heads + head) * stepSplits + s) * (HD + 2u);
      if (half == 0u) {
        dst[rec] = m;
        dst[rec + 1u] = l;
      }
      for (var e = 0u; e < ${HALF}u; e++) { dst[rec + 2u + dim0 + e] = acc[e]; }
    }
  }
}
`;
}
