/**
 * Per-head rotation in place, of up to three tensors in one dispatch ("parts"): for every token t and head h of part p,
 * x_p[t,h,:] <- x_p[t,h,:] · R_p[h / headsPerMatrix_p] (R row-major [headDim, headDim], f32; with `transpose` the
 * product is with Rᵀ, which undoes an orthogonal R). The KV cache rotates q, k and v with it before quantization (one
 * dispatch for the three: each dependent dispatch costs a launch gap the GPU idles through), and undoes the rotation on
 * the attention output of prefill graphs and of graphs without a merge pass (decode graphs' merge pass does it
 * otherwise: kernels/attention.wgsl.ts). Decode builds take one workgroup per (token, head of any part), prefill builds
 * one per block of tokens of a head; either way a workgroup reads its rows whole (into workgroup memory, or before a
 * barrier) before it stores any output, so the update can be in place.
 * Params.part[p] = (heads, headsPerMatrix, transpose, first matrix's word offset).
 */

/** Workgroup floats of `partial` that rowProductWgsl needs, for any headDim <= 256. */
export const ROW_PRODUCT_PARTIALS = 1024;

/** Matrix loads an invocation of rowProductWgsl issues before it uses any (in flight together). */
const LOADS = 16;

/**
 * WGSL of out_j = Σ_i row[i] · M[i][j] (M[j][i] where the WGSL condition `transpose` holds) for j < d, by a workgroup
 * of WG = 256 invocations; M is row-major d×d from vec4 `base4` of `matrix` (array<vec4<f32>>). Each invocation loads
 * whole vec4s of M, LOADS of them before it uses one, so a head's matrix is read in one or two round trips to memory:
 * with scalar loads, eight in flight, the rotation of Qwen3-4B's q, k and v waited on ~8 of them, and measured slower
 * (bench/results/2026-12-01-nvidia-h200-session13-profile-qwen3-q4_k_m-32k-int2-after.txt). Invocations:
 *   - M[i][j]: (piece, quad), quad = lid % (d/4): outputs 4·quad..+3 over the piece's rows of M (a warp reads whole
 *     rows of M);
 *   - M[j][i]: (j, half), half = lid % 2: every other vec4 of row j of M.
 * Their sums meet in `partial` (ROW_PRODUCT_PARTIALS f32 of workgroup memory); after a barrier `store(j, value)`
 * writes output j. Needs `lid` and `d` (a multiple of 8, <= 256) in scope, and the row as d workgroup f32; the
 * barriers need `transpose` uniform. Shared by the decode builds of the rotation kernel and of the attention merge
 * pass's un-rotation (the rotation kernel's prefill build takes blockFunction's register tiles instead).
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
    ${halvesSumWgsl(o.store)}
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
      ${piecePartialWgsl('a')}
    }
    workgroupBarrier();
    ${pieceSumWgsl(o.store)}
  }
}`;
}

/** A row product's (piece, quad) invocation writes its vec4 of partial sums (untransposed layout). */
function piecePartialWgsl(sum4: string): string {
  return `let at = piece * d + 4u * quad;
      partial[at] = ${sum4}.x;
      partial[at + 1u] = ${sum4}.y;
      partial[at + 2u] = ${sum4}.z;
      partial[at + 3u] = ${sum4}.w;`;
}

/** ... then each output element is the sum of its pieces' partials, stored by `store`. */
function pieceSumWgsl(store: (j: string, value: string) => string): string {
  return `let used = (d + rows - 1u) / rows;
    for (var j = lid; j < d; j += 256u) {
      var sum = 0.0;
      for (var p = 0u; p < used; p++) { sum += partial[p * d + j]; }
      ${store('j', 'sum')}
    }`;
}

/** Transposed layout: each output element is the sum of its two invocations' halves, stored by `store`. */
function halvesSumWgsl(store: (j: string, value: string) => string): string {
  return `for (var j = lid; j < d; j += 256u) { ${store('j', 'partial[2u * j] + partial[2u * j + 1u]')} }`;
}

