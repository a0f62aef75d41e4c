/**
 * Per-head rotation in place: for every token t and head h, x[t,h,:] <- x[t,h,:] · R[h / headsPerMatrix]
 * (R row-major [headDim, headDim], f32; with `transpose` the product is with Rᵀ, which undoes an orthogonal R).
 * The KV cache rotates q, k and v with it before quantization, and undoes the rotation on the attention output.
 * One workgroup per (token, head): the row is staged in workgroup memory so the update can be in place.
 */
export const rotateWgsl = /* wgsl */ `
struct Params { heads: u32, headDim: u32, headsPerMatrix: u32, transpose: u32, matrixOffset: u32, _p0: u32, _p1: u32, _p2: u32 }
struct Step { position: u32, tokens: u32, _p0: u32, _p1: u32 }

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> rotation: array<f32>;
@group(0) @binding(2) var<uniform> params: Params;
@group(0) @binding(3) var<uniform> step: Step;

const WG: u32 = 64u;
var<workgroup> row: array<f32, 256>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let head = wg.x;
  let token = wg.y;
  if (token >= step.tokens) { return; }
  let d = params.headDim;
  let base = (token * params.heads + head) * d;
  for (var i = lid.x; i < d; i += WG) { row[i] = x[base + i]; }
  workgroupBarrier();
  let m = params.matrixOffset + (head / params.headsPerMatrix) * d * d;
  for (var j = lid.x; j < d; j += WG) {
    var acc = 0.0;
    if (params.transpose == 1u) {
      for (var i = 0u; i < d; i++) { acc += row[i] * rotation[m + j * d + i]; }
    } else {
      for (var i = 0u; i < d; i++) { acc += row[i] * rotation[m + i * d + j]; }
    }
    x[base + j] = acc;
  }
}
`;
