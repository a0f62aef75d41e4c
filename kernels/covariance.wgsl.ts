/**
 * Accumulates second moments for KV-cache calibration (OSCAR):
 *   cov[m][i][j] += Σ_t Σ_{h in group m} w[t][m] · x[t,h,i] · x[t,h,j]
 * x: f32 [tokens, heads, headDim]; group m = heads m·headsPerMatrix .. (m+1)·headsPerMatrix−1; w = 1 unless
 * `weighted` (then f32 [tokens, matrices]). One invocation per (i, j, m); the sum over tokens and heads is serial,
 * which is fine for a calibration pass of a few thousand tokens.
 */
export const covarianceWgsl = /* wgsl */ `
struct Params { heads: u32, headDim: u32, headsPerMatrix: u32, weighted: u32, matrices: u32, firstMatrix: u32, _p0: u32, _p1: u32 }
struct Step { position: u32, tokens: u32, _p0: u32, _p1: u32 }

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> weights: array<f32>;
@group(0) @binding(2) var<storage, read_write> cov: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;
@group(0) @binding(4) var<uniform> step: Step;

@compute @workgroup_size(8, 8)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let d = params.headDim;
  let i = gid.x;
  let j = gid.y;
  let m = gid.z;
  if (i >= d || j >= d || m >= params.matrices) { return; }
  var acc = 0.0;
  for (var t = 0u; t < step.tokens; t++) {
    var w = 1.0;
    if (params.weighted == 1u) { w = weights[t * params.matrices + m]; }
    var s = 0.0;
    for (var g = 0u; g < params.headsPerMatrix; g++) {
      let base = (t * params.heads + m * params.headsPerMatrix + g) * d;
      s += x[base + i] * x[base + j];
    }
    acc += w * s;
  }
  let o = ((params.firstMatrix + m) * d + i) * d + j;
  cov[o] = cov[o] + acc;
}
`;

/**
 * Score weights for the value covariance: w[t][m] = k[t,m,:] · S[m] · k[t,m,:]ᵀ with S the query second moment of
 * KV head m (the attention logit energy a key receives).
 */
export const keyEnergyWgsl = /* wgsl */ `
struct Params { kvHeads: u32, headDim: u32, firstMatrix: u32, _p0: u32 }
struct Step { position: u32, tokens: u32, _p0: u32, _p1: u32 }

@group(0) @binding(0) var<storage, read> k: array<f32>;
@group(0) @binding(1) var<storage, read> queryMoment: array<f32>;
@group(0) @binding(2) var<storage, read_write> energy: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;
@group(0) @binding(4) var<uniform> step: Step;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let index = gid.x;
  if (index >= step.tokens * params.kvHeads) { return; }
  let t = index / params.kvHeads;
  let m = index % params.kvHeads;
  let d = params.headDim;
  let base = (t * params.kvHeads + m) * d;
  let s = (params.firstMatrix + m) * d * d;
  var total = 0.0;
  for (var i = 0u; i < d; i++) {
    var row = 0.0;
    for (var j = 0u; j < d; j++) { row += queryMoment[s + i * d + j] * k[base + j]; }
    total += k[base + i] * row;
  }
  energy[index] = total;
}
`;
