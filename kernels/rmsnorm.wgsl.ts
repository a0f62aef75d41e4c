/**
 * RMSNorm over rows: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight. One workgroup per row.
 * The in-place variant (Qwen3's per-head q/k norm) binds x once, read-write: each invocation rewrites only the
 * elements it read itself after the reduction, so no other invocation's input is overwritten early.
 */
function rmsnormSource(inPlace: boolean): string {
  const io = inPlace
    ? '@group(0) @binding(0) var<storage, read_write> x: array<f32>;'
    : '@group(0) @binding(0) var<storage, read> x: array<f32>;\n@group(0) @binding(2) var<storage, read_write> y: array<f32>;';
  const out = inPlace ? 'x' : 'y';
  return /* wgsl */ `
struct Params { rows: u32, dim: u32, eps: f32, _pad: u32 }

${io}
@group(0) @binding(1) var<storage, read> weight: array<f32>;
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
    ${out}[base + i] = x[base + i] * scale * weight[i];
  }
}
`;
}

export const rmsnormWgsl = rmsnormSource(false);
export const rmsnormInPlaceWgsl = rmsnormSource(true);
