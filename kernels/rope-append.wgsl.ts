import { KV_STEP_WGSL, kvStoreWgsl } from './kv-append.wgsl.ts';
import { rmsScaleWgsl } from './rmsnorm.wgsl.ts';
import { ROPE_HEAD_NORM_MAX_DIM, ropePairWgsl } from './rope.wgsl.ts';
import {
  prefetchedRowProductWgsl,
  ROW_MATRIX_DECLARATION,
  ROW_PRODUCT_PARTIALS,
  rowProductWgsl,
} from './rotate.wgsl.ts';
import { wgslConstants } from './wgsl-constants.ts';

/** What a build of the fused decode store does besides RoPE and the store. */
export interface RopeAppendBuild {
  /** Qwen3's per-head RMSNorm of q and k before RoPE. */
  headNorm: boolean;
  /** The rotated cache's per-KV-head rotations: q and k by R_K after RoPE, v by R_V. */
  rotate: boolean;
  /**
   * Rotated builds for heads of up to PREFETCHED_ROW_MAX_DIM dims load their matrix first, with the row
   * (prefetchedRowProductWgsl); larger heads load it after RoPE (rowProductWgsl).
   */
  prefetch: boolean;
}

/**
 * Storage bindings of a build: q, k, v, the frequency divisors and the page table; R_K and R_V (rotate); the q and k
 * norm weights (headNorm); after the three uniforms, the four slabs.
 */
export function ropeAppendStorageBindings(build: Pick<RopeAppendBuild, 'headNorm' | 'rotate'>): number {
  return 9 + (build.rotate ? 2 : 0) + (build.headNorm ? 2 : 0);
}

/**
 * A decode step's q, k and v from the projections to the cache, in one dispatch: one workgroup per head of q, k or v
 * (in that order on the grid) takes the head into workgroup memory, normalizes it (headNorm, q and k), applies RoPE
 * (q and k), multiplies it by its KV head's rotation (rotate: R_K for q and k, R_V for v), then writes q back in place
 * and k and v into their page as packed f16. The same arithmetic as the rope, rotate and kv-append kernels one after
 * another (each step in the same order), in one launch instead of three: a decode step is bound by dispatch gaps.
 * Decode only: the step's one token is at `step.position` (RoPE) and `kvStep.position` (its page).
 */
