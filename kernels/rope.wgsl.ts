import { rmsScaleWgsl } from './rmsnorm.wgsl.ts';
import { wgslConstants } from './wgsl-constants.ts';

/**
 * `ropePair(i, t)`: pair i of a head, its two dims within the head and the cos and sin of its angle at token t of the
 * step. Needs `params` with ropeDim, neox, base and magnitude, `step.position` and `freqFactors` in scope (the RoPE
 * kernels here and the fused decode store, kernels/rope-append.wgsl.ts).
 */
export const ropePairWgsl = /* wgsl */ `
struct RopePair { a: u32, b: u32, c: f32, s: f32 }
fn ropePair(i: u32, t: u32) -> RopePair {
  let half = params.ropeDim / 2u;
  let pos = f32(step.position + t);
  let invFreq = pow(params.base, -2.0 * f32(i) / f32(params.ropeDim)) / freqFactors[i];
  let theta = pos * invFreq;
  var a = 2u * i;
  var b = a + 1u;
  if (params.neox == 1u) { a = i; b = i + half; }
  return RopePair(a, b, cos(theta) * params.magnitude, sin(theta) * params.magnitude);
}
`;

/**
 * Rotary position embedding, in place, on a step's q and k in one dispatch: rows of `heads * headDim` f32 values
 * in q and of `kvHeads * headDim` in k. Row t has position `step.position + t`. Only the first `ropeDim` dims of each
 * head rotate. Layout NORMAL (llama): pairs (2i, 2i+1). Layout NEOX (qwen2/qwen3): pairs (i, i + ropeDim/2).
 * theta_i = pos * base^(-2i/ropeDim) / freqFactor[i] (freqFactor: the per-pair divisors of Llama 3's rope_freqs and
 * linear or YaRN scaling, kernels/rope.ts ropeFrequencyDivisors; or ones); cos and sin are scaled by `magnitude`.
 */
const ropeCommonWgsl =
  /* wgsl */ `
struct Params {
  tokens: u32, heads: u32, kvHeads: u32, headDim: u32, ropeDim: u32, neox: u32, base: f32, eps: f32, magnitude: f32,
}
struct Step { position: u32, tokens: u32, _p0: u32, _p1: u32 }

@group(0) @binding(0) var<storage, read_write> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> k: array<f32>;
@group(0) @binding(2) var<storage, read> freqFactors: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;
@group(0) @binding(4) var<uniform> step: Step;
` + ropePairWgsl;

/** One invocation per rotated pair of q or k. */
export const ropeWgsl =
  ropeCommonWgsl +
  /* wgsl */ `
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let half = params.ropeDim / 2u;
  let tokens = min(params.tokens, step.tokens);
  let qPairs = tokens * params.heads * half;
  var index = gid.x + gid.y * 65535u * 64u;
  let inQ = index < qPairs;
  let heads = select(params.kvHeads, params.heads, inQ);
  if (!inQ) { index -= qPairs; }
  let pairsPerRow = heads * half;
  if (index >= tokens * pairsPerRow) { return; }
  let t = index / pairsPerRow;
  let rem = index % pairsPerRow;
  let head = rem / half;
  let pair = ropePair(rem % half, t);
  let rowBase = t * heads * params.headDim + head * params.headDim;
  let a = rowBase + pair.a;
  let b = rowBase + pair.b;
  let c = pair.c;
  let s = pair.s;
  if (inQ) {
    let x0 = q[a];
    let x1 = q[b];
    q[a] = x0 * c - x1 * s;
    q[b] = x0 * s + x1 * c;
  } else {
    let x0 = k[a];
    let x1 = k[b];
    k[a] = x0 * c - x1 * s;
    k[b] = x0 * s + x1 * c;
  }
}
`;

/** Most dims of a head the head-norm build holds in workgroup memory. */
export const ROPE_HEAD_NORM_MAX_DIM = 256;

/**
 * Qwen3's per-head RMSNorm of q and k (weights qNorm, kNorm over headDim), then RoPE, in one dispatch: one workgroup
 * per (token, head of q or k) normalizes the head into workgroup memory, then rotates its pairs from there, so the
 * update is in place. A decode step is bound by dispatch gaps: this replaces three dispatches (q_norm, k_norm, rope).
 */
export const ropeHeadNormWgsl =
  wgslConstants({ MAX_HEAD_DIM: ROPE_HEAD_NORM_MAX_DIM }) +
  ropeCommonWgsl +
  rmsScaleWgsl +
  /* wgsl */ `
@group(0) @binding(5) var<storage, read> qNorm: array<f32>;
@group(0) @binding(6) var<storage, read> kNorm: array<f32>;

const WG: u32 = 64u;
var<workgroup> row: array<f32, MAX_HEAD_DIM>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let index = wg.x + wg.y * nwg.x;
  let rowsPerToken = params.heads + params.kvHeads;
  if (index >= min(params.tokens, step.tokens) * rowsPerToken) { return; }
  let t = index / rowsPerToken;
  let inQ = index % rowsPerToken < params.heads;
  let d = params.headDim;
  var base: u32;
  if (inQ) { base = (t * params.heads + index % rowsPerToken) * d; }
  else { base = (t * params.kvHeads + index % rowsPerToken - params.heads) * d; }
  var sum = 0.0;
  for (var i = lid; i < d; i += WG) {
    var v: f32;
    if (inQ) { v = q[base + i]; } else { v = k[base + i]; }
    row[i] = v;
    sum += v * v;
  }
  let scale = rmsScale(sum, lid, f32(d), params.eps);
  for (var i = lid; i < d; i += WG) {
    var w: f32;
    if (inQ) { w = qNorm[i]; } else { w = kNorm[i]; }
    row[i] = row[i] * scale * w;
  }
  workgroupBarrier();
  // Rotated pairs, then the dims past ropeDim as normalized.
  for (var i = lid; i < params.ropeDim / 2u; i += WG) {
    let pair = ropePair(i, t);
    let a = pair.a;
    let b = pair.b;
    let x0 = row[a];
    let x1 = row[b];
    let y0 = x0 * pair.c - x1 * pair.s;
    let y1 = x0 * pair.s + x1 * pair.c;
    if (inQ) { q[base + a] = y0; q[base + b] = y1; } else { k[base + a] = y0; k[base + b] = y1; }
  }
  for (var i = params.ropeDim + lid; i < d; i += WG) {
    if (inQ) { q[base + i] = row[i]; } else { k[base + i] = row[i]; }
  }
}
`;