/** Matrix vec4s an invocation of a prefetched row product holds: all of its share of the matrix for headDim <= 128. */
const PREFETCHED = 16;
/** The caller's declaration of the registers prefetchedRowProductWgsl loads into. */
export const ROW_MATRIX_DECLARATION = `var rowMatrix: array<vec4<f32>, ${PREFETCHED}>;`;
/** Most head dims prefetchedRowProductWgsl serves. */
export const PREFETCHED_ROW_MAX_DIM = 128;

/**
 * rowProductWgsl in two parts, for a kernel that knows its head's matrix before it has the row: `load(matrix, base4)`
 * (at the kernel's start) issues every matrix load the invocation's share needs into registers (`rowMatrix`,
 * PREFETCHED vec4s), so they are in flight with the kernel's other loads, and `product(row, store)` (where
 * rowProductWgsl would be) adds them up against the row and stores as it does, with the same invocation layout and
 * the same sums in the same order.
 * For headDim <= 128: rope-append and the attention merge (its wide build) take rowProductWgsl past it
 * (PREFETCHED_ROW_MAX_DIM); `transpose` is fixed by the build. The loads wait on one round trip to memory where
 * rowProductWgsl's wait on a second one after the row's (the rotated cache's q/k/v rotation and output un-rotation,
 * each once a layer of a decode step).
 */
export function prefetchedRowProductWgsl(transpose: boolean): {
  load: (matrix: string, base4: string) => string;
  product: (row: string, store: (j: string, value: string) => string) => string;
} {
  // The caller declares the registers (ROW_MATRIX_DECLARATION) where both parts see them.
  if (transpose) {
    // Invocation (j, half): vec4s half, half + 2, ... of row j of M, one j per invocation for d <= 128.
    return {
      load: (matrix, base4) => `{
    let quads = d / 4u;
    let j = lid / 2u;
    let half = lid % 2u;
    if (j < d) {
      for (var u = 0u; u < ${PREFETCHED}u; u++) {
        if (half + 2u * u < quads) { rowMatrix[u] = ${matrix}[${base4} + j * quads + half + 2u * u]; }
      }
    }
  }`,
      product: (row, store) => `{
  let quads = d / 4u;
  let j = lid / 2u;
  let half = lid % 2u;
  if (j < d) {
    var a = array<vec4<f32>, 4>();
    for (var u = 0u; u < ${PREFETCHED}u; u++) {
      let c = half + 2u * u;
      if (c < quads) {
        a[u % 4u] += vec4<f32>(${row}[4u * c], ${row}[4u * c + 1u], ${row}[4u * c + 2u], ${row}[4u * c + 3u]) * rowMatrix[u];
      }
    }
    let sum4 = (a[0] + a[1]) + (a[2] + a[3]);
    partial[2u * j + half] = (sum4.x + sum4.y) + (sum4.z + sum4.w);
  }
  workgroupBarrier();
  ${halvesSumWgsl(store)}
}`,
    };
  }
  // Invocation (piece, quad): vec4 quad of rows piece·rows .. of M, at most 16 rows for d <= 128.
  const layout = `let quads = d / 4u;
    let pieces = 256u / quads;
    let rows = (d + pieces - 1u) / pieces;
    let quad = lid % quads;
    let piece = lid / quads;
    let first = min(piece * rows, d);
    let last = min(first + rows, d);`;
  return {
    load: (matrix, base4) => `{
    ${layout}
    if (piece < pieces) {
      for (var u = 0u; u < ${PREFETCHED}u; u++) {
        if (first + u < last) { rowMatrix[u] = ${matrix}[${base4} + (first + u) * quads + quad]; }
      }
    }
  }`,
    product: (row, store) => `{
  ${layout}
  if (piece < pieces) {
    var a = array<vec4<f32>, 4>();
    for (var u = 0u; u < ${PREFETCHED}u; u++) {
      if (first + u < last) { a[u % 4u] += ${row}[first + u] * rowMatrix[u]; }
    }
    let sum4 = (a[0] + a[1]) + (a[2] + a[3]);
    ${piecePartialWgsl('sum4')}
  }
  workgroupBarrier();
  ${pieceSumWgsl(store)}
}`,
  };
}