export function ropeAppendWgsl(build: RopeAppendBuild): string {
  if (build.prefetch && !build.rotate)
    throw new RangeError('rope-append: only a rotated build prefetches its matrices');
  // The row product's invocations are laid out for 256 (rowProductWgsl).
  const WG = build.rotate ? 256 : 64;
  const storage = [
    'read_write> q: array<f32>',
    'read> k: array<f32>',
    'read> v: array<f32>',
    'read> freqFactors: array<f32>',
    'read> pageTable: array<u32>',
    ...(build.rotate ? ['read> keyRotation: array<vec4<f32>>', 'read> valueRotation: array<vec4<f32>>'] : []),
    ...(build.headNorm ? ['read> qNorm: array<f32>', 'read> kNorm: array<f32>'] : []),
  ];
  // The slabs come last: kvPoolDispatch binds them after the dispatch's own buffers.
  const bindings = [
    ...storage.map((decl, i) => `@group(0) @binding(${i}) var<storage, ${decl};`),
    `@group(0) @binding(${storage.length}) var<uniform> params: Params;`,
    `@group(0) @binding(${storage.length + 1}) var<uniform> step: Step;`,
    `@group(0) @binding(${storage.length + 2}) var<uniform> kvStep: KvStep;`,
    ...[0, 1, 2, 3].map(
      (i) => `@group(0) @binding(${storage.length + 3 + i}) var<storage, read_write> slab${i}: array<u32>;`,
    ),
  ].join('\n');
  const rotateRow = (matrix: string, base4: string) =>
    rowProductWgsl({ row: 'row', matrix, base4, transpose: 'false', store: (j, value) => `row[${j}] = ${value};` });
  const prefetched = prefetchedRowProductWgsl(false);
  return (
    wgslConstants({ WG, MAX_HEAD_DIM: ROPE_HEAD_NORM_MAX_DIM }) +
    /* wgsl */ `
struct Params {
  heads: u32, kvHeads: u32, headDim: u32, ropeDim: u32,
  neox: u32, base: f32, eps: f32, magnitude: f32,
  kOffset: u32, vOffset: u32, pageWords: u32, pageTokens: u32,
  keyMatrix: u32, valueMatrix: u32, groupHeads: u32, _pad: u32,
}
struct Step { position: u32, tokens: u32, _p0: u32, _p1: u32 }
${KV_STEP_WGSL}

${bindings}
${ropePairWgsl}
${kvStoreWgsl}
${build.headNorm ? rmsScaleWgsl : ''}
var<workgroup> row: array<f32, MAX_HEAD_DIM>;
${build.rotate ? `var<workgroup> partial: array<f32, ${ROW_PRODUCT_PARTIALS}>;` : ''}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  if (kvStep.tokens == 0u) { return; }
  let d = params.headDim;
  // The grid: q's heads, then k's, then v's.
  let isQ = wg.x < params.heads;
  let isV = wg.x >= params.heads + params.kvHeads;
  var head = wg.x;
  if (isV) { head -= params.heads + params.kvHeads; } else if (!isQ) { head -= params.heads; }
${
  build.rotate
    ? `  // The head's rotation: R_V for v, its KV head's R_K for q and k. Its loads go out first, with the row's.
  var m = head;
  if (isQ) { m = head / params.groupHeads; }
  var matrix4 = (params.keyMatrix + m * d * d) / 4u;
  if (isV) { matrix4 = (params.valueMatrix + head * d * d) / 4u; }
  ${
    build.prefetch
      ? `${ROW_MATRIX_DECLARATION}
  if (isV) ${prefetched.load('valueRotation', 'matrix4')} else ${prefetched.load('keyRotation', 'matrix4')}`
      : ''
  }`
    : ''
}
  ${build.headNorm ? 'var sum = 0.0;' : ''}
  for (var i = lid; i < d; i += WG) {
    var x: f32;
    if (isQ) { x = q[head * d + i]; } else if (isV) { x = v[head * d + i]; } else { x = k[head * d + i]; }
    row[i] = x;
    ${build.headNorm ? 'sum += x * x;' : ''}
  }
${
  build.headNorm
    ? `  if (!isV) {
    let scale = rmsScale(sum, lid, f32(d), params.eps);
    for (var i = lid; i < d; i += WG) {
      var w: f32;
      if (isQ) { w = qNorm[i]; } else { w = kNorm[i]; }
      row[i] = row[i] * scale * w;
    }
  }`
    : ''
}
  workgroupBarrier();
  if (!isV) {
    // Each pair is read and written by one invocation: in place.
    for (var i = lid; i < params.ropeDim / 2u; i += WG) {
      let pair = ropePair(i, 0u);
      let x0 = row[pair.a];
      let x1 = row[pair.b];
      row[pair.a] = x0 * pair.c - x1 * pair.s;
      row[pair.b] = x0 * pair.s + x1 * pair.c;
    }
    workgroupBarrier();
  }
${
  build.rotate
    ? `  // The product reads the whole row before its barrier and stores after it: in place.
  ${
    build.prefetch
      ? prefetched.product('row', (j, v) => `row[${j}] = ${v};`)
      : `if (isV) {
    ${rotateRow('valueRotation', 'matrix4')}
  } else {
    ${rotateRow('keyRotation', 'matrix4')}
  }`
  }
  workgroupBarrier();`
    : ''
}
  if (isQ) {
    for (var i = lid; i < d; i += WG) { q[head * d + i] = row[i]; }
    return;
  }
  let pos = kvStep.position;
  let entry = pageTable[kvStep.tableOffset + pos / params.pageTokens];
  let headPairs = d / 2u;
  var first = (head * params.pageTokens + pos % params.pageTokens) * headPairs;
  if (isV) { first += params.vOffset; } else { first += params.kOffset; }
  for (var i = lid; i < headPairs; i += WG) {
    kvStore(entry, first + i, pack2x16float(vec2<f32>(row[2u * i], row[2u * i + 1u])));
  }
}
`
  );
}
