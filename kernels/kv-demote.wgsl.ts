/**
 * Demotion and promotion of KV pages between the f16 kind and the quantized kind (runtime/kv/pool.ts has the page
 * layouts, runtime/kv/quant-format.ts the row format and its CPU reference `quantizeRow` / `dequantizeRow`).
 */
import { wgslConstants } from './wgsl-constants.ts';

/** Maximum stored row width (kvHeads × headDim × positions per row) the demotion kernel holds in workgroup memory. */
export const KV_DEMOTE_MAX_WIDTH = 2048;

/**
 * The demotion's and the promotion's shared declarations: the row format, and the four slab slots (read_write u32,
 * bindings 2..5) with a load and a store by slot.
 */
const formatAndSlabsWgsl = /* wgsl */ `
struct Format { bits: u32, groupSize: u32, codeWords: u32, rowWords: u32, loRank: u32, hiRank: u32, _a: u32, _b: u32 }

@group(0) @binding(2) var<storage, read_write> slab0: array<u32>;
@group(0) @binding(3) var<storage, read_write> slab1: array<u32>;
@group(0) @binding(4) var<storage, read_write> slab2: array<u32>;
@group(0) @binding(5) var<storage, read_write> slab3: array<u32>;
fn slabLoad(slot: u32, index: u32) -> u32 {
  var value = 0u;
  switch (slot) {
    case 0u: { value = slab0[index]; }
    case 1u: { value = slab1[index]; }
    case 2u: { value = slab2[index]; }
    default: { value = slab3[index]; }
  }
  return value;
}
fn slabStore(slot: u32, index: u32, value: u32) {
  switch (slot) {
    case 0u: { slab0[index] = value; }
    case 1u: { slab1[index] = value; }
    case 2u: { slab2[index] = value; }
    default: { slab3[index] = value; }
  }
}
`;

/**
 * Quantizes rows of f16 pages into quant pages, for one layer. Workgroup = one stored row (rowTokens consecutive
 * positions, runtime/kv/quant-format.ts): (job, kv, stored row in page), job j
 * being the pair (f16 entry, quant entry) at jobs[4 + 2j]; jobs[0] is this step's job count (the grid is sized for
 * the most a step can carry; surplus workgroups exit at once). Per group, exactly as quantizeRow: lo and hi are the
 * values of ranks loRank and hiRank (= round((1-q)(n-1)) and round(q(n-1)), computed on the CPU) in the group's
 * stable sort: for ranks 0 and n - 1 (clip quantile 1) by min/max scans, for others by counting (O(groupSize) per
 * value, no sort); lo and scale = (hi - lo) / levels are rounded to f16 before coding; code = Math.round((x - lo) /
 * scale) clamped, found by comparing x - lo with the exact products (k - 1/2)·scale.
 */
