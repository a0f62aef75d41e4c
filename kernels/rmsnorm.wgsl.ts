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
 * RMSNorm over rows: y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, or with `add` y[r] += that (Gemma's post-norms,
 * whose output joins the residual stream). One workgroup per row. An invocation loads its
 * HELD values of the row (dims lid + 256·u) before it uses any and keeps them for the scaling, and loads their HELD
 * weights at once too: rows up to 256 · 16 = 4096 wide, the loads and stores written out. Held, the norm measured
 * faster than as loops (a Qwen3-4B norm is 2,560 wide: ten loads each; profile-decode --ablate,
 * bench/results/2026-12-01-nvidia-h200-session13-profile-qwen3-q4_k_m-32k-int2-{before,after}.txt). Wider rows take the
 * rest in a loop.
 */
export function rmsnormSource(add: boolean): string {
  const HELD = 16;
  const each = (line: (u: number, at: string) => string) =>
    Array.from({ length: HELD }, (_, u) => line(u, `lid.x + ${256 * u}u`)).join('\n');
  const store = (at: string, value: string) => `y[${at}] = ${add ? `y[${at}] + ` : ''}${value};`;
  return (
    rmsScaleWgsl +
    /* wgsl */ `
struct Params { rows: u32, dim: u32, eps: f32, _pad: u32 }

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> weight: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

const WG: u32 = 256u;
const HELD: u32 = ${HELD}u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let row = wg.x;
  if (row >= params.rows) { return; }
  let base = row * params.dim;
  var held: array<f32, HELD>;
${each((u, at) => `  if (${at} < params.dim) { held[${u}] = x[base + ${at}]; }`)}
  var sum = (held[0] * held[0] + held[1] * held[1] + held[2] * held[2] + held[3] * held[3]) +
    (held[4] * held[4] + held[5] * held[5] + held[6] * held[6] + held[7] * held[7]) +
    (held[8] * held[8] + held[9] * held[9] + held[10] * held[10] + held[11] * held[11]) +
    (held[12] * held[12] + held[13] * held[13] + held[14] * held[14] + held[15] * held[15]);
  for (var i = lid.x + WG * HELD; i < params.dim; i += WG) {
    let v = x[base + i];
    sum += v * v;
  }
  let scale = rmsScale(sum, lid.x, f32(params.dim), params.eps);
${each((u, at) => `  if (${at} < params.dim) { ${store(`base + ${at}`, `held[${u}] * scale * weight[${at}]`)} }`)}
  for (var i = lid.x + WG * HELD; i < params.dim; i += WG) {
    ${store('base + i', 'x[base + i] * scale * weight[i]')}
  }
}
`
  );
}

export const rmsnormWgsl = rmsnormSource(false);
