import { KV_STEP_WGSL, kvTileLoaderWgsl } from './kv-append.wgsl.ts';
import {
  prefetchedRowProductWgsl,
  ROW_MATRIX_DECLARATION,
  ROW_PRODUCT_PARTIALS,
  rowProductWgsl,
} from './rotate.wgsl.ts';

/** Query rows (token, head) one workgroup serves. */
export const ATTENTION_MAX_ROWS = 16;
/**
 * The largest head the split kernel and its merge are built for: 256 (Falcon3, Gemma), where the merge takes its wide
 * build (attentionMergeSource); the faster decode and prefill kernels serve heads of up to 128.
 */
export const ATTENTION_MAX_HEAD_DIM = 256;
/** The largest head the merge's narrow build serves (4 dims per invocation of an eighth). */
export const MERGE_NARROW_HEAD_DIM = 128;

/** Heads the attention kernels run: K/V move as vec4<u32> (8 halves), up to ATTENTION_MAX_HEAD_DIM dims. */
export function attentionRunsHeadDim(headDim: number): boolean {
  return Number.isInteger(headDim) && headDim >= 8 && headDim % 8 === 0 && headDim <= ATTENTION_MAX_HEAD_DIM;
}
/** rows * headDim/2 <= this (private accumulators per invocation = this / 64). */
export const ATTENTION_MAX_ROW_PAIRS = 512;
/**
 * Keys per tile the split kernel can be built for. The default is 16 on every device: measured on a large GPU (decode,
 * 32K keys, bench/results/2026-11-30-nvidia-h200-attention-tile-sizes.txt), 32 and 64 were slower at headDim 64 (fewer
 * workgroups fit an SM's shared memory, and each invocation's serial work per tile grows), 16 the fastest. Larger tiles
 * stay selectable for that comparison; 8 is what heads of 256 dims take where 16 keys do not fit the workgroup memory
 * (WebGPU's default 16 KiB).
 */
export const ATTENTION_BLOCK_KEY_CHOICES = [8, 16, 32, 64] as const;
export type AttentionBlockKeys = (typeof ATTENTION_BLOCK_KEY_CHOICES)[number];

/** What a split-kernel build is specialized for. */
export interface AttentionKernelShape {
  /** Reads quant pages too (pool mode 'quant'). */
  quant: boolean;
  blockKeys: AttentionBlockKeys;
  headDim: number;
  /** Query rows per workgroup (decode: the GQA group; prefill: up to ATTENTION_MAX_ROWS), rows · headDim/2 <= 512. */
  rows: number;
  /** A sliding-window layer's build (WindowedShape). */
  windowed?: boolean;
}

/**
 * Every attention kernel's shape may ask for the sliding-window build (a local layer's, AttentionBinding.window): the
 * window's first key comes from params.window, which only that build declares and reads. Without it (false or absent)
 * the WGSL is what it was before windows existed, so layers that see the whole sequence pay nothing for them.
 */
export interface WindowedShape {
  windowed?: boolean;
}

/**
 * vec4<u32> words of the K tile (and of the V tile): blockKeys f16 keys; a quant build never under 4 KiB, so quant
 * tiles of f32 values hold 16 keys at headDim 64 (8 at 128).
 */
function tileVec4s(shape: AttentionKernelShape): number {
  const f16 = (shape.blockKeys * shape.headDim) / 8;
  return shape.quant ? Math.max(f16, 256) : f16;
}

/** Keys of a quant-page tile: its values are dequantized to f32, headDim words per key. */
export function attentionQuantBlockKeys(shape: AttentionKernelShape): number {
  return Math.min(shape.blockKeys, Math.floor((tileVec4s(shape) * 4) / shape.headDim));
}

/** Workgroup storage of a split-kernel build: q rows, the K and V tiles, the scores. */
export function attentionWorkgroupBytes(shape: AttentionKernelShape): number {
  return (shape.rows * shape.headDim * 8) / 2 + 2 * tileVec4s(shape) * 16 + shape.rows * shape.blockKeys * 4;
}

/**
 * Keys per split: the keys cut into `splits` chunks, but never fewer than `minChunk` per chunk, so a short context uses
 * few splits (less merge work) and a long one many (enough workgroups to fill the GPU). The grid always has `splits`
 * workgroups along x; the ones past the keys return at once. Shared by the split and the merge pass.
 */
