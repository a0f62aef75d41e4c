/**
 * WGSL `rmsScale(sum, lid, dim, eps)`: 1 / sqrt(mean of squares + eps) of a row of `dim` values whose squares the
 * `threads` invocations of a workgroup (a power of two) summed in parts, `sum` each, by a tree reduction in workgroup
 * memory. Call it from uniform control flow (it holds barriers). Shared by the RMSNorm kernel and Qwen3's per-head
 * norm in the RoPE dispatch (kernels/rope.wgsl.ts).
 */
export function rmsScaleWgsl(threads: number): string {
  return /* wgsl */ `
var<workgroup> rmsPartial: array<f32, ${threads}>;
fn rmsScale(sum: f32, lid: u32, dim: f32, eps: f32) -> f32 {
  rmsPartial[lid] = sum;
  workgroupBarrier();
  for (var stride = ${threads / 2}u; stride > 0u; stride /= 2u) {
    if (lid < stride) { rmsPartial[lid] += rmsPartial[lid + stride]; }
    workgroupBarrier();
  }
  return inverseSqrt(rmsPartial[0] / dim + eps);
}
`;
}

/** Values of its row an RMSNorm invocation loads at once and keeps for the scaling: rows up to 256 · 16 = 4096 wide. */
const HELD = 16;

/**
 * RMSNorm over rows: y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight. One workgroup per row. An invocation loads its
 * HELD values of the row (dims lid + 256·u) before it uses any and keeps them for the scaling, and loads their HELD
 * weights at once too. As loops (a Qwen3-4B norm is 2,560 wide: ten loads each) the norm took 0.48 ms off an H200
 * decode step of 36 layers; held, 0.40 (profile-decode --ablate). Wider rows take the rest in a loop.
 */
export const rmsnormWgsl = /* wgsl */ `
struct Params { rows: u32, dim: u32, eps: f32, _pad: u32 }

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> weight: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

const WG: u32 = 256u;
const HELD: u32 = ${HELD}u;
${rmsScaleWgsl(256)}
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let row = wg.x;
  if (row >= params.rows) { return; }
  let base = row * params.dim;
  var held: array<f32, HELD>;
  ${Array.from({ length: HELD }, (_, u) => `if (lid.x + ${u * 256}u < params.dim) { held[${u}] = x[base + lid.x + ${u * 256}u]; }`).join('\n  ')}
  var sum = ${Array.from({ length: HELD / 4 }, (_, g) => `(${[0, 1, 2, 3].map((k) => `held[${4 * g + k}] * held[${4 * g + k}]`).join(' + ')})`).join(' +\n    ')};
  for (var i = lid.x + WG * HELD; i < params.dim; i += WG) {
    let v = x[base + i];
    sum += v * v;
  }
  let scale = rmsScale(sum, lid.x, f32(params.dim), params.eps);
  ${Array.from({ length: HELD }, (_, u) => `if (lid.x + ${u * 256}u < params.dim) { y[base + lid.x + ${u * 256}u] = held[${u}] * scale * weight[lid.x + ${u * 256}u]; }`).join('\n  ')}
  for (var i = lid.x + WG * HELD; i < params.dim; i += WG) {
    y[base + i] = x[base + i] * scale * weight[i];
  }
}
`;
