/**
 * The feed-forward's gated activation: 'swiglu' silu(gate)·up (llama, qwen), 'geglu' gelu(gate)·up with gelu's tanh
 * approximation (gemma: llama.cpp's ggml_geglu).
 */
export type GatedActivation = 'swiglu' | 'geglu';

/**
 * silu(g)·u, the SwiGLU feed-forward activation, for f32 or vecN<f32>: the one spelling every kernel that applies it
 * uses (the elementwise pass, the fused decode matvec, the int8 prefill's activation quantizer), so they agree.
 */
export function swigluExpression(g: string, u: string): string {
  return `(${g}) / (1.0 + exp(-(${g}))) * (${u})`;
}

/**
 * gelu(g)·u with gelu's tanh form, 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))), written as g·sigmoid(2·that), which
 * never divides infinities: exp overflows to +inf for large negative g (giving -0) and to 0 for large positive g.
 */
export function gegluExpression(g: string, u: string): string {
  return `(${g}) / (1.0 + exp(-1.5957691216057308 * ((${g}) + 0.044715 * (${g}) * (${g}) * (${g})))) * (${u})`;
}

/** The spelling of `activation` (swigluExpression or gegluExpression). */
export function gatedExpression(activation: GatedActivation, g: string, u: string): string {
  return activation === 'geglu' ? gegluExpression(g, u) : swigluExpression(g, u);
}

/** out[i] = act(gate[i]) * up[i] over `count` values, act silu (SwiGLU) or gelu (GeGLU). */
export function gatedWgsl(activation: GatedActivation): string {
  return /* wgsl */ `
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
  out[i] = ${gatedExpression(activation, 'g', 'up[i]')};
}
`;
}

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