export const SPLIT_CHUNK_WGSL = /* wgsl */ `
fn splitChunk(length: u32, splits: u32, minChunk: u32) -> u32 {
  return max(max(minChunk, 1u), (length + splits - 1u) / splits);
}
/**
 * The splits a step of \`rows\` (token, head) rows takes (splitsOfStep in kernels/attention.ts): \`splits\`, or where
 * splitRows > 0 as many as bring the step to splitRows rows of splits, at most \`splits\`. A row's partial records
 * are this many apart.
 */
fn splitsOfStep(splits: u32, splitRows: u32, rows: u32) -> u32 {
  if (splitRows == 0u) { return splits; }
  return clamp((splitRows + rows - 1u) / rows, 1u, splits);
}
/** The current step's splits (the including shader's params and step: the split and merge passes read the same). */
fn currentStepSplits() -> u32 {
  return splitsOfStep(params.splits, params.splitRows, step.tokens * params.heads);
}`;

/**
 * The opening of a split/prefill workgroup (split s = wg.x, kv head kvh = wg.y, row tile wg.z of `rows` rows): returns
 * when the tile has no query token or the split no key, else leaves `group`, `firstRow`, `lastT` (the tile's last
 * query token) and the split's keys [start, end), cut at the tile's causal end and, in a sliding-window layer, begun
 * no earlier than the window of the tile's first query (windowStart: keys before it are no row's). Every kernel cuts
 * the keys into the same splits, which the merge pass relies on; a split the window empties still writes its record.
 */
export function splitTileWgsl(rows: string, windowed = false): string {
  const keys = windowed
    ? `  let splitStart = s * chunk;
  // Splits past the keys (or the step's splits) have nothing to do: the merge pass reads only ceil(length / chunk).
  if (splitStart >= step.length && s > 0u) { return; }
  let start = max(splitStart, windowStart(step.position + firstRow / group));
  let end = min(splitStart + chunk, step.position + lastT + 1u);`
    : `  let start = s * chunk;
  // Splits past the keys (or the step's splits) have nothing to do: the merge pass reads only ceil(length / chunk).
  if (start >= step.length && s > 0u) { return; }
  let end = min(start + chunk, step.position + lastT + 1u);`;
  return `  let s = wg.x;
  let kvh = wg.y;
  let group = params.heads / params.kvHeads;
  let firstRow = wg.z * ${rows};
  if (firstRow / group >= step.tokens) { return; }
  let lastT = min(step.tokens - 1u, (firstRow + ${rows} - 1u) / group);
  // The step's splits (its partial records per row): the grid's params.splits, or fewer for a step of many rows.
  let stepSplits = currentStepSplits();
  let chunk = splitChunk(step.length, stepSplits, params.minChunk);
${keys}`;
}

/**
 * The first key the query at `position` sees in a sliding-window layer (params.window keys, its own included,
 * llama.cpp's LLAMA_SWA_TYPE_STANDARD): position + 1 − window, or 0 early in the sequence.
 */
const WINDOW_START_WGSL = `
fn windowStart(position: u32) -> u32 {
  return select(0u, position + 1u - params.window, position + 1u > params.window);
}`;

/** The largest window a Params word holds. */
export const MAX_WINDOW = 0xffffffff;

/** Extra Params fields of the mixed (f16 + quant pages) variant. */
const QUANT_PARAMS = `
  quantPageWords: u32, quantKOffset: u32, quantVOffset: u32, quantBlock: u32,
  kBits: u32, kGroup: u32, kCodeWords: u32, kRowWords: u32,
  vBits: u32, vGroup: u32, vCodeWords: u32, vRowWords: u32,
  rowTokens: u32,`;

/**
 * The Params uniform of the split, decode and prefill kernels (the words kernels/attention.ts writes); with quant
 * pages, also where a position lies in them (QUANT_ROW_WGSL, reading the uniform the kernel binds as `params`). A
 * windowed build has the window last, and windowStart.
 */
export function attentionParamsWgsl(quant: boolean, windowed = false): string {
  return `struct Params {
  kOffset: u32, vOffset: u32, pageWords: u32, pageTokens: u32,
  heads: u32, kvHeads: u32, headDim: u32, splits: u32,
  scale: f32, rows: u32, minChunk: u32, int8Keys: u32,
  splitRows: u32,${quant ? QUANT_PARAMS : ''}${windowed ? '\n  window: u32,' : ''}
}${quant ? QUANT_ROW_WGSL : ''}${windowed ? WINDOW_START_WGSL : ''}`;
}

