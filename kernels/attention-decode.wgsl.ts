import {
  ATTENTION_MAX_ROW_PAIRS,
  ATTENTION_MAX_ROWS,
  attentionBindingsWgsl,
  SPLIT_CHUNK_WGSL,
} from './attention.wgsl.ts';
import { kvPagesReadableWgsl } from './kv-append.wgsl.ts';

/** The quantized row formats a decode build reads (kernels/kv-demote.ts KvRowFormat, bits and group only). */
export interface DecodeQuantShape {
  kBits: 1 | 2 | 4;
  kGroup: number;
  vBits: 1 | 2 | 4;
  vGroup: number;
  /** Consecutive positions per stored row (quant-format's positionsPerRow; 1 unless a group is wider than a row). */
  rowTokens: number;
}

/** What a decode-attention build is specialized for: one query token, the GQA group's rows of one KV head. */
export interface AttentionDecodeShape {
  headDim: number;
  /** Query heads per KV head (the GQA group). */
  rows: number;
  /** Quant pages (pool mode 'quant') and their formats; null for an f16-only pool. */
  quant: DecodeQuantShape | null;
  /**
   * Loops over a key's dims with constant bounds, which a GPU compiler unrolls (true), or with bounds it only knows at
   * run time (false): CPU drivers unroll them too, and lavapipe compiled the unrolled build several times slower (the
   * decode kernel tests' run time there). Same arithmetic either way. The runtime builds loops everywhere
   * (attentionDecodeShape: faster on large GPUs too,
   * bench/results/2026-12-01-nvidia-h200-session13-attention-decode-int2-raw-unrolled.json); the unrolled build is
   * kept for bench/attention-kernels.ts to compare.
   */
  unrolled: boolean;
  /** Keys per pass of the split loop: attentionDecodePassKeys, or 128 where 256 would not fit the device. */
  passKeys: 128 | 256;
  /** A sliding-window layer's build (WindowedShape). */
  windowed?: boolean;
}

const WG = 128;

/** Invocations per row group that reduce a pass's scores to its maxima. */
const REDUCERS = 32;

/**
 * Keys per pass the decode kernel prefers: 256 where the pass's scores (a vec4 per 4 rows and key) and its per-key
 * words (the page entry; a quant build's staged V words) each fit 8 KiB of workgroup memory, else 128. Qwen3-4B's
 * staged build (head size 128) in passes of 256 ran slower than the unstaged one below 128K, in passes of 128 faster
 * at every context; head size 64 was fastest in passes of 256
 * (bench/results/2026-12-04-nvidia-h200-attention-decode-staged-sub128.json).
 */
export function attentionDecodePassKeys(shape: Pick<AttentionDecodeShape, 'headDim' | 'rows' | 'quant'>): 128 | 256 {
  return Math.ceil(shape.rows / 4) * 256 * 16 <= 8192 && 256 * 4 * wordsPerPassKey(shape) <= 8192 ? 256 : 128;
}

/**
 * Workgroup storage of a decode build, as its WGSL declares it: q rows, the pass's scores, the reductions, the running
 * maxima, Σq per quant group, the combine's sums (SPR = SUB / HD slices), the pass's page-table entries and (quant
 * builds) its staged V words.
 */
export function attentionDecodeWorkgroupBytes(shape: AttentionDecodeShape): number {
  const { headDim, rows, quant } = shape;
  const sub = shape.passKeys;
  const rowGroups = Math.ceil(rows / 4);
  const groupsPerHead = quant ? headDim / Math.min(quant.kGroup, headDim) : 0;
  const vec4s = rowGroups * (headDim + sub + REDUCERS + 2 + groupsPerHead + sub / headDim);
  return 16 * vec4s + 4 * sub * wordsPerPassKey(shape);
}

/**
 * Words a build keeps per key of a pass: its page-table entry and, in a quant build, the head's staged V code words
 * and its groups' (lo, scale) words.
 */
function wordsPerPassKey({ headDim, quant }: Pick<AttentionDecodeShape, 'headDim' | 'quant'>): number {
  return 1 + (quant ? headDim / (32 / quant.vBits) + Math.max(1, headDim / quant.vGroup) : 0);
}

/**
 * Whether the decode kernel serves a shape; otherwise decode uses the general split kernel. headDim must give whole
 * code words per head for every bit width (a multiple of 32) and dim pairs that divide the workgroup; a group must
 * lie inside one head or hold whole heads.
 */
