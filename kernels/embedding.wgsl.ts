import type { GgmlType } from '../core/gguf-types.ts';
import { dequantWgsl } from './matmul.wgsl.ts';

/**
 * Embedding row lookup over one weight part: out[t, k] = W[tokenIds[t], k] for the tokens whose id falls in this
 * part's rows (other tokens are left to the part that holds them), times params.scale in the scaled build (Gemma's
 * sqrt(dim); the plain build's WGSL is what it was before the scale). A thread dequantizes 4 consecutive elements with
 * `dq4`, the weight type's dequantization (dequantWgsl), which is all that differs between types.
 */
const embeddingBodyWgsl = (scaled: boolean) => /* wgsl */ `
struct Params { K: u32, firstRow: u32, rowCount: u32, rowWords: u32, tokens: u32, ${scaled ? 'scale: f32' : '_a: u32'}, _b: u32, _c: u32 }
@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
  let t = wg.y;
  let k = (wg.x * 64u + li) * 4u;
  if (t >= params.tokens || k >= params.K) { return; }
  let id = ids[t];
  if (id < params.firstRow || id - params.firstRow >= params.rowCount) { return; }
  let v = dq4((id - params.firstRow) * params.rowWords, k)${scaled ? ' * params.scale' : ''};
  let o = t * params.K + k;
  out[o] = v.x;
  if (k + 1u < params.K) { out[o + 1u] = v.y; }
  if (k + 2u < params.K) { out[o + 2u] = v.z; }
  if (k + 3u < params.K) { out[o + 3u] = v.w; }
}
`;

export function embeddingWgsl(type: GgmlType, scaled = false): string {
  return dequantWgsl(type) + embeddingBodyWgsl(scaled);
}
