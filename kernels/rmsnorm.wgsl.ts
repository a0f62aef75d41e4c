/** RMSNorm over rows: y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight. One workgroup per row. */
export const rmsnormWgsl = /* wgsl */ `
struct Params { rows: u32, dim: u32, eps: f32, _pad: u32 }

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> weight: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

const WG: u32 = 256u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let row = wg.x;
  if (row >= params.rows) { return; }
  let base = row * params.dim;
  var sum = 0.0;
  for (var i = lid.x; i < params.dim; i += WG) {
    let v = x[base + i];
    sum += v * v;
  }
  partial[lid.x] = sum;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
    if (lid.x < stride) { partial[lid.x] += partial[lid.x + stride]; }
    workgroupBarrier();
  }
  let scale = inverseSqrt(partial[0] / f32(params.dim) + params.eps);
  for (var i = lid.x; i < params.dim; i += WG) {
    y[base + i] = x[base + i] * scale * weight[i];
  }
}
`;