/**
 * The Params uniform and bindings 0..4 (q, the output or partials, the page table, the KvStep, Params) of the split,
 * decode and prefill kernels: one bind group layout and uniform serve all three. The pages follow from binding 5.
 */
export function attentionBindingsWgsl(quant: boolean, windowed = false): string {
  return `${attentionParamsWgsl(quant, windowed)}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read> pageTable: array<u32>;
@group(0) @binding(3) var<uniform> step: KvStep;
@group(0) @binding(4) var<uniform> params: Params;`;
}

/**
 * Where a position of a quant page lies: its stored row (a stored row holds params.rowTokens consecutive positions,
 * runtime/kv/quant-format.ts) and the index of its first value in that row (add kvh · headDim for its KV head).
 */
const QUANT_ROW_WGSL = `
fn quantRow(inPage: u32) -> u32 { return inPage / params.rowTokens; }
fn quantRowStart(inPage: u32) -> u32 { return (inPage % params.rowTokens) * params.kvHeads * params.headDim; }`;

/**
 * Dequantizes the KV head's part of `n` rows of one kind (K or V) of a quant page into `target` as f32 bits, from key
 * `to` of the tile on. When a code word lies inside one head (headDim a multiple of the codes per word: 2-bit codes
 * and headDim 64 or 128), its codes become whole vec4 stores; otherwise each code is placed on its own.
 */
function quantRowLoader(name: string, target: string, p: 'k' | 'v', offset: string): string {
  return `fn ${name}(slot: u32, page: u32, inPage: u32, n: u32, kvh: u32, lid: u32, to: u32) {
  let bits = params.${p}Bits;
  let perWord = 32u / bits;
  let mask = (1u << bits) - 1u;
  // A stored row of several positions holds each position's codes in whole words (quant-format's rule), so every
  // position's head spans the same number of words.
  let headE = kvh * params.headDim;
  let words = (headE + params.headDim - 1u) / perWord - headE / perWord + 1u;
  let wholeWords = params.headDim % perWord == 0u;
  for (var i = lid; i < n * words; i += 64u) {
    let j = i / words;
    let firstE = quantRowStart(inPage + j) + headE;
    let w = firstE / perWord + i % words;
    let row = page + params.${offset} + quantRow(inPage + j) * params.${p}RowWords;
    let codes = quantWord(slot, row + w);
    // A code word never straddles groups (groupSize is a multiple of 32 / bits).
    let lohi = unpack2x16float(quantWord(slot, row + params.${p}CodeWords + (w * perWord) / params.${p}Group));
    if (wholeWords) {
      // Element w·perWord − firstE of the head, a multiple of 4: the word's codes fill perWord / 4 vec4s.
      let t = (to + j) * params.headDim + w * perWord - firstE;
      for (var c = 0u; c < perWord; c += 4u) {
        let q = vec4<f32>(f32((codes >> (c * bits)) & mask), f32((codes >> ((c + 1u) * bits)) & mask),
                          f32((codes >> ((c + 2u) * bits)) & mask), f32((codes >> ((c + 3u) * bits)) & mask));
        ${target}[(t + c) / 4u] = bitcast<vec4<u32>>(vec4<f32>(lohi.x) + q * lohi.y);
      }
    } else {
      for (var c = 0u; c < perWord; c++) {
        let e = w * perWord + c;
        if (e >= firstE && e < firstE + params.headDim) {
          let t = (to + j) * params.headDim + e - firstE;
          ${target}[t / 4u][t % 4u] = bitcast<u32>(lohi.x + f32((codes >> (c * bits)) & mask) * lohi.y);
        }
      }
    }
  }
}`;
}

/**
 * Quant page loads of the mixed variant: slots 2 and 3 hold quant slabs (runtime/kv/pool.ts). A block of a quant
 * page is dequantized (lo + code · scale, exactly dequantizeRow's f32 values) into kt / vt as f32 bits, headDim per
 * key, so a quant tile holds at most quantBlock = attentionQuantBlockKeys(shape) keys. One invocation per (key, code
 * word):
 * each code word and group parameter is read once.
 */
