/**
 * Per-head rotation in place, of up to three tensors in one dispatch ("parts"): for every token t and head h of part
 * p, x_p[t,h,:] <- x_p[t,h,:] · R_p[h / headsPerMatrix_p] (R row-major [headDim, headDim], f32; with `transpose` the
 * product is with Rᵀ, which undoes an orthogonal R). The KV cache rotates q, k and v with it before quantization (one
 * dispatch for the three: each dependent dispatch costs a few µs on a GPU), and undoes the rotation on the attention
 * output of prefill graphs and of graphs without a merge pass (decode graphs' merge pass does it otherwise:
 * kernels/attention.wgsl.ts). Decode builds take one workgroup per (token, head of any part), prefill builds one per
 * block of tokens of a head; the rows are staged in workgroup memory so the update can be in place.
 * Params.part[p] = (heads, headsPerMatrix, transpose, first matrix's word offset).
 */

/** Workgroup floats of `partial` that rowProductWgsl needs, for any headDim <= 256. */
export const ROW_PRODUCT_PARTIALS = 1024;

/** Matrix loads an invocation of rowProductWgsl issues before it uses any (in flight together). */
const LOADS = 16;

/**
 * WGSL of out_j = Σ_i row[i] · M[i][j] (M[j][i] where the WGSL condition `transpose` holds) for j < d, by a workgroup
 * of WG = 256 invocations; M is row-major d×d from vec4 `base4` of `matrix` (array<vec4<f32>>). Each invocation
 * loads whole vec4s of M, LOADS of them before it uses one, so a head's matrix is read in one or two round trips to
 * memory: with scalar loads, eight in flight, the rotation of Qwen3-4B's q, k and v waited on ~8 of them (~19 µs a
 * layer of an H200 decode step; ~11 µs with these loads). Invocations:
 *   - M[i][j]: (piece, quad), quad = lid % (d/4): outputs 4·quad..+3 over the piece's rows of M (a warp reads whole
 *     rows of M);
 *   - M[j][i]: (j, half), half = lid % 2: every other vec4 of row j of M.
 * Their sums meet in `partial` (ROW_PRODUCT_PARTIALS f32 of workgroup memory); after a barrier `store(j, value)`
 * writes output j. Needs `lid` and `d` (a multiple of 8, <= 256) in scope, and the row as d workgroup f32; the
 * barriers need `transpose` uniform. Shared by the decode builds of the rotation kernel and of the attention merge
 * pass's un-rotation (the rotation kernel's prefill build takes blockOutputsWgsl instead).
 */
export function rowProductWgsl(o: {
  row: string;
  matrix: string;
  base4: string;
  transpose: string;
  store: (j: string, value: string) => string;
}): string {
  const loads = (load: (u: number) => string) => Array.from({ length: LOADS }, (_, u) => `      ${load(u)}`).join('\n');
  const rowQuad = (c: string) =>
    `vec4<f32>(${o.row}[4u * ${c}], ${o.row}[4u * ${c} + 1u], ${o.row}[4u * ${c} + 2u], ${o.row}[4u * ${c} + 3u])`;
  return `{
  let quads = d / 4u;
  if (${o.transpose}) {
    let half = lid % 2u;
    for (var j = lid / 2u; j < d; j += 128u) {
      let at = ${o.base4} + j * quads;
      var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
      for (var c0 = half; c0 < quads; c0 += ${2 * LOADS}u) {
${loads((u) => `if (c0 + ${2 * u}u < quads) { a${u % 4} += ${rowQuad(`(c0 + ${2 * u}u)`)} * ${o.matrix}[at + c0 + ${2 * u}u]; }`)}
      }
      let a = (a0 + a1) + (a2 + a3);
      partial[2u * j + half] = (a.x + a.y) + (a.z + a.w);
    }
    workgroupBarrier();
    for (var j = lid; j < d; j += 256u) { ${o.store('j', 'partial[2u * j] + partial[2u * j + 1u]')} }
  } else {
    let pieces = 256u / quads;
    let rows = (d + pieces - 1u) / pieces;
    let quad = lid % quads;
    let piece = lid / quads;
    if (piece < pieces) {
      let first = min(piece * rows, d);
      let last = min(first + rows, d);
      var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
      for (var i = first; i < last; i += ${LOADS}u) {
${loads((u) => `if (i + ${u}u < last) { a${u % 4} += ${o.row}[i + ${u}u] * ${o.matrix}[${o.base4} + (i + ${u}u) * quads + quad]; }`)}
      }
      let a = (a0 + a1) + (a2 + a3);
      let at = piece * d + 4u * quad;
      partial[at] = a.x;
      partial[at + 1u] = a.y;
      partial[at + 2u] = a.z;
      partial[at + 3u] = a.w;
    }
    workgroupBarrier();
    let used = (d + rows - 1u) / rows;
    for (var j = lid; j < d; j += 256u) {
      var sum = 0.0;
      for (var p = 0u; p < used; p++) { sum += partial[p * d + j]; }
      ${o.store('j', 'sum')}
    }
  }
}`;
}

