/**
 * silu(g)·u, the SwiGLU feed-forward activation, for f32 or vecN<f32>: the one spelling every kernel that applies it
 * uses (the elementwise pass, the fused decode matvec, the int8 prefill's activation quantizer), so they agree.
 */
export function swigluExpression(g: string, u: string): string {
  return `(${g}) / (1.0 + exp(-(${g}))) * (${u})`;
}

/** out[i] = silu(gate[i]) * up[i] over `count` values. */
export const swigluWgsl = /* wgsl */ `
struct Params { count: u32, _p0: u32, _p1: u32, _p2: u32 }
@group(0) @binding(0) var<storage, read> gate: array<f32>;
@group(0) @binding(1) var<storage, read> up: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x + gid.y * 65535u * 64u;
  if (i >= params.count) { return; }
  let g = gate[i];
  out[i] = ${swigluExpression('g', 'up[i]')};
}
`;

/** x[i] += y[i] over `count` values: the residual connection. */
export const addInPlaceWgsl = /* wgsl */ `
struct Params { count: u32, _p0: u32, _p1: u32, _p2: u32 }
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<uniform> params: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x + gid.y * 65535u * 64u;
  if (i >= params.count) { return; }
  x[i] = x[i] + y[i];
}
`;