export function attentionDecodeSupports(shape: AttentionDecodeShape): boolean {
  const { headDim, rows, quant } = shape;
  if (![32, 64, 128].includes(headDim) || rows < 1 || rows > ATTENTION_MAX_ROWS) return false;
  if ((rows * headDim) / 2 > ATTENTION_MAX_ROW_PAIRS) return false;
  return quantGroupsFitHeads(headDim, quant);
}

/** Whether each quant group lies inside one head or holds whole heads (true for an f16-only pool). */
export function quantGroupsFitHeads(headDim: number, quant: DecodeQuantShape | null): boolean {
  if (quant === null) return true;
  const fits = (group: number) => headDim % group === 0 || group % headDim === 0;
  return fits(quant.kGroup) && fits(quant.vGroup);
}

/**
 * Decode attention (one query token) over the paged KV cache, split pass of flash decoding: workgroup (split s, kv
 * head) walks the split's keys in passes of SUB keys. The GQA group's rows are packed 4 to a vec4 ("row groups"), so
 * one multiply-add serves 4 rows and the code does not grow with the group. A pass has three phases:
 *   A. scores: each invocation takes whole keys and scores them against every row, reading the key straight from its
 *      page (f16 words; for a quant page its code words: q·k = lo·Σq + scale·Σ q_i·c_i per group, Σq precomputed);
 *      for a quant key it also copies the head's V code and (lo, scale) words into workgroup memory, so a key's
 *      page is read by one chain of loads (phase C reading its own was 1.2-1.6× slower at 128K on the H200:
 *      bench/results/2026-12-04-nvidia-h200-attention-decode-staged.json);
 *   B. the pass's row maxima (a two-level reduction), the running maxima, and p = exp(score − max) in place;
 *   C. values: invocation (slice, part) accumulates p·v over every KS-th key for all rows and 2·WPT dims, reading
 *      one vec4 of f16 words per key from its page, several keys' loads at a time (or a quant key's staged code word
 *      and its group's lo/scale).
 * There is no tile loop: the keys of a pass are read by independent loads, a few barriers per SUB keys. The key
 * slices are summed through shared memory at the end. Output as the split kernel's (attentionPartialSource):
 * splits = 1 the normalized rows, else (max, sum, Σ p·V) per (head, split) for the merge pass. Params and bindings
 * are the split kernel's, so one uniform buffer and bind group layout serve both.
 */
