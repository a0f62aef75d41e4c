/**
 * WGSL `rmsScale(sum, lid, dim, eps)`: 1 / sqrt(mean of squares + eps) of a row of `dim` values whose squares the `WG`
 * invocations of a workgroup (the including kernel's `const WG`, a power of two) summed in parts, `sum` each, by a
 * tree reduction in workgroup memory. Call it from uniform control flow (it holds barriers). Shared by the RMSNorm
 * kernel and Qwen3's per-head norm in the RoPE dispatch (kernels/rope.wgsl.ts).
 */
export const rmsScaleWgsl = /* wgsl */ `
var<workgroup> rmsPartial: array<f32, WG>;
fn rmsScale(sum: f32, lid: u32, dim: f32, eps: f32) -> f32 {
  rmsPartial[lid] = sum;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
    if (lid < stride) { rmsPartial[lid] += rmsPartial[lid + stride]; }
    workgroupBarrier();
  }
  return inverseSqrt(rmsPartial[0] / dim + eps);
}
`;

/**
 * RMSNorm over rows: y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight. One workgroup per row. An invocation loads its
 * HELD values of the row (dims lid + 256·u) before it uses any and keeps them for the scaling, and loads their HELD
 * weights at once too: rows up to 256 · 16 = 4096 wide, the loads and stores written out. Held, the norm measured
 * faster than as loops (a Qwen3-4B norm is 2,560 wide: ten loads each; profile-decode --ablate,
 * bench/results/2026-12-01-nvidia-h200-session13-profile-qwen3-q4_k_m-32k-int2-{before,after}.txt). Wider rows take the
 * rest in a loop.
 */
export const rmsnormWgsl =
  rmsScaleWgsl +
  /* wgsl */ `
struct Params { rows: u32, dim: u32, eps: f32, _pad: u32 }

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> weight: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

const WG: u32 = 256u;
const HELD: u32 = 16u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let row = wg.x;
  if (row >= params.rows) { return; }
  let base = row * params.dim;
  var held: array<f32, HELD>;
  if (lid.x + 0u < params.dim) { held[0] = x[base + lid.x + 0u]; }
  if (lid.x + 256u < params.dim) { held[1] = x[base + lid.x + 256u]; }
  if (lid.x + 512u < params.dim) { held[2] = x[base + lid.x + 512u]; }
  if (lid.x + 768u < params.dim) { held[3] = x[base + lid.x + 768u]; }
  if (lid.x + 1024u < params.dim) { held[4] = x[base + lid.x + 1024u]; }
  if (lid.x + 1280u < params.dim) { held[5] = x[base + lid.x + 1280u]; }
  if (lid.x + 1536u < params.dim) { held[6] = x[base + lid.x + 1536u]; }
  if (lid.x + 1792u < params.dim) { held[7] = x[base + lid.x + 1792u]; }
  if (lid.x + 2048u < params.dim) { held[8] = x[base + lid.x + 2048u]; }
  if (lid.x + 2304u < params.dim) { held[9] = x[base + lid.x + 2304u]; }
  if (lid.x + 2560u < params.dim) { held[10] = x[base + lid.x + 2560u]; }
  if (lid.x + 2816u < params.dim) { held[11] = x[base + lid.x + 2816u]; }
  if (lid.x + 3072u < params.dim) { held[12] = x[base + lid.x + 3072u]; }
  if (lid.x + 3328u < params.dim) { held[13] = x[base + lid.x + 3328u]; }
  if (lid.x + 3584u < params.dim) { held[14] = x[base + lid.x + 3584u]; }
  if (lid.x + 3840u < params.dim) { held[15] = x[base + lid.x + 3840u]; }
  var sum = (held[0] * held[0] + held[1] * held[1] + held[2] * held[2] + held[3] * held[3]) +
    (held[4] * held[4] + held[5] * held[5] + held[6] * held[6] + held[7] * held[7]) +
    (held[8] * held[8] + held[9] * held[9] + held[10] * held[10] + held[11] * held[11]) +
    (held[12] * held[12] + held[13] * held[13] + held[14] * held[14] + held[15] * held[15]);
  for (var i = lid.x + WG * HELD; i < params.dim; i += WG) {
    let v = x[base + i];
    sum += v * v;
  }
  let scale = rmsScale(sum, lid.x, f32(params.dim), params.eps);
  if (lid.x + 0u < params.dim) { y[base + lid.x + 0u] = held[0] * scale * weight[lid.x + 0u]; }
  if (lid.x + 256u < params.dim) { y[base + lid.x + 256u] = held[1] * scale * weight[lid.x + 256u]; }
  if (lid.x + 512u < params.dim) { y[base + lid.x + 512u] = held[2] * scale * weight[lid.x + 512u]; }
  if (lid.x + 768u < params.dim) { y[base + lid.x + 768u] = held[3] * scale * weight[lid.x + 768u]; }
  if (lid.x + 1024u < params.dim) { y[base + lid.x + 1024u] = held[4] * scale * weight[lid.x + 1024u]; }
  if (lid.x + 1280u < params.dim) { y[base + lid.x + 1280u] = held[5] * scale * weight[lid.x + 1280u]; }
  if (lid.x + 1536u < params.dim) { y[base + lid.x + 1536u] = held[6] * scale * weight[lid.x + 1536u]; }
  if (lid.x + 1792u < params.dim) { y[base + lid.x + 1792u] = held[7] * scale * weight[lid.x + 1792u]; }
  if (lid.x + 2048u < params.dim) { y[base + lid.x + 2048u] = held[8] * scale * weight[lid.x + 2048u]; }
  if (lid.x + 2304u < params.dim) { y[base + lid.x + 2304u] = held[9] * scale * weight[lid.x + 2304u]; }
  if (lid.x + 2560u < params.dim) { y[base + lid.x + 2560u] = held[10] * scale * weight[lid.x + 2560u]; }
  if (lid.x + 2816u < params.dim) { y[base + lid.x + 2816u] = held[11] * scale * weight[lid.x + 2816u]; }
  if (lid.x + 3072u < params.dim) { y[base + lid.x + 3072u] = held[12] * scale * weight[lid.x + 3072u]; }
  if (lid.x + 3328u < params.dim) { y[base + lid.x + 3328u] = held[13] * scale * weight[lid.x + 3328u]; }
  if (lid.x + 3584u < params.dim) { y[base + lid.x + 3584u] = held[14] * scale * weight[lid.x + 3584u]; }
  if (lid.x + 3840u < params.dim) { y[base + lid.x + 3840u] = held[15] * scale * weight[lid.x + 3840u]; }
  for (var i = lid.x + WG * HELD; i < params.dim; i += WG) {
    y[base + i] = x[base + i] * scale * weight[i];
  }
}
`;