export const kvDemoteWgsl =
  wgslConstants({ MAX_WIDTH: KV_DEMOTE_MAX_WIDTH }) +
  formatAndSlabsWgsl +
  /* wgsl */ `
struct Params {
  f16K: u32, f16V: u32, quantK: u32, quantV: u32,
  f16PageWords: u32, quantPageWords: u32, pageTokens: u32, headDim: u32,
  width: u32, maxJobs: u32, rowTokens: u32, _p1: u32,
  k: Format, v: Format,
}

@group(0) @binding(0) var<storage, read> jobs: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;

// 256 invocations: a decode step demotes only 2·pageTokens rows a layer (32 workgroups), so the rows' invocations are
// the parallelism there is (64 made a demoting step of Qwen3-4B several times slower, with the rank loop:
// bench/results/2026-12-01-nvidia-h200-session14-profile-qwen3-q4_k_m-32k-int2-demote.txt). A row has at most 256
// groups (width <= 2048, groups of at least 8 values: 32 / bits,
// bits <= 4), one an invocation where groups are merged.
const WG: u32 = 256u;
var<workgroup> vals: array<f32, MAX_WIDTH>;
var<workgroup> groupLo: array<f32, MAX_WIDTH / 8u>;
var<workgroup> groupHi: array<f32, MAX_WIDTH / 8u>;
var<workgroup> groupScale: array<f32, MAX_WIDTH / 8u>;
// Where each span of 8 values has its minimum and its maximum (positions in vals).
var<workgroup> spanMinAt: array<u32, MAX_WIDTH / 8u>;
var<workgroup> spanMaxAt: array<u32, MAX_WIDTH / 8u>;
var<workgroup> groupParam: array<u32, MAX_WIDTH / 8u>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let id = wg.y * groups.x + wg.x;
  let pageRows = params.pageTokens / params.rowTokens;
  let job = id / (2u * pageRows);
  if (job >= jobs[0] || job >= params.maxJobs) { return; }
  let kv = (id / pageRows) % 2u;
  let r = id % pageRows;
  // The stored row's values: position r·rowTokens + i / width, value i % width of that position's row.
  let width = params.width * params.rowTokens;
  let src = jobs[4u + 2u * job];
  let dst = jobs[5u + 2u * job];
  var f = params.k;
  var srcBase = params.f16K;
  var dstBase = params.quantK;
  if (kv == 1u) {
    f = params.v;
    srcBase = params.f16V;
    dstBase = params.quantV;
  }
  srcBase += (src & 0xffffffu) * params.f16PageWords;
  dstBase += (dst & 0xffffffu) * params.quantPageWords + r * f.rowWords;
  let srcSlot = (src >> 24u) & 0xfu;
  let dstSlot = (dst >> 24u) & 0xfu;
  let headPairs = params.headDim / 2u;

  for (var i = lid; i < width; i += WG) {
    let t = r * params.rowTokens + i / params.width;
    let h = (i % params.width) / params.headDim;
    let d = i % params.headDim;
    let word = slabLoad(srcSlot, srcBase + (h * params.pageTokens + t) * headPairs + d / 2u);
    vals[i] = unpack2x16float(word)[d % 2u];
  }
  workgroupBarrier();
  let size = f.groupSize;
  let groupCount = width / size;
  if (f.loRank == 0u && f.hiRank == size - 1u) {
    // Plain min/max (clip quantile 1, the default) by scans: spans of 8 values, one an invocation (a group is whole
    // spans: 32 / bits divides it; a row of at most 2048 = 8·WG values has at most WG spans), then one invocation a
    // group merges its spans in order. The values of ranks 0 and n - 1 exactly: the first occurrence of the minimum
    // (strict <, spans in order) and the last of the maximum (>=), which differ from other choices only for -0 against
    // +0. The scans keep positions and the value is read at the end: NVIDIA's compiler turned a kept value into min/max
    // instructions, which pick among -0 and +0 their own way
    // (bench/results/2026-12-01-nvidia-h200-session22-demote-kernel-first.json). The scans measured several times
    // faster than the rank loop below (bench/results/2026-12-01-nvidia-h200-session22-demote-kernel.json).
    let first = 8u * lid;
    if (first < width) {
      var lo = vals[first];
      var hi = lo;
      var loAt = first;
      var hiAt = first;
      for (var j = first + 1u; j < first + 8u; j++) {
        let u = vals[j];
        if (u < lo) { lo = u; loAt = j; }
        if (u >= hi) { hi = u; hiAt = j; }
      }
      spanMinAt[lid] = loAt;
      spanMaxAt[lid] = hiAt;
    }
    workgroupBarrier();
    if (lid < groupCount) {
      let spans = size / 8u;
      var loAt = spanMinAt[lid * spans];
      var hiAt = spanMaxAt[lid * spans];
      var lo = vals[loAt];
      var hi = vals[hiAt];
      for (var s = 1u; s < spans; s++) {
        var j = spanMinAt[lid * spans + s];
        var u = vals[j];
        if (u < lo) { lo = u; loAt = j; }
        j = spanMaxAt[lid * spans + s];
        u = vals[j];
        if (u >= hi) { hi = u; hiAt = j; }
      }
      groupLo[lid] = vals[loAt];
      groupHi[lid] = vals[hiAt];
    }
  } else {
    // Values i, i + WG, i + 2·WG, i + 3·WG ranked in one pass over j: four independent chains of loads and compares
    // (measured a little faster than one value a pass:
    // bench/results/2026-12-01-nvidia-h200-session20-kernel-experiments.txt; past the row, a value is the row's
    // last again and its rank unused).
    for (var i0 = lid; i0 < width; i0 += 4u * WG) {
      var at: array<u32, 4>;
      var x: array<f32, 4>;
      var base: array<u32, 4>;
      var rank = array<u32, 4>();
      for (var k = 0u; k < 4u; k++) {
        at[k] = min(i0 + k * WG, width - 1u);
        x[k] = vals[at[k]];
        base[k] = (at[k] / size) * size;
      }
      for (var j = 0u; j < size; j++) {
        for (var k = 0u; k < 4u; k++) {
          let u = vals[base[k] + j];
          if (u < x[k] || (u == x[k] && base[k] + j < at[k])) { rank[k]++; }
        }
      }
      for (var k = 0u; k < 4u; k++) {
        if (i0 + k * WG < width) {
          let g = at[k] / size;
          if (rank[k] == f.loRank) { groupLo[g] = x[k]; }
          if (rank[k] == f.hiRank) { groupHi[g] = x[k]; }
        }
      }
    }
  }
  workgroupBarrier();
  let maxCode = (1u << f.bits) - 1u;
  // The rounded lo and scale reach the coding loop through workgroup memory as packed halves: lavapipe folds
  // unpack2x16float(pack2x16float(x)) back to x within one expression, which skips the f16 rounding.
  for (var g = lid; g < width / size; g += WG) {
    let loBits = pack2x16float(vec2<f32>(groupLo[g], 0.0)) & 0xffffu;
    groupParam[g] = loBits;
  }
  workgroupBarrier();
  for (var g = lid; g < width / size; g += WG) {
    let lo = unpack2x16float(groupParam[g]).x;
    let scaleBits = pack2x16float(vec2<f32>(max(groupHi[g] - lo, 0.0) / f32(maxCode), 0.0)) & 0xffffu;
    groupParam[g] = groupParam[g] | (scaleBits << 16u);
    slabStore(dstSlot, dstBase + f.codeWords + g, groupParam[g]);
  }
  workgroupBarrier();
  for (var g = lid; g < width / size; g += WG) {
    let p = unpack2x16float(groupParam[g]);
    groupLo[g] = p.x;
    groupScale[g] = p.y;
  }
  workgroupBarrier();
  let perWord = 32u / f.bits;
  for (var w = lid; w < f.codeWords; w += WG) {
    var word = 0u;
    for (var k = 0u; k < perWord; k++) {
      let i = w * perWord + k;
      let g = i / size;
      let s = groupScale[g];
      // Math.round((x - lo) / s) clamped = the largest k with x - lo >= (k - 1/2)·s: exact products and comparisons,
      // no division (whose rounding moved values across code boundaries on lavapipe).
      var code = 0u;
      if (s > 0.0) {
        let diff = vals[i] - groupLo[g];
        for (var c = 1u; c <= maxCode; c++) {
          if (diff >= (f32(c) - 0.5) * s) { code = c; }
        }
      }
      word |= code << (k * f.bits);
    }
    slabStore(dstSlot, dstBase + w, word);
  }
}
`;