/**
 * How the prefill build lays out a workgroup: `invocations` invocations in row groups of headDim / 4, each group
 * taking `rowsPerInvocation` rows of the block, each invocation a vec4 of outputs of each. The invocations read the
 * rows from memory themselves and store their outputs after a barrier (the update is in place).
 */
export interface RotateBlockLayout {
  invocations: 64 | 128 | 256;
  rowsPerInvocation: number;
}

/**
 * The layout prefill graphs take: 128 invocations, 8 rows each: measured close to the best layout at each shape
 * (`bench/rotate-kernel.ts`, 1024 tokens; bench/results/2026-12-01-nvidia-h200-session22-rotate-kernel.json,
 * ...-session22-rotate-kernel-runtime.json). The build before it staged each block's rows in 16 KiB of workgroup memory
 * for 64 invocations, which left few warps an SM, and measured slower at every shape.
 */
export const ROTATE_PREFILL_LAYOUT: RotateBlockLayout = { invocations: 128, rowsPerInvocation: 8 };

/**
 * Tokens a workgroup of the prefill build takes for one head: its rows share the head's matrix, which the workgroup
 * then reads once for all of them (row groups × rowsPerInvocation).
 */
export function rotateBlockTokens(headDim: number, layout: RotateBlockLayout = ROTATE_PREFILL_LAYOUT): number {
  return rowGroups(headDim, layout.invocations) * layout.rowsPerInvocation;
}