/**
 * Tokens a workgroup of the prefill build takes for one head: its rows share the head's matrix, which the workgroup
 * then reads once for all of them. The build before it took one row a workgroup, each invocation one output: on an
 * H200, Qwen3-4B's 512-token chunk at 16K keys spent 6.1 ms rotating q, k and v over its 36 layers; 5.1 ms with
 * blocks of 16 (Llama-3.2-1B: 0.82 and 0.85 ms).
 */
export const ROTATE_BLOCK_TOKENS = 16;

/**
 * WGSL of a block's row products for one output column: for r < ROTATE_BLOCK_TOKENS, `store(r, value)` gets
 * Σ_i block_r,i · M[i][j] (M[j][i] where the WGSL condition `transpose` holds), M row-major d×d from vec4 `base4` of
 * `matrix`, the block's rows in the workgroup array `block` of vec4s (row r at r · quads). Needs `d` and `quads` =
 * d / 4 in scope. The row values are the same for every invocation (broadcast reads); each invocation reads one column
 * of M (or, with `transpose`, one row as vec4s).
 */
function blockOutputsWgsl(o: {
  block: string;
  matrix: string;
  base4: string;
  j: string;
  transpose: string;
  store: (r: string, value: string) => string;
}): string {
  const rows = Array.from({ length: ROTATE_BLOCK_TOKENS }, (_, r) => r);
  const accumulate = (quad: string, m: string) =>
    rows.map((r) => `acc[${r}] += dot(${o.block}[${r}u * quads + ${quad}], ${m});`).join('\n        ');
  const column = (at: string) => `${o.matrix}[${at}][${o.j} % 4u]`;
  return `{
    // Initialized explicitly: in a loop over columns, a declaration without one was not zeroed again (lavapipe).
    var acc = array<f32, ${ROTATE_BLOCK_TOKENS}>();
    if (${o.transpose}) {
      for (var c = 0u; c < quads; c++) {
        let m = ${o.matrix}[${o.base4} + ${o.j} * quads + c];
        ${accumulate('c', 'm')}
      }
    } else {
      for (var c = 0u; c < quads; c++) {
        let at = ${o.base4} + 4u * c * quads + ${o.j} / 4u;
        let m = vec4<f32>(${column('at')}, ${column('at + quads')}, ${column('at + 2u * quads')}, ${column('at + 3u * quads')});
        ${accumulate('c', 'm')}
      }
    }
    ${rows.map((r) => o.store(`${r}u`, `acc[${r}]`)).join('\n    ')}
  }`;
}

/**
 * One head's row of part p, with its tensor and matrices bound directly: the dispatch picks the part once per
 * workgroup, not once per element of the inner products. The decode build: 256 invocations whose partial sums meet
 * in workgroup memory (rowProductWgsl).
 */