const QUANT_LOADERS = `
fn quantWord(slot: u32, index: u32) -> u32 {
  var w = vec4<u32>(0u);
  if (slot == 2u) { w = slab2[index / 4u]; } else { w = slab3[index / 4u]; }
  return w[index % 4u];
}
${quantRowLoader('loadQuantKeys', 'kt', 'k', 'quantKOffset')}
${quantRowLoader('loadQuantValues', 'vt', 'v', 'quantVOffset')}
fn loadQuant(entry: u32, inPage: u32, n: u32, kvh: u32, lid: u32, to: u32) {
  let slot = (entry >> 24u) & 0xfu;
  let page = (entry & 0xffffffu) * params.quantPageWords;
  loadQuantKeys(slot, page, inPage, n, kvh, lid, to);
  loadQuantValues(slot, page, inPage, n, kvh, lid, to);
}`;

/**
 * Causal GQA attention over the paged f16 KV cache, flash-decoding style.
 *
 * Workgroup (split s, kv head, row tile w). The rows of a kv head are its (query token t, head in group g) pairs,
 * g fastest; a tile holds `rows` of them, so the heads sharing a KV head (GQA) and, in prefill, several query tokens
 * read each K/V tile once. Query t sits at position p = step.position + t and sees keys 0..p (windowStart(p)..p in a
 * sliding-window layer). Keys
 * 0..step.length-1 are cut into `splits` chunks. A chunk is walked in tiles of <= BLOCK keys; a tile is filled page
 * by page, one contiguous run of K and one of V per page, copied to shared memory by the whole workgroup
 * (independent loads, no per-key page lookups). Then the scores (rows x keys) go to shared memory, and each
 * invocation, owning (row, dim pair) accumulators, updates its own online softmax (max, sum; f32) from the row's
 * scores and accumulates V: the exponentials are recomputed per dim pair rather than shared, which costs ALU work and
 * saves a barrier and a serial pass per tile. The mixed variant never mixes page kinds in one tile.
 * splits = 1: writes the normalized output. splits > 1: writes (max, sum, Σ p·V) per (t, h, s) for the merge pass.
 * headDim <= 256, a multiple of 8 (K/V move as vec4<u32>: 8 halves); rows <= 16; rows * headDim/2 <= 512.
 * Built per shape: a decode build sizes its registers and shared memory for the GQA group's rows only, which lets
 * more workgroups share an SM. Shared memory: attentionWorkgroupBytes(shape).
 */