/**
 * Promotes quant pages back to f16 pages (their dequantized values rounded to f16), for one layer per dispatch
 * (layers may differ in format): one invocation per (job, kv, token, value pair). Used only when a rollback rewrites
 * a quantized position.
 */
export const kvPromoteWgsl =
  formatAndSlabsWgsl +
  /* wgsl */ `
struct Params {
  f16KeyOffset: u32, f16ValueOffset: u32, quantKeyOffset: u32, quantValueOffset: u32,
  rowTokens: u32, headDim: u32, pageTokens: u32, f16PageWords: u32,
  quantPageWords: u32, jobs: u32, width: u32, _pad: u32,
  k: Format, v: Format,
}

@group(0) @binding(0) var<storage, read> jobs: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;

fn dequantize(slot: u32, row: u32, f: Format, e: u32) -> f32 {
  let perWord = 32u / f.bits;
  let code = (slabLoad(slot, row + e / perWord) >> ((e % perWord) * f.bits)) & ((1u << f.bits) - 1u);
  let p = unpack2x16float(slabLoad(slot, row + f.codeWords + e / f.groupSize));
  return p.x + f32(code) * p.y;
}

// One layer (its offsets and formats in params): K and V rows of every job's page.
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = (wg.y * groups.x + wg.x) * 64u + lid;
  let rowPairs = params.width / 2u;
  let perJob = 2u * params.pageTokens * rowPairs;
  let job = i / perJob;
  if (job >= params.jobs) { return; }
  var r = i % perJob;
  let pair = r % rowPairs;
  r = r / rowPairs;
  let t = r % params.pageTokens;
  let kv = r / params.pageTokens;
  let src = jobs[2u * job];
  let dst = jobs[2u * job + 1u];
  var f = params.k;
  var row = params.quantKeyOffset + (t / params.rowTokens) * params.k.rowWords;
  var f16Offset = params.f16KeyOffset;
  if (kv == 1u) {
    f = params.v;
    row = params.quantValueOffset + (t / params.rowTokens) * params.v.rowWords;
    f16Offset = params.f16ValueOffset;
  }
  let slot = (src >> 24u) & 0xfu;
  row += (src & 0xffffffu) * params.quantPageWords;
  let e = 2u * pair;
  let stored = (t % params.rowTokens) * params.width + e; // the value's index in its stored row
  let value = vec2<f32>(dequantize(slot, row, f, stored), dequantize(slot, row, f, stored + 1u));
  let headPairs = params.headDim / 2u;
  let h = e / params.headDim;
  let d = e % params.headDim;
  let word = (dst & 0xffffffu) * params.f16PageWords + f16Offset + (h * params.pageTokens + t) * headPairs + d / 2u;
  slabStore((dst >> 24u) & 0xfu, word, pack2x16float(value));
}
`;