export function attentionDecodeSource(shape: AttentionDecodeShape): string {
  if (!attentionDecodeSupports(shape)) throw new Error(`attention-decode: unsupported shape ${JSON.stringify(shape)}`);
  const { headDim: HD, rows: ROWS, quant, windowed = false } = shape;
  const RG = Math.ceil(ROWS / 4);
  const PAIRS = HD / 2;
  // Phase C: an invocation owns WPT consecutive V words (2·WPT dims) of every row: one vec4 load per key with WPT 4
  // (a lone word per invocation made each load fetch 16 bytes to use 4), 2 where 4 row groups need the registers.
  const WPT = RG <= 2 ? 4 : 2;
  const DIMS = 2 * WPT;
  const TPK = PAIRS / WPT; // invocations per key
  const KS = WG / TPK; // key slices
  // Keys whose values are loaded before any is used. A quant build with one row group takes one key at a time: it
  // holds both page kinds' value code, and the registers a batch holds across its loads cost it occupancy (measured
  // faster with one key: bench/results/2026-11-30-nvidia-h200-session10-attention-int2-batch{,1}.json; f16 builds did
  // not gain from smaller batches).
  const BATCH = quant && RG === 1 ? 1 : WPT === 4 ? 4 : 8;
  const SUB = shape.passKeys;
  const range = (n: number) => Array.from({ length: n }, (_, i) => i);
  const groups = (f: (g: number) => string, sep = '\n') => range(RG).map(f).join(sep);
  const kGE = quant ? Math.min(quant.kGroup, HD) : 0;
  // A group's K code words come in whole vec4s (2-bit codes at headDim 64 or 128; 4-bit).
  const kQuads = quant !== null && (kGE / (32 / quant.kBits)) % 4 === 0;

  // Adds dims d..d+7 of a key (k0 = dims d..d+3, k1 = d+4..d+7), times the rows' q, to `${to}0`, `${to}1`, ...
  const addDims = (d: string, to: string) =>
    groups(
      (g) =>
        `${to}${g} += qt[(${d}) * RG + ${g}u] * k0.x + qt[(${d} + 1u) * RG + ${g}u] * k0.y + qt[(${d} + 2u) * RG + ${g}u] * k0.z + qt[(${d} + 3u) * RG + ${g}u] * k0.w +
             qt[(${d} + 4u) * RG + ${g}u] * k1.x + qt[(${d} + 5u) * RG + ${g}u] * k1.y + qt[(${d} + 6u) * RG + ${g}u] * k1.z + qt[(${d} + 7u) * RG + ${g}u] * k1.w;`,
      '\n          ',
    );
  const f16Score = `let base = (entry & 0xffffffu) * (params.pageWords / 4u) + (params.kOffset + headBase + inPage * PAIRS) / 4u;
        for (var c = 0u; c < (HD / 8u) * one; c++) {
          let w = slabQuad(slot, base + c);
          let k0 = vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
          let k1 = vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w));
          ${addDims('8u * c', 's')}
        }`;
  // A code word holds K_PER codes; 8 at a time become k0, k1 (dims d..d+7 of the head).
  const quantScore = `let row = (entry & 0xffffffu) * params.quantPageWords + params.quantKOffset + (inPage / ROW_TOKENS) * params.kRowWords;
        for (var g = 0u; g < (HD / K_GE) * one; g++) {
          let e0 = (inPage % ROW_TOKENS) * params.kvHeads * HD + kvh * HD + g * K_GE;
          let lohi = unpack2x16float(slabWord(slot, row + params.kCodeWords + e0 / K_GROUP));
${groups((g) => `          var d${g} = vec4<f32>(0.0);`)}
          ${
            kQuads
              ? `// The group's code words four at a time: one vec4 load where the row is 16-byte aligned.
          for (var wq = 0u; wq < (K_GE / K_PER / 4u) * one; wq++) {
            let at = row + e0 / K_PER + 4u * wq;
            var quad: vec4<u32>;
            if ((at & 3u) == 0u) {
              quad = slabQuad(slot, at / 4u);
            } else {
              quad = vec4<u32>(slabWord(slot, at), slabWord(slot, at + 1u), slabWord(slot, at + 2u), slabWord(slot, at + 3u));
            }
            for (var wj = 0u; wj < 4u; wj++) {
            let wi = 4u * wq + wj;
            let codes = quad[wj];`
              : `for (var wi = 0u; wi < (K_GE / K_PER) * one; wi++) {
            let codes = slabWord(slot, row + e0 / K_PER + wi);`
          }
            for (var c = 0u; c < K_PER * one; c += 8u) {
              let k0 = vec4<f32>(f32((codes >> (c * K_BITS)) & K_MASK), f32((codes >> ((c + 1u) * K_BITS)) & K_MASK),
                                 f32((codes >> ((c + 2u) * K_BITS)) & K_MASK), f32((codes >> ((c + 3u) * K_BITS)) & K_MASK));
              let k1 = vec4<f32>(f32((codes >> ((c + 4u) * K_BITS)) & K_MASK), f32((codes >> ((c + 5u) * K_BITS)) & K_MASK),
                                 f32((codes >> ((c + 6u) * K_BITS)) & K_MASK), f32((codes >> ((c + 7u) * K_BITS)) & K_MASK));
              let dd = g * K_GE + wi * K_PER + c;
              ${addDims('dd', 'd')}
            }
          }${kQuads ? '\n          }' : ''}
${groups((g) => `          s${g} += lohi.x * qsum[g * RG + ${g}u] + lohi.y * d${g};`)}
        }`;
  // The invocation's V words of a key: WPT words from word w0 (a multiple of WPT) of the row.
  const f16Value =
    WPT === 4
      ? `{
          let q4 = slabQuad(slot, ((entry & 0xffffffu) * params.pageWords + params.vOffset + headBase + inPage * PAIRS) / 4u + part);
          vals[2u * u] = vec4<f32>(unpack2x16float(q4.x), unpack2x16float(q4.y));
          vals[2u * u + 1u] = vec4<f32>(unpack2x16float(q4.z), unpack2x16float(q4.w));
        }`
      : `{
          let w0 = (entry & 0xffffffu) * params.pageWords + params.vOffset + headBase + inPage * PAIRS + part * 2u;
          let q4 = slabQuad(slot, w0 / 4u);
          let h = select(q4.xy, q4.zw, (w0 & 2u) != 0u);
          vals[u] = vec4<f32>(unpack2x16float(h.x), unpack2x16float(h.y));
        }`;
  // Phase A's copy of a quant key's V words: the head's code words from the first of its row (a multiple of a word:
  // headDim is a multiple of 32), four at a time where 16-byte aligned, then its groups' (lo, scale) words.
  const stageValue = `
        {
          let vrow = (entry & 0xffffffu) * params.quantPageWords + params.quantVOffset + (inPage / ROW_TOKENS) * params.vRowWords;
          let v0 = (inPage % ROW_TOKENS) * params.kvHeads * HD + kvh * HD;
          let at = vrow + v0 / V_PER;
          if (V_WH % 4u == 0u && (at & 3u) == 0u) {
            for (var w = 0u; w < V_WH; w += 4u) {
              let quad = slabQuad(slot, at / 4u + w / 4u);
              vStage[j * V_WH + w] = quad.x; vStage[j * V_WH + w + 1u] = quad.y;
              vStage[j * V_WH + w + 2u] = quad.z; vStage[j * V_WH + w + 3u] = quad.w;
            }
          } else {
            for (var w = 0u; w < V_WH; w++) { vStage[j * V_WH + w] = slabWord(slot, at + w); }
          }
          for (var g = 0u; g < V_GH; g++) {
            vStageLoHi[j * V_GH + g] = slabWord(slot, vrow + params.vCodeWords + v0 / V_GROUP + g);
          }
        }`;
  // The invocation's 2·WPT values lie in one code word and one group (a group is a multiple of a word's codes, >= 8),
  // read from the pass's staged words.
  const quantValue = `{
          let codes = vStage[jk * V_WH + (part * DIMS) / V_PER] >> (((part * DIMS) % V_PER) * V_BITS);
          let lohi = unpack2x16float(vStageLoHi[jk * V_GH + (part * DIMS) / V_GE]);
          for (var i = 0u; i < DIMS / 4u; i++) {
            let c = codes >> (4u * i * V_BITS);
            vals[(DIMS / 4u) * u + i] = vec4<f32>(lohi.x) + lohi.y * vec4<f32>(f32(c & V_MASK), f32((c >> V_BITS) & V_MASK),
              f32((c >> (2u * V_BITS)) & V_MASK), f32((c >> (3u * V_BITS)) & V_MASK));
          }
        }`;
  const dims = (f: (g: number, e: number) => string, sep = ' ') =>
    range(RG)
      .flatMap((g) => range(DIMS).map((e) => f(g, e)))
      .join(sep);

  return /* wgsl */ `
${attentionBindingsWgsl(quant !== null, windowed)}
${kvPagesReadableWgsl(5)}
${SPLIT_CHUNK_WGSL}

const WG: u32 = ${WG}u;
const HD: u32 = ${HD}u;
const PAIRS: u32 = ${PAIRS}u;
const ROWS: u32 = ${ROWS}u;
const RG: u32 = ${RG}u; // row groups: rows 4g..4g+3 are the components of one vec4
const SUB: u32 = ${SUB}u; // keys per pass
const WPT: u32 = ${WPT}u; // V words per invocation in phase C
const DIMS: u32 = ${DIMS}u; // ... its dims
const TPK: u32 = ${TPK}u; // invocations per key in phase C
const KS: u32 = ${KS}u; // key slices of phase C (WG / TPK)
const BATCH: u32 = ${BATCH}u; // keys loaded before use in phase C
// Key slices summed per round at the end: sc holds SUB·RG vec4s, one slice's accumulators HD·RG.
const SPR: u32 = SUB / HD;
const RS: u32 = ${REDUCERS}u; // reducers per row group in phase B
const NONE: f32 = -1e30;
${
  quant
    ? `const K_BITS: u32 = ${quant.kBits}u;
const K_MASK: u32 = ${(1 << quant.kBits) - 1}u;
const K_PER: u32 = ${32 / quant.kBits}u; // codes per word
const K_GROUP: u32 = ${quant.kGroup}u;
const K_GE: u32 = ${kGE}u; // elements of a head in one group
const V_BITS: u32 = ${quant.vBits}u;
const V_MASK: u32 = ${(1 << quant.vBits) - 1}u;
const V_PER: u32 = ${32 / quant.vBits}u;
const V_GROUP: u32 = ${quant.vGroup}u;
const ROW_TOKENS: u32 = ${quant.rowTokens}u; // positions per stored row
var<workgroup> qsum: array<vec4<f32>, ${RG * (HD / kGE)}>; // [group of the head][row group]: Σ of scaled q
const V_WH: u32 = ${HD / (32 / quant.vBits)}u; // V code words of a head
const V_GH: u32 = ${Math.max(1, HD / quant.vGroup)}u; // ... and its groups' (lo, scale) words
const V_GE: u32 = ${Math.min(quant.vGroup, HD)}u; // elements of a head in one V group
// The pass's quant keys' V words of this head ([key][word]), copied by phase A for phase C.
var<workgroup> vStage: array<u32, SUB * V_WH>;
var<workgroup> vStageLoHi: array<u32, SUB * V_GH>;`
    : ''
}

var<workgroup> qt: array<vec4<f32>, ${HD * RG}>; // [dim][row group]: the scaled query rows, transposed
// Scores, then p, of the pass ([key][row group]); at the end, one key slice's accumulators.
var<workgroup> sc: array<vec4<f32>, SUB * RG>;
var<workgroup> red: array<vec4<f32>, ${REDUCERS * RG}>;
var<workgroup> runMax: array<vec4<f32>, RG>; // running max before the pass
var<workgroup> newMax: array<vec4<f32>, RG>; // ... and after it
var<workgroup> combSum: array<vec4<f32>, SPR * RG>;
// The page-table entry of each key of the pass (phase A loads them; phase C reads them here instead of from the
// table, one dependent global load less per key).
var<workgroup> entries: array<u32, SUB>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let s = wg.x;
  let kvh = wg.y;
  if (step.tokens == 0u) { return; }
  let chunk = splitChunk(step.length, params.splits, params.minChunk);
${
  windowed
    ? `  let splitStart = s * chunk;
  if (splitStart >= step.length && s > 0u) { return; }
  // A sliding-window layer's keys before the window are left out (a split they fill writes an empty record).
  let start = max(splitStart, windowStart(step.position));
  let end = min(splitStart + chunk, step.position + 1u);`
    : `  let start = s * chunk;
  if (start >= step.length && s > 0u) { return; }
  let end = min(start + chunk, step.position + 1u);`
}
  let headBase = kvh * params.pageTokens * PAIRS;
  // The key loops run to constant bounds times one: ${shape.unrolled ? 'the constant 1 (unrolled)' : 'params.headDim / HD = 1, unknown to the compiler (kept as loops)'}.
  let one = ${shape.unrolled ? '1u' : 'params.headDim / HD'};

  for (var i = lid; i < HD * RG; i += WG) {
    let d = i / RG;
    let r0 = 4u * (i % RG);
    var v = vec4<f32>(0.0);
    for (var c = 0u; c < 4u; c++) {
      if (r0 + c < ROWS) { v[c] = q[(kvh * ROWS + r0 + c) * HD + d] * params.scale; }
    }
    qt[i] = v;
  }
  if (lid < RG) { runMax[lid] = vec4<f32>(NONE); }
  workgroupBarrier();${
    quant
      ? `
  if (lid < RG * (HD / K_GE)) {
    var total = vec4<f32>(0.0);
    for (var d = (lid / RG) * K_GE; d < (lid / RG + 1u) * K_GE; d++) { total += qt[d * RG + lid % RG]; }
    qsum[lid] = total;
  }
  workgroupBarrier();`
      : ''
  }

  let slice = lid / TPK;
  let part = lid % TPK; // V words part·WPT.. of the row, dims part·DIMS..
  // acc{g}_{e}: dim part·DIMS + e of rows 4g..4g+3.
${groups((g) => `  var sum${g} = vec4<f32>(0.0);`)}
  ${dims((g, e) => `var acc${g}_${e} = vec4<f32>(0.0);`)}
  for (var block = start; block < end; block += SUB) {
    let n = min(SUB, end - block);
    // A: scores of whole keys.
    for (var j = lid; j < SUB; j += WG) {
${groups((g) => `      var s${g} = vec4<f32>(NONE);`)}
      if (j < n) {
        let key = block + j;
        let entry = pageTable[step.tableOffset + key / params.pageTokens];
        entries[j] = entry;
        let inPage = key % params.pageTokens;
        let slot = (entry >> 24u) & 0xfu;
${groups((g) => `        s${g} = vec4<f32>(0.0);`)}
        ${quant ? `if ((entry >> 28u) == 1u) {\n        ${quantScore}${stageValue}\n        } else {\n        ${f16Score}\n        }` : f16Score}
      }
${groups((g) => `      sc[j * RG + ${g}u] = s${g};`)}
    }
    workgroupBarrier();
    // B: the pass's maxima, the running maxima, and p in place.
    if (lid < RS * RG) {
      let g = lid % RG;
      var m = vec4<f32>(NONE);
      for (var j = lid / RG; j < n; j += RS) { m = max(m, sc[j * RG + g]); }
      red[lid] = m;
    }
    workgroupBarrier();
    if (lid < RG) {
      var m = runMax[lid];
      for (var i = 0u; i < RS; i++) { m = max(m, red[i * RG + lid]); }
      newMax[lid] = m;
    }
    workgroupBarrier();
    for (var i = lid; i < SUB * RG; i += WG) {
      let x = sc[i];
      sc[i] = select(vec4<f32>(0.0), exp(x - newMax[i % RG]), x > vec4<f32>(NONE));
    }
    workgroupBarrier();
    // C: values, every KS-th key per slice, all rows at once. BATCH keys' values are loaded before any is used, so
    // their loads are in flight together.
${groups(
  (g) => `    {
      let c = select(vec4<f32>(0.0), exp(runMax[${g}u] - newMax[${g}u]), runMax[${g}u] > vec4<f32>(NONE));
      sum${g} *= c; ${range(DIMS)
        .map((e) => `acc${g}_${e} *= c;`)
        .join(' ')}
    }`,
)}
    for (var jb = slice; jb < n; jb += BATCH * KS) {
      var vals: array<vec4<f32>, ${(BATCH * DIMS) / 4}>; // [key of the batch][DIMS / 4]
      for (var u = 0u; u < BATCH; u++) {
        let jk = min(jb + u * KS, n - 1u); // past n: a valid key, weighted 0 below
        let key = block + jk;
        let entry = entries[jk];
        let inPage = key % params.pageTokens;
        let slot = (entry >> 24u) & 0xfu;
        ${quant ? `if ((entry >> 28u) == 1u) ${quantValue} else ${f16Value}` : f16Value}
      }
      for (var u = 0u; u < BATCH; u++) {
        let j = jb + u * KS;
        if (j >= n) { break; }
${groups(
  (g) => `        {
          let p = sc[j * RG + ${g}u];
          sum${g} += p;
          ${range(DIMS)
            .map((e) => `acc${g}_${e} += p * vals[(DIMS / 4u) * u + ${e >> 2}u][${e & 3}u];`)
            .join('\n          ')}
        }`,
)}
      }
    }
    workgroupBarrier();
    if (lid < RG) { runMax[lid] = newMax[lid]; }
  }

  // Sum the key slices into slice 0, SPR slices a round: slice 1 + SPR·r + i writes its accumulators at
  // sc[(i·HD + dim)·RG + g] and its sums at combSum[i·RG + g].
  for (var first = 1u; first < KS; first += SPR) {
    workgroupBarrier();
    if (slice >= first && slice < first + SPR) {
      let at = (slice - first) * HD + part * DIMS;
${groups(
  (g) =>
    `      ${range(DIMS)
      .map((e) => `sc[(at + ${e}u) * RG + ${g}u] = acc${g}_${e};`)
      .join(' ')}`,
)}
      if (part == 0u) {
${groups((g) => `        combSum[(slice - first) * RG + ${g}u] = sum${g};`)}
      }
    }
    workgroupBarrier();
    if (slice == 0u) {
      for (var i = 0u; i < min(SPR, KS - first); i++) {
        let at = i * HD + part * DIMS;
${groups(
  (g) =>
    `        sum${g} += combSum[i * RG + ${g}u];\n        ${range(DIMS)
      .map((e) => `acc${g}_${e} += sc[(at + ${e}u) * RG + ${g}u];`)
      .join(' ')}`,
)}
      }
    }
  }
  workgroupBarrier();
  if (slice == 0u) {
${groups(
  (g) => `    for (var c = 0u; c < 4u; c++) {
      let r = ${4 * g}u + c;
      if (r >= ROWS) { break; }
      let h = kvh * ROWS + r;
      let out = array<f32, ${DIMS}>(${range(DIMS)
        .map((e) => `acc${g}_${e}[c]`)
        .join(', ')});
      if (params.splits == 1u) {
        for (var e = 0u; e < DIMS; e++) { dst[h * HD + part * DIMS + e] = out[e] / sum${g}[c]; }
      } else {
        let rec = (h * params.splits + s) * (HD + 2u);
        if (part == 0u) {
          dst[rec] = runMax[${g}u][c];
          dst[rec + 1u] = sum${g}[c];
        }
        for (var e = 0u; e < DIMS; e++) { dst[rec + 2u + part * DIMS + e] = out[e]; }
      }
    }`,
)}
  }
}
`;
}
