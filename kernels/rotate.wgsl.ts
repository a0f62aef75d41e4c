/**
 * Per-head rotation in place, of up to three tensors in one dispatch ("parts"): for every token t and head h of part
 * p, x_p[t,h,:] <- x_p[t,h,:] · R_p[h / headsPerMatrix_p] (R row-major [headDim, headDim], f32; with `transpose` the
 * product is with Rᵀ, which undoes an orthogonal R). The KV cache rotates q, k and v with it before quantization (one
 * dispatch for the three: each dependent dispatch costs a few µs on a GPU), and undoes the rotation on the attention
 * output of graphs without a merge pass (the merge pass does it otherwise: kernels/attention.wgsl.ts). One
 * workgroup per (token, head of any part): the row is staged in workgroup memory so the update can be in place.
 * Params.part[p] = (heads, headsPerMatrix, transpose, first matrix's word offset).
 */

/**
 * WGSL of out_j = Σ_i row[i] · matrix[at(j) + i · stride] for j < d, by a workgroup of WG invocations. Each output's
 * inner product is cut in QUARTERS over i, each quarter with eight partial sums, so many matrix loads are in flight
 * (one running sum per output made each load wait for the last: ~30 µs a layer on an H200); `store(j, piece, sum)`
 * writes quarter `piece`'s sum, which the caller adds up after a barrier. Needs `lid`, `d`, WG and QUARTERS in scope.
 * Shared by the rotation kernel and the attention merge pass's un-rotation.
 */
export function quarteredProductWgsl(o: {
  row: string;
  matrix: string;
  /** Index of output j's first element, an expression in `j`. */
  at: string;
  stride: string;
  store: (j: string, part: string, sum: string) => string;
}): string {
  return `let piece = lid % QUARTERS;
  let first = piece * (d / QUARTERS);
  let last = first + d / QUARTERS;
  for (var j = lid / QUARTERS; j < d; j += WG / QUARTERS) {
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    let at = ${o.at};
    for (var i = first; i < last; i += 8u) {
      for (var u = 0u; u < 8u; u++) {
        if (i + u < last) { acc[u] += ${o.row}[i + u] * ${o.matrix}[at + (i + u) * ${o.stride}]; }
      }
    }
    ${o.store('j', 'piece', '((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))')}
  }`;
}

/**
 * One head's row of part p, with its tensor and matrices bound directly: the dispatch picks the part once per
 * workgroup, not once per element of the inner products.
 */
function rowFunction(p: number): string {
  return `fn rotateRow${p}(part: vec4<u32>, head: u32, token: u32, lid: u32) {
  let d = params.headDim;
  let base = (token * part.x + head) * d;
  for (var i = lid; i < d; i += WG) { row[i] = x${p}[base + i]; }
  workgroupBarrier();
  let m = part.w + (head / part.y) * d * d;
  // Element (i, j) of the product's matrix: R[i][j], or R[j][i] with transpose.
  var stride = d;
  var step = 1u;
  if (part.z == 1u) { stride = 1u; step = d; }
  ${quarteredProductWgsl({
    row: 'row',
    matrix: `rotation${p}`,
    at: 'm + j * step',
    stride: 'stride',
    store: (j, q, sum) => `partial[${j} * QUARTERS + ${q}] = ${sum};`,
  })}
  workgroupBarrier();
  for (var j = lid; j < d; j += WG) {
    x${p}[base + j] = (partial[j * QUARTERS] + partial[j * QUARTERS + 1u]) + (partial[j * QUARTERS + 2u] + partial[j * QUARTERS + 3u]);
  }
}`;
}

export function rotateSource(parts: 1 | 2 | 3): string {
  const ids = [...Array(parts).keys()];
  const xs = ids.map((p) => `@group(0) @binding(${p}) var<storage, read_write> x${p}: array<f32>;`).join('\n');
  const rs = ids.map((p) => `@group(0) @binding(${parts + p}) var<storage, read> rotation${p}: array<f32>;`).join('\n');
  const cases = (body: (p: number) => string) =>
    ids.map((p) => `    ${p === parts - 1 ? 'default' : `case ${p}u`}: { ${body(p)} }`).join('\n');
  return /* wgsl */ `
struct Params { headDim: u32, _p0: u32, _p1: u32, _p2: u32, part: array<vec4<u32>, ${parts}> }
struct Step { position: u32, tokens: u32, _p0: u32, _p1: u32 }

${xs}
${rs}
@group(0) @binding(${2 * parts}) var<uniform> params: Params;
@group(0) @binding(${2 * parts + 1}) var<uniform> step: Step;

${ids.map((p) => rowFunction(p)).join('\n')}

const WG: u32 = 256u;
const QUARTERS: u32 = 4u;
var<workgroup> row: array<f32, 256>;
var<workgroup> partial: array<f32, ${4 * 256}>; // [output][quarter]

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let token = wg.y;
  if (token >= step.tokens) { return; }
  // The grid's x runs over the heads of part 0, then part 1, ...
  var head = wg.x;
  var p = 0u;
  loop {
    if (p + 1u >= ${parts}u || head < params.part[p].x) { break; }
    head -= params.part[p].x;
    p++;
  }
  let part = params.part[p];
  switch (p) {
${cases((p) => `rotateRow${p}(part, head, token, lid.x);`)}
  }
}
`;
}