/** Row groups of a prefill build's invocations: each group's invocations take a vec4 of outputs each. */
function rowGroups(headDim: number, invocations: number): number {
  return Math.max(1, Math.floor(invocations / (headDim / 4)));
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
 * The prefill build's rows of part p: rotateBlockTokens tokens from `token0` of one head, read by the invocations
 * themselves and stored after a barrier (the update is in place); invocation (quad, group) takes outputs
 * 4·quad..4·quad + 3 of the group's rows, RPI of them: per 4 input dims, 4 vec4 loads of the matrix and one vec4 read
 * of each row feed 16·RPI multiply-adds. (A build with each invocation taking one output column of 16 rows, its matrix
 * reads a vec4 per element used and a row read per 4 multiply-adds, measured slower in Qwen3-4B's 1024-token chunk with
 * a 2-bit cache, both rotating q, k and v and un-rotating the attention's output:
 * bench/results/2026-12-01-nvidia-h200-session20-kernel-experiments.txt.)
 * `headDim` is the build's: the register tile is sized by it.
 */
function blockFunction(p: number, headDim: number, layout: RotateBlockLayout): string {
  const QUADS = headDim / 4;
  const BT = rotateBlockTokens(headDim, layout);
  const GROUPS = rowGroups(headDim, layout.invocations);
  const RPI = layout.rowsPerInvocation;
  const rows = Array.from({ length: RPI }, (_, k) => k);
  // The loop over the input's vec4s c: the matrix's vec4s m0..m3 (at matrix4 + `at(e)`) against each row's vec4 c,
  // x (from the tensor, bound as vec4s; rows past the step's last read it again), whose product `product` adds to
  // the row's outputs.
  const inputLoop = (why: string, at: (e: number) => string, product: string) => `      // ${why}
      for (var c = 0u; c < quads; c++) {
${[0, 1, 2, 3].map((e) => `        let m${e} = rotation${p}[matrix4 + ${at(e)}];`).join('\n')}
${rows
  .map(
    (k) => `        {
          let x = x${p}[row${k} + c];
          acc[${k}] += ${product};
        }`,
  )
  .join('\n')}
      }`;
  return `fn rotateBlock${p}(part: vec4<u32>, head: u32, token0: u32, lid: u32) {
  let d = ${headDim}u;
  let quads = ${QUADS}u;
  let tokens = min(step.tokens - token0, ${BT}u);
  let quad = lid % quads;
  let group = lid / quads;
  let first = group * ${RPI}u;
  let matrix4 = (part.w + (head / part.y) * d * d) / 4u;
${rows.map((k) => `  let row${k} = ((token0 + min(first + ${k}u, tokens - 1u)) * part.x + head) * quads;`).join('\n')}
  var acc = array<vec4<f32>, ${RPI}>();
  // Invocations past the row groups (where quads do not divide the workgroup) only meet the barrier.
  if (group < ${GROUPS}u) {
    if (part.z == 1u) {
${inputLoop(
  "Outputs j = 4·quad + e take row j of the matrix: its vec4 c against the rows' vec4 c.",
  (e) => `(4u * quad + ${e}u) * quads + c`,
  'vec4<f32>(dot(x, m0), dot(x, m1), dot(x, m2), dot(x, m3))',
)}
    } else {
${inputLoop(
  "Outputs 4·quad.. take vec4 quad of rows 4c..4c + 3 of the matrix, times the rows' dims 4c..4c + 3.",
  (e) => `(4u * c + ${e}u) * quads + quad`,
  'x.x * m0 + x.y * m1 + x.z * m2 + x.w * m3',
)}
    }
  }
  // In place: every row is read whole by its group before any of its outputs is stored.
  storageBarrier();
  if (group < ${GROUPS}u) {
${rows.map((k) => `    if (first + ${k}u < tokens) { x${p}[row${k} + quad] = acc[${k}]; }`).join('\n')}
  }
}`;
}

/**
 * The rotate kernel for `parts` tensors. `blocks` builds it for prefill graphs: a workgroup (laid out by `layout`)
 * takes rotateBlockTokens(headDim, layout) tokens of a head (grid y: token blocks), each invocation storing whole
 * outputs, instead of 256 invocations a row whose partial sums meet in workgroup memory (rowProductWgsl, built for
 * the one row of a decode step; grid y: tokens). Same bindings and params, but the blocks build binds the rotated
 * tensors as vec4s.
 */
export function rotateSource(
  parts: 1 | 2 | 3,
  blocks = false,
  headDim = 0,
  layout: RotateBlockLayout = ROTATE_PREFILL_LAYOUT,
): string {
  if (blocks && (headDim % 8 !== 0 || headDim < 8 || headDim > 256)) {
    throw new RangeError(`rotate: the blocks build needs headDim a multiple of 8 up to 256, got ${headDim}`);
  }
  if (
    !(Number.isInteger(layout.rowsPerInvocation) && layout.rowsPerInvocation >= 1 && layout.rowsPerInvocation <= 16)
  ) {
    throw new RangeError(`rotate: a block layout takes 1 to 16 rows an invocation, got ${layout.rowsPerInvocation}`);
  }
  const ids = [...Array(parts).keys()];
  const element = blocks ? 'vec4<f32>' : 'f32';
  const xs = ids.map((p) => `@group(0) @binding(${p}) var<storage, read_write> x${p}: array<${element}>;`).join('\n');
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

${ids.map((p) => (blocks ? blockFunction(p, headDim, layout) : rowFunction(p))).join('\n')}

const WG: u32 = ${blocks ? layout.invocations : 256}u;
${
  blocks
    ? ''
    : `var<workgroup> row: array<f32, 256>;
var<workgroup> partial: array<f32, ${ROW_PRODUCT_PARTIALS}>;`
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let token = wg.y${blocks ? ` * ${rotateBlockTokens(headDim, layout)}u` : ''};
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