export function attentionPartialSource(shape: AttentionKernelShape): string {
  const { quant, blockKeys, headDim, rows, windowed = false } = shape;
  const tileVec4 = tileVec4s(shape);
  const rowPairs = (rows * headDim) / 2;
  // A row sees keys before its causal end (and, windowed, from its window's first).
  const visible = windowed
    ? `let rowPosition = step.position + row / group;
      if (j < n && row / group < step.tokens && block + j <= rowPosition && block + j >= windowStart(rowPosition)) {`
    : 'if (j < n && row / group < step.tokens && block + j <= step.position + row / group) {';
  return /* wgsl */ `
${attentionBindingsWgsl(quant, windowed)}
${SPLIT_CHUNK_WGSL}
${kvTileLoaderWgsl(
  [
    { name: 'loadKeys', target: 'kt' },
    { name: 'loadValues', target: 'vt' },
  ],
  5,
  64,
  tileVec4,
)}${quant ? QUANT_LOADERS : ''}

const WG: u32 = 64u;
const BLOCK: u32 = ${blockKeys}u;
const MAX_ITEMS: u32 = ${Math.ceil(rowPairs / 64)}u;
const NONE: f32 = -1e30;

var<workgroup> qs: array<vec2<f32>, ${rowPairs}>;
var<workgroup> kt: array<vec4<u32>, ${tileVec4}>;
var<workgroup> vt: array<vec4<u32>, ${tileVec4}>;
var<workgroup> sc: array<f32, ${rows * blockKeys}>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let rows = params.rows;
${splitTileWgsl('rows', windowed)}
  let pairs = params.headDim / 2u;

  for (var i = lid; i < rows * pairs; i += WG) {
    let row = firstRow + i / pairs;
    let t = row / group;
    var v = vec2<f32>(0.0);
    if (t < step.tokens) {
      let base = (t * params.heads + kvh * group + row % group) * params.headDim + 2u * (i % pairs);
      v = vec2<f32>(q[base], q[base + 1u]) * params.scale;
    }
    qs[i] = v;
  }
  // Per (row, dim pair) item: running max, sum and Σ p·V. Every item of a row sees the same scores, so they agree.
  var rowMax: array<f32, MAX_ITEMS>;
  var rowSum: array<f32, MAX_ITEMS>;
  var acc: array<vec2<f32>, MAX_ITEMS>;
  for (var k = 0u; k < MAX_ITEMS; k++) {
    rowMax[k] = NONE;
    rowSum[k] = 0.0;
    acc[k] = vec2<f32>(0.0);
  }

  let headBase = kvh * params.pageTokens * pairs;
  var block = start;
  loop {
    if (block >= end) { break; }
    let tileEnd = min(block + BLOCK, end);
    // The previous tile's readers are done with kt, vt and sc.
    workgroupBarrier();
    var n = 0u;${quant ? '\n    var quantTile = false;' : ''}
    loop {
      let key = block + n;
      if (key >= tileEnd) { break; }
      let inPage = key % params.pageTokens;
      let entry = pageTable[step.tableOffset + key / params.pageTokens];
      var run = min(tileEnd - key, params.pageTokens - inPage);
${
  quant
    ? `      let isQuant = (entry >> 28u) == 1u;
      if (n == 0u) { quantTile = isQuant; } else if (isQuant != quantTile) { break; }
      if (isQuant) {
        run = min(run, params.quantBlock - n);
        if (run == 0u) { break; }
        loadQuant(entry, inPage, run, kvh, lid, n);
      } else {
        loadKeys(entry, (params.kOffset + headBase + inPage * pairs) / 4u, run * pairs / 4u, lid, n * pairs / 4u);
        loadValues(entry, (params.vOffset + headBase + inPage * pairs) / 4u, run * pairs / 4u, lid, n * pairs / 4u);
      }`
    : `      loadKeys(entry, (params.kOffset + headBase + inPage * pairs) / 4u, run * pairs / 4u, lid, n * pairs / 4u);
      loadValues(entry, (params.vOffset + headBase + inPage * pairs) / 4u, run * pairs / 4u, lid, n * pairs / 4u);`
}
      n += run;
    }
    workgroupBarrier();
    for (var i = lid; i < rows * BLOCK; i += WG) {
      let r = i / BLOCK;
      let j = i % BLOCK;
      let row = firstRow + r;
      var score = NONE;
      ${visible}
        var sum = 0.0;
${
  quant
    ? `        if (quantTile) {
          // The tile holds f32 values (dequantized on load), headDim per key, read as vec4s (two dim pairs).
          // Start each key at a different vec4: keys sit headDim floats apart, so the same vec4 of 16 keys
          // would hit one shared-memory bank. The wrap is a compare, not a division per step.
          let hq = params.headDim / 4u;
          var w = j % hq;
          for (var ww = 0u; ww < hq; ww++) {
            let k4 = bitcast<vec4<f32>>(kt[j * hq + w]);
            let qi = r * pairs + 2u * w;
            sum += dot(vec4<f32>(qs[qi], qs[qi + 1u]), k4);
            w += 1u;
            if (w == hq) { w = 0u; }
          }
        } else {
`
    : ''
}        let quads = pairs / 4u;
        // Staggered start per key (see above): rows of kt are quads vec4s apart, a bank-conflicting stride.
        var w = j % quads;
        for (var ww = 0u; ww < quads; ww++) {
          let kw = kt[j * quads + w];
          let qi = r * pairs + 4u * w;
          sum += dot(qs[qi], unpack2x16float(kw.x)) + dot(qs[qi + 1u], unpack2x16float(kw.y)) +
            dot(qs[qi + 2u], unpack2x16float(kw.z)) + dot(qs[qi + 3u], unpack2x16float(kw.w));
          w += 1u;
          if (w == quads) { w = 0u; }
        }
${quant ? '        }\n' : ''}        score = sum;
      }
      sc[i] = score;
    }
    workgroupBarrier();
    for (var k = 0u; k < MAX_ITEMS; k++) {
      let i = lid + k * WG;
      if (i >= rows * pairs) { break; }
      let r = i / pairs;
      let pair = i % pairs;
      var best = rowMax[k];
      for (var j = 0u; j < n; j++) { best = max(best, sc[r * BLOCK + j]); }
      let correction = select(1.0, exp(rowMax[k] - best), rowMax[k] > NONE);
      var total = rowSum[k] * correction;
      var a = acc[k] * correction;
${
  quant
    ? `      if (quantTile) {
        // Dim pair "pair" of key j is half of vec4 j·headDim/4 + pair/2 of the f32 tile.
        let hq = params.headDim / 4u;
        let quad = pair / 2u;
        let high = (pair & 1u) == 1u;
        for (var j = 0u; j < n; j++) {
          let x = sc[r * BLOCK + j];
          let p = select(0.0, exp(x - best), x > NONE);
          total += p;
          let w = vt[j * hq + quad];
          a += p * bitcast<vec2<f32>>(select(w.xy, w.zw, high));
        }
      } else {
`
    : ''
}      for (var j = 0u; j < n; j++) {
        let x = sc[r * BLOCK + j];
        let p = select(0.0, exp(x - best), x > NONE);
        total += p;
        let word = j * pairs + pair;
        a += p * unpack2x16float(vt[word / 4u][word % 4u]);
      }
${quant ? '      }\n' : ''}      acc[k] = a;
      rowSum[k] = total;
      rowMax[k] = best;
    }
    block += n;
  }

  for (var k = 0u; k < MAX_ITEMS; k++) {
    let i = lid + k * WG;
    if (i >= rows * pairs) { break; }
    let r = i / pairs;
    let row = firstRow + r;
    let t = row / group;
    if (t >= step.tokens) { continue; }
    let h = kvh * group + row % group;
    let pair = i % pairs;
    if (params.splits == 1u) {
      let o = (t * params.heads + h) * params.headDim + 2u * pair;
      let v = acc[k] / rowSum[k];
      dst[o] = v.x;
      dst[o + 1u] = v.y;
    } else {
      let rec = ((t * params.heads + h) * stepSplits + s) * (params.headDim + 2u);
      if (pair == 0u) {
        dst[rec] = rowMax[k];
        dst[rec + 1u] = rowSum[k];
      }
      dst[rec + 2u + 2u * pair] = acc[k].x;
      dst[rec + 3u + 2u * pair] = acc[k].y;
    }
  }
}
`;
}

/**
 * The merge passes' params, bindings and splitChunk (attentionMergeSource and attentionMergeRowsSource take the same
 * ones, so one uniform and bind group layout serve both).
 */
function mergeBindingsWgsl(rotateOutput: boolean): string {
  return `struct Params { heads: u32, headDim: u32, splits: u32, minChunk: u32, firstMatrix: u32, headsPerMatrix: u32, splitRows: u32, _p1: u32 }
${KV_STEP_WGSL}

@group(0) @binding(0) var<storage, read> partials: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<uniform> step: KvStep;
@group(0) @binding(3) var<uniform> params: Params;
${rotateOutput ? '@group(0) @binding(4) var<storage, read> rotation: array<vec4<f32>>;' : ''}

${SPLIT_CHUNK_WGSL}`;
}

/** Most key splits the merge pass takes (its shared weight array). */
export const ATTENTION_MAX_SPLITS = 256;

/**
 * Merges the used splits' (ceil(length / chunk)) partial softmax results of one (head, query) into the output:
 * out = Σ_s e^(m_s − M)·acc_s / Σ_s e^(m_s − M)·l_s with M = max_s m_s. Empty splits carry m = −1e30, l = 0.
 * Everything waits on latency here (32 workgroups for a Qwen3-4B decode step), so: invocation s loads split s's
 * (m, l) once; the maximum and the total are tree reductions; the weighted sum is cut eight ways over the splits
 * (invocation (eighth, dim)), and an eighth's first 16 splits are loaded before the weights are known, so their
 * loads overlap the reductions. Measured slower when each step waited on the last: the loads of a serial merge
 * waited on each other (bench/results/2026-12-01-nvidia-h200-session13-profile-qwen3-q4_k_m-32k-int2-after.txt).
 *
 * With `rotateOutput` (decode graphs), the merged row is multiplied by Rᵀ of its head's matrix before it is stored
 * (the rotated cache's un-rotation, kernels/rotate.wgsl.ts's product, one dispatch a layer fewer):
 * out_j = Σ_i row_i · R[j][i], R = rotation[(firstMatrix + h / headsPerMatrix) · d² ..] row-major, by the rotate
 * kernel's prefetchedRowProductWgsl, whose matrix loads are issued at the start.
 *
 * The narrow build serves heads of up to 128 dims (invocation (eighth, e) holds dims e, e + 32, e + 64, e + 96); the
 * `wide` one up to ATTENTION_MAX_HEAD_DIM (8 dims an invocation, twice the registers and workgroup memory), whose
 * un-rotation takes rowProductWgsl, loading the matrix after the row (the prefetched registers hold 128 dims' share).
 */
export function attentionMergeSource(rotateOutput: boolean, wide = false): string {
  const range = (n: number) => Array.from({ length: n }, (_, i) => i);
  // Dims a build serves, and dims per invocation of an eighth.
  const maxDim = wide ? ATTENTION_MAX_HEAD_DIM : MERGE_NARROW_HEAD_DIM;
  const lanes = maxDim / 32;
  const sumOfEighths = (e: string) => {
    const at = (g: number) => (g === 0 ? `eighth[${e}]` : `eighth[${g * maxDim}u + ${e}]`);
    return `((${at(0)} + ${at(1)}) + (${at(2)} + ${at(3)})) + ((${at(4)} + ${at(5)}) + (${at(6)} + ${at(7)}))`;
  };
  // Each dim's merged value goes to the output, or, to be un-rotated, into `lane` (free by now) as the row.
  const merged = `for (var e = lid; e < params.headDim; e += WG) {
    let merged = (${sumOfEighths('e')}) / total;
    ${rotateOutput ? 'lane[e] = merged;' : 'out[(t * params.heads + h) * params.headDim + e] = merged;'}
  }`;
  const unrotate = prefetchedRowProductWgsl(true);
  const storeRow = (j: string, value: string) => `out[(t * params.heads + h) * d + ${j}] = ${value};`;
  const product = wide
    ? rowProductWgsl({ row: 'lane', matrix: 'rotation', base4: 'matrix4', transpose: 'true', store: storeRow })
    : unrotate.product('lane', storeRow);
  const store = rotateOutput
    ? `${merged}
  workgroupBarrier();
  ${product}`
    : merged;
  // The head's matrix is known from the start: its loads go out with the partials' (prefetchedRowProductWgsl).
  const prefetch = rotateOutput
    ? `let d = params.headDim;
  let matrix4 = (params.firstMatrix + h / params.headsPerMatrix) * d * d / 4u;${
    wide
      ? ''
      : `
  ${ROW_MATRIX_DECLARATION}
  ${unrotate.load('rotation', 'matrix4')}`
  }`
    : '';
  // A tree reduction of lane[0..WG) into lane[0] by `op`.
  const reduce = (op: (a: string, b: string) => string) => `for (var width = WG / 2u; width > 0u; width /= 2u) {
    if (lid < width) { lane[lid] = ${op('lane[lid]', 'lane[lid + width]')}; }
    workgroupBarrier();
  }`;
  return /* wgsl */ `
${mergeBindingsWgsl(rotateOutput)}
const WG: u32 = 256u; // >= ATTENTION_MAX_SPLITS: invocation s holds split s
const EIGHTHS: u32 = 8u;
var<workgroup> weight: array<f32, ${ATTENTION_MAX_SPLITS}>;
var<workgroup> lane: array<f32, WG>;
var<workgroup> eighth: array<f32, ${8 * maxDim}>; // [eighth][dim]
${rotateOutput ? `var<workgroup> partial: array<f32, ${ROW_PRODUCT_PARTIALS}>;` : ''}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let h = wg.x;
  let t = wg.y;
  if (t >= step.tokens) { return; }
  ${prefetch}
  let stepSplits = currentStepSplits();
  let chunk = splitChunk(step.length, stepSplits, params.minChunk);
  let splits = (step.length + chunk - 1u) / chunk;
  let rec = params.headDim + 2u;
  let base = (t * params.heads + h) * stepSplits * rec;
  // Eighth g takes splits g, g + 8, ...; invocation (g, e) dims e, e + 32, e + 64, ...
  let g = lid / 32u;
  let e = lid % 32u;
  var early: array<f32, ${16 * lanes}>; // [split u of the eighth's first 16][dim k]
${range(16)
  .map(
    (u) => `  if (g + ${8 * u}u < splits) {
    let at = base + (g + ${8 * u}u) * rec + 2u + e;
${range(lanes)
  .map((k) => `    if (e + ${32 * k}u < params.headDim) { early[${lanes * u + k}] = partials[at + ${32 * k}u]; }`)
  .join('\n')}
  }`,
  )
  .join('\n')}
  var m = -1e30;
  var l = 0.0;
  if (lid < splits) {
    m = partials[base + lid * rec];
    l = partials[base + lid * rec + 1u];
  }
  lane[lid] = m;
  workgroupBarrier();
  ${reduce((a, b) => `max(${a}, ${b})`)}
  let best = lane[0];
  workgroupBarrier();
  let w = select(0.0, exp(m - best), lid < splits);
  weight[lid] = w;
  lane[lid] = w * l;
  workgroupBarrier();
  ${reduce((a, b) => `${a} + ${b}`)}
  let total = lane[0];
  ${wide ? `var acc: array<f32, ${lanes}>;` : 'var acc = vec4<f32>(0.0);'}
${range(16)
  .map((u) =>
    wide
      ? range(lanes)
          .map((k) => `  acc[${k}] += weight[g + ${8 * u}u] * early[${lanes * u + k}];`)
          .join('\n')
      : `  acc += weight[g + ${8 * u}u] * vec4<f32>(early[${4 * u}], early[${4 * u + 1}], early[${4 * u + 2}], early[${4 * u + 3}]);`,
  )
  .join('\n')}
  for (var s = g + 128u; s < splits; s += EIGHTHS) {
    let at = base + s * rec + 2u + e;
    for (var k = 0u; k < ${lanes}u; k++) {
      if (e + 32u * k < params.headDim) { acc[k] += weight[s] * partials[at + 32u * k]; }
    }
  }
  for (var k = 0u; k < ${lanes}u; k++) {
    if (e + 32u * k < params.headDim) { eighth[g * ${maxDim}u + e + 32u * k] = acc[k]; }
  }
  workgroupBarrier();
  ${store}
}
`;
}

export const attentionMergeWgsl = attentionMergeSource(false);

/** Invocations of a workgroup of the rows merge: 128 / headDim rows of headDim invocations. */
const MERGE_ROWS_WG = 128;

/** Whether the rows merge serves a head size: whole rows to a workgroup. */
export function attentionMergeRowsSupports(headDim: number): boolean {
  return headDim <= MERGE_ROWS_WG && MERGE_ROWS_WG % headDim === 0;
}

/** Workgroups of the rows merge for `maxTokens` queries of `heads` heads. */
export function attentionMergeRowsWorkgroups(maxTokens: number, heads: number, headDim: number): number {
  return Math.ceil((maxTokens * heads) / (MERGE_ROWS_WG / headDim));
}

/**
 * The merge pass of prefill graphs: the same merge as attentionMergeSource (its params, bindings and partials), with
 * one invocation per output dim of 128 / headDim (token, head) rows a workgroup, which walks the step's used splits
 * itself (16 at most in a prefill graph): no reductions or barriers. attentionMergeSource's
 * workgroup of 256 per (head, query), built for the many splits of a decode step, measured slower on a prefill chunk's
 * many rows (bench/results/2026-12-01-nvidia-h200-session16-profile-llama-16k-*).
 */
export function attentionMergeRowsSource(): string {
  return /* wgsl */ `
${mergeBindingsWgsl(false)}
const WG: u32 = ${MERGE_ROWS_WG}u;

// Dim e of (token, head) row \`row\` = t · heads + h, merged over the step's used splits.
fn mergedValue(row: u32, e: u32) -> f32 {
  let stepSplits = currentStepSplits();
  let chunk = splitChunk(step.length, stepSplits, params.minChunk);
  let splits = (step.length + chunk - 1u) / chunk;
  let rec = params.headDim + 2u;
  let base = row * stepSplits * rec;
  var best = -1e30;
  for (var s = 0u; s < splits; s++) { best = max(best, partials[base + s * rec]); }
  var total = 0.0;
  var acc = 0.0;
  for (var s = 0u; s < splits; s++) {
    let at = base + s * rec;
    let w = exp(partials[at] - best);
    total += w * partials[at + 1u];
    acc += w * partials[at + 2u + e];
  }
  return acc / total;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let d = params.headDim;
  let row = wg.x * (WG / d) + lid / d; // t · heads + h
  if (row / params.heads < step.tokens) { out[row * d + lid % d] = mergedValue(row, lid % d); }
}
`;
}
