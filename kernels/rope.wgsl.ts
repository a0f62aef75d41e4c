/**
 * Rotary position embedding, in place, on a step's q and k in one dispatch: rows of `heads * headDim` f32 values
 * in q and of `kvHeads * headDim` in k. Row t has position `step.position + t`. Only the first `ropeDim` dims of each
 * head rotate. Layout NORMAL (llama): pairs (2i, 2i+1). Layout NEOX (qwen2/qwen3): pairs (i, i + ropeDim/2).
 * theta_i = pos * base^(-2i/ropeDim) / freqFactor[i] (freqFactor is Llama 3's rope_freqs, or ones).
 */
export const ropeWgsl = /* wgsl */ `
struct Params { tokens: u32, heads: u32, kvHeads: u32, headDim: u32, ropeDim: u32, neox: u32, base: f32, _p0: u32 }
struct Step { position: u32, tokens: u32, _p0: u32, _p1: u32 }

@group(0) @binding(0) var<storage, read_write> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> k: array<f32>;
@group(0) @binding(2) var<storage, read> freqFactors: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;
@group(0) @binding(4) var<uniform> step: Step;

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
  let i = rem % half;
  let pos = f32(step.position + t);
  let invFreq = pow(params.base, -2.0 * f32(i) / f32(params.ropeDim)) / freqFactors[i];
  let theta = pos * invFreq;
  let c = cos(theta);
  let s = sin(theta);
  let rowBase = t * heads * params.headDim + head * params.headDim;
  var a: u32;
  var b: u32;
  if (params.neox == 1u) { a = rowBase + i; b = rowBase + i + half; } else { a = rowBase + 2u * i; b = a + 1u; }
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