function rowFunction(p: number): string {
  return `fn rotateRow${p}(part: vec4<u32>, head: u32, token: u32, lid: u32) {
  let d = params.headDim;
  let base = (token * part.x + head) * d;
  for (var i = lid; i < d; i += WG) { row[i] = x${p}[base + i]; }
  workgroupBarrier();
  let matrix4 = (part.w + (head / part.y) * d * d) / 4u;
  ${rowProductWgsl({
    row: 'row',
    matrix: `rotation${p}`,
    base4: 'matrix4',
    transpose: 'part.z == 1u',
    store: (j, value) => `x${p}[base + ${j}] = ${value};`,
  })}
}`;
}

/**
 * The prefill build's rows of part p: ROTATE_BLOCK_TOKENS tokens from `token0` of one head, staged in workgroup
 * memory (the update is in place), then invocation j's outputs j, j + WG, ... of every row (blockOutputsWgsl).
 */
function blockFunction(p: number): string {
  return `fn rotateBlock${p}(part: vec4<u32>, head: u32, token0: u32, lid: u32) {
  let d = params.headDim;
  let quads = d / 4u;
  let tokens = min(step.tokens - token0, ${ROTATE_BLOCK_TOKENS}u);
  // Rows past the step's tokens are not read (nor their outputs stored).
  for (var at = lid; at < tokens * d; at += WG) {
    let r = at / d;
    block[r * quads + (at % d) / 4u][at % 4u] = x${p}[((token0 + r) * part.x + head) * d + at % d];
  }
  workgroupBarrier();
  let matrix4 = (part.w + (head / part.y) * d * d) / 4u;
  for (var j = lid; j < d; j += WG) ${blockOutputsWgsl({
    block: 'block',
    matrix: `rotation${p}`,
    base4: 'matrix4',
    j: 'j',
    transpose: 'part.z == 1u',
    store: (r, value) => `if (${r} < tokens) { x${p}[((token0 + ${r}) * part.x + head) * d + j] = ${value}; }`,
  })}
}`;
}

/**
 * The rotate kernel for `parts` tensors. `blocks` builds it for prefill graphs: a workgroup of 64 takes
 * ROTATE_BLOCK_TOKENS tokens of a head (grid y: token blocks), each invocation storing whole outputs, instead of 256
 * invocations a row whose partial sums meet in workgroup memory (rowProductWgsl, built for the one row of a decode
 * step; grid y: tokens). Same bindings and params.
 */
export function rotateSource(parts: 1 | 2 | 3, blocks = false): string {
  const ids = [...Array(parts).keys()];
  const xs = ids.map((p) => `@group(0) @binding(${p}) var<storage, read_write> x${p}: array<f32>;`).join('\n');
  const rs = ids
    .map((p) => `@group(0) @binding(${parts + p}) var<storage, read> rotation${p}: array<vec4<f32>>;`)
    .join('\n');
  const cases = (body: (p: number) => string) =>
    ids.map((p) => `    ${p === parts - 1 ? 'default' : `case ${p}u`}: { ${body(p)} }`).join('\n');
  return /* wgsl */ `
struct Params { headDim: u32, _p0: u32, _p1: u32, _p2: u32, part: array<vec4<u32>, ${parts}> }
struct Step { position: u32, tokens: u32, _p0: u32, _p1: u32 }

${xs}
${rs}
@group(0) @binding(${2 * parts}) var<uniform> params: Params;
@group(0) @binding(${2 * parts + 1}) var<uniform> step: Step;

${ids.map((p) => (blocks ? blockFunction(p) : rowFunction(p))).join('\n')}

const WG: u32 = ${blocks ? 64 : 256}u;
${
  blocks
    ? `var<workgroup> block: array<vec4<f32>, ${(ROTATE_BLOCK_TOKENS * 256) / 4}>; // [token][headDim / 4], headDim <= 256`
    : `var<workgroup> row: array<f32, 256>;
var<workgroup> partial: array<f32, ${ROW_PRODUCT_PARTIALS}>;`
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let token = wg.y${blocks ? ` * ${ROTATE_BLOCK_TOKENS}u` : ''};
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
${cases((p) => `${blocks ? 'rotateBlock' : 'rotateRow'}${p}(part, head, token, lid.x);`)}
  }
}
`;
}
