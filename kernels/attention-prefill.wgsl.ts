import { attentionBindingsWgsl, SPLIT_CHUNK_WGSL, splitTileWgsl } from './attention.wgsl.ts';
import { type DecodeQuantShape, quantGroupsFitHeads } from './attention-decode.wgsl.ts';
import { kvPagesReadableWgsl } from './kv-append.wgsl.ts';

/** What a prefill-attention build is specialized for. */
export interface AttentionPrefillShape {
  headDim: 64 | 128;
  /** Query rows (token, head of the GQA group) per workgroup: 16, 32 or 64. */
  rows: 16 | 32 | 64;
  /** Keys per tile: 16 or 32. */
  blockKeys: 16 | 32;
  /** Quant pages (pool mode 'quant') and their formats; null for an f16-only pool. */
  quant: DecodeQuantShape | null;
  /** A sliding-window layer's build (WindowedShape). */
  windowed?: boolean;
}

const WG = 256;
/** Invocations per row group: they share rows and split the tile's keys (scores) and the head's dims (values). */
const TC = 16;

/** vec4s per row of the q and K tiles in shared memory: one of padding, so a key's row starts at another bank. */
const paddedRow = (headDim: number) => headDim / 4 + 1;

/** Workgroup storage of a prefill build: q rows, the K and V tiles, the probabilities, the row reductions. */
export function attentionPrefillWorkgroupBytes(shape: Omit<AttentionPrefillShape, 'quant'>): number {
  const { headDim, rows, blockKeys } = shape;
  const vec4s = (rows + blockKeys) * paddedRow(headDim) + (blockKeys * headDim) / 4;
  return 16 * vec4s + 4 * (blockKeys * (rows + 1) + rows * (TC + 1));
}

/**
 * The largest build a device's workgroup storage holds, or null where none does (the split kernel serves the step).
 * More rows per workgroup read each K/V tile for more queries; at headDim 64, 64 rows need ~46 KiB (within a large
 * GPU's 48 KiB) and 32 rows fit the 32 KiB of CPU drivers; at headDim 128, 32 rows need ~37 KiB and 16 fit 32 KiB.
 * headDim 64 and 128 only (the models we serve); quant groups must lie inside a head or hold whole heads.
 */
export function attentionPrefillShape(
  headDim: number,
  quant: DecodeQuantShape | null,
  maxWorkgroupBytes: number,
): AttentionPrefillShape | null {
  if ((headDim !== 64 && headDim !== 128) || !quantGroupsFitHeads(headDim, quant)) return null;
  const candidates: Omit<AttentionPrefillShape, 'quant' | 'headDim'>[] =
    headDim === 64
      ? [
          { rows: 64, blockKeys: 32 },
          { rows: 32, blockKeys: 32 },
          { rows: 16, blockKeys: 16 },
        ]
      : [
          { rows: 32, blockKeys: 16 },
          { rows: 16, blockKeys: 16 },
        ];
  const fit = candidates.find((c) => attentionPrefillWorkgroupBytes({ headDim, ...c }) <= maxWorkgroupBytes);
  return fit ? { headDim, quant, ...fit } : null;
}

/**
 * Prefill attention (many query tokens) over the paged KV cache, flash-attention style: workgroup (split s, kv head,
 * row tile w) holds `rows` query rows of one KV head (the (token, head of the GQA group) pairs, group fastest, as the
 * split kernel orders them) and walks the split's keys in tiles of BK keys. Per tile:
 *   1. the tile's K and V rows are loaded as f32 into shared memory (f16 pages: one vec4 of words per invocation;
 *      quant pages: one code word per invocation, lo + code · scale, dequantizeRow's values);
 *   2. invocation (row group tr, column tc) scores its RT rows against keys tc, tc + 16, ... (a register tile), masks
 *      them causally and writes each row's partial maximum;
 *   3. it reads its rows' 16 partial maxima, rescales its running sums, and writes p = exp(score − max) of its own
 *      scores: each exponential is computed once;
 *   4. it accumulates p · V for its RT rows and its dims 4·(tc + 16·i)..+3 over the tile's keys.
 * The split kernel (attention.wgsl.ts) recomputed each exponential for every dim pair of a row and held 4 query
 * tokens per workgroup at headDim 64; this one does the arithmetic of a tile once, with 16–64 rows per K/V load.
 * Each invocation's row sums cover its own keys only; they are added through shared memory at the end. Output and
 * bindings as the split kernel: splits = 1 the normalized rows, else (max, sum, Σ p·V) per (t, h, s) for the merge.
 */
export function attentionPrefillSource(shape: AttentionPrefillShape): string {
  const { headDim: HD, rows: ROWS, blockKeys: BK, quant, windowed = false } = shape;
  const RT = ROWS / TC; // rows per invocation
  const KT = BK / TC; // keys per invocation in the scores
  const VQ = HD / 64; // vec4s of dims per invocation in the values
  const range = (n: number) => Array.from({ length: n }, (_, i) => i);
  const each = (n: number, f: (i: number) => string, sep = '\n') => range(n).map(f).join(sep);
  const rowsKeys = (f: (r: number, k: number) => string, sep = '\n') =>
    range(RT)
      .flatMap((r) => range(KT).map((k) => f(r, k)))
      .join(sep);
  const rowsDims = (f: (r: number, v: number) => string, sep = '\n') =>
    range(RT)
      .flatMap((r) => range(VQ).map((v) => f(r, v)))
      .join(sep);

  // A tile load is at most one item per invocation of each kind: f16 (key, 8 dims of K and V), quant K (key, code
  // word), quant V (key, code word).
  const kPer = quant ? 32 / quant.kBits : 32;
  const vPer = quant ? 32 / quant.vBits : 32;
  const f16Items = (BK * HD) / 8;
  if (f16Items > WG || (BK * HD) / kPer > WG || (BK * HD) / vPer > WG) {
    throw new Error(`attention-prefill: a tile of ${BK} keys at headDim ${HD} needs more than ${WG} loads`);
  }
  const quantFetch = (p: 'k' | 'v', per: number, flag: number) => `
  if (lid < BK * (HD / ${per}u)) {
    let j = lid / (HD / ${per}u);
    let w = lid % (HD / ${per}u);
    if (j < n) {
      let key = block + j;
      let entry = pageTable[step.tableOffset + key / params.pageTokens];
      if ((entry >> 28u) == 1u) {
        let slot = (entry >> 24u) & 0xfu;
        let row = (entry & 0xffffffu) * params.quantPageWords + params.quant${p.toUpperCase()}Offset +
          quantRow(key % params.pageTokens) * params.${p}RowWords;
        // A code word never straddles groups (groupSize is a multiple of 32 / bits).
        let e0 = quantRowStart(key % params.pageTokens) + kvh * HD + w * ${per}u;
        f.${p}Codes = slabWord(slot, row + e0 / ${per}u);
        f.${p}LoHi = slabWord(slot, row + params.${p}CodeWords + e0 / params.${p}Group);
        f.kind |= ${flag}u;
      }
    }
  }`;
  const quantStore = (p: 'k' | 'v', target: string, stride: string, per: number, flag: number) => `
  if ((f.kind & ${flag}u) != 0u) {
    let j = lid / (HD / ${per}u);
    let w = lid % (HD / ${per}u);
    let lohi = unpack2x16float(f.${p}LoHi);
    for (var c = 0u; c < ${per}u; c += 4u) {
      let code = vec4<f32>(f32((f.${p}Codes >> (c * ${32 / per}u)) & ${(1 << (32 / per)) - 1}u),
                           f32((f.${p}Codes >> ((c + 1u) * ${32 / per}u)) & ${(1 << (32 / per)) - 1}u),
                           f32((f.${p}Codes >> ((c + 2u) * ${32 / per}u)) & ${(1 << (32 / per)) - 1}u),
                           f32((f.${p}Codes >> ((c + 3u) * ${32 / per}u)) & ${(1 << (32 / per)) - 1}u));
      ${target}[j * ${stride} + (w * ${per}u + c) / 4u] = vec4<f32>(lohi.x) + code * lohi.y;
    }
  }`;

  return /* wgsl */ `
${attentionBindingsWgsl(quant !== null, windowed)}
${kvPagesReadableWgsl(5)}
${SPLIT_CHUNK_WGSL}

const WG: u32 = ${WG}u;
const HD: u32 = ${HD}u;
const H4: u32 = ${HD / 4}u; // vec4s of a head
const P4: u32 = ${paddedRow(HD)}u; // vec4s per row of qs and ks (padded)
const ROWS: u32 = ${ROWS}u;
const BK: u32 = ${BK}u;
const PT: u32 = ${ROWS + 1}u; // floats per key of pt (padded)
const RD: u32 = ${TC + 1}u; // floats per row of red (padded)
const NONE: f32 = -1e30;

var<workgroup> qs: array<vec4<f32>, ${ROWS * paddedRow(HD)}>;
var<workgroup> ks: array<vec4<f32>, ${BK * paddedRow(HD)}>;
var<workgroup> vs: array<vec4<f32>, ${(BK * HD) / 4}>;
var<workgroup> pt: array<f32, ${BK * (ROWS + 1)}>; // [key][row]
var<workgroup> red: array<f32, ${ROWS * (TC + 1)}>; // [row][column]: partial maxima, then partial sums

/**
 * One invocation's share of a tile's words (keys block..block+n-1 of the KV head), fetched into registers. kind: 1 f16
 * K/V words, 4 a quant K code word, 8 a quant V code word. Slots past n keep whatever the last tile left: their scores
 * are masked and the p·V loop stops at n.
 */
struct Fetched { k: vec4<u32>, v: vec4<u32>, kCodes: u32, kLoHi: u32, vCodes: u32, vLoHi: u32, kind: u32 }

fn fetchTile(block: u32, n: u32, kvh: u32, lid: u32) -> Fetched {
  var f: Fetched;
  if (lid < ${f16Items}u) {
    let j = lid / (HD / 8u);
    let c = lid % (HD / 8u);
    if (j < n) {
      let key = block + j;
      let entry = pageTable[step.tableOffset + key / params.pageTokens];
      if ((entry >> 28u) != 1u) {
        let slot = (entry >> 24u) & 0xfu;
        let at = (entry & 0xffffffu) * (params.pageWords / 4u) +
          (kvh * params.pageTokens + key % params.pageTokens) * (HD / 8u) + c;
        f.k = slabQuad(slot, params.kOffset / 4u + at);
        f.v = slabQuad(slot, params.vOffset / 4u + at);
        f.kind = 1u;
      }
    }
  }${quant ? quantFetch('k', kPer, 4) + quantFetch('v', vPer, 8) : ''}
  return f;
}

/** The fetched words into ks / vs as f32 (quant codes as lo + code · scale, dequantizeRow's values). */
fn storeTile(f: Fetched, lid: u32) {
  if ((f.kind & 1u) != 0u) {
    let j = lid / (HD / 8u);
    let c = lid % (HD / 8u);
    ks[j * P4 + 2u * c] = vec4<f32>(unpack2x16float(f.k.x), unpack2x16float(f.k.y));
    ks[j * P4 + 2u * c + 1u] = vec4<f32>(unpack2x16float(f.k.z), unpack2x16float(f.k.w));
    vs[j * H4 + 2u * c] = vec4<f32>(unpack2x16float(f.v.x), unpack2x16float(f.v.y));
    vs[j * H4 + 2u * c + 1u] = vec4<f32>(unpack2x16float(f.v.z), unpack2x16float(f.v.w));
  }${quant ? quantStore('k', 'ks', 'P4', kPer, 4) + quantStore('v', 'vs', 'H4', vPer, 8) : ''}
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
${splitTileWgsl('ROWS', windowed)}

  for (var i = lid; i < ROWS * H4; i += WG) {
    let row = firstRow + i / H4;
    let t = row / group;
    var v = vec4<f32>(0.0);
    if (t < step.tokens) {
      let at = (t * params.heads + kvh * group + row % group) * HD + 4u * (i % H4);
      v = vec4<f32>(q[at], q[at + 1u], q[at + 2u], q[at + 3u]) * params.scale;
    }
    qs[(i / H4) * P4 + i % H4] = v;
  }

  let tr = lid / ${TC}u;
  let tc = lid % ${TC}u;
  let r0 = tr * ${RT}u; // first own row of the tile
${
  windowed
    ? `  // Keys from first_r and before limit_r are visible to own row r (its window, causal); a row past the step's tokens
  // sees none.`
    : "  // Keys before limit_r are visible to own row r (causal); a row past the step's tokens sees none."
}
${each(
  RT,
  (r) => `  let t${r} = (firstRow + r0 + ${r}u) / group;
  let limit${r} = select(0u, step.position + t${r} + 1u, t${r} < step.tokens);${
    windowed ? `\n  let first${r} = windowStart(step.position + t${r});` : ''
  }
  var m${r} = NONE;
  var l${r} = 0.0;`,
)}
${rowsDims((r, v) => `  var acc${r}_${v} = vec4<f32>(0.0);`)}

  var fetched = fetchTile(start, select(0u, min(BK, end - start), start < end), kvh, lid);
  for (var block = start; block < end; block += BK) {
    let n = min(BK, end - block);
    // The previous tile's readers are done with ks, vs and pt.
    workgroupBarrier();
    storeTile(fetched, lid);
    workgroupBarrier();
    // The next tile's words load while this one is computed (measured faster in every case on a large GPU:
    // bench/results/2026-11-30-nvidia-h200-session9-prefill-variants-{f16,int2}.json).
    if (block + BK < end) { fetched = fetchTile(block + BK, min(BK, end - block - BK), kvh, lid); }
${rowsKeys((r, k) => `    var s${r}_${k} = 0.0;`)}
    for (var c = 0u; c < H4; c++) {
${each(KT, (k) => `      let k${k} = ks[(tc + ${TC * k}u) * P4 + c];`)}
${each(RT, (r) => `      let q${r} = qs[(r0 + ${r}u) * P4 + c];`)}
${rowsKeys((r, k) => `      s${r}_${k} += dot(q${r}, k${k});`)}
    }
${each(
  RT,
  (r) => `    {
${each(
  KT,
  (k) =>
    `      if (tc + ${TC * k}u >= n || block + tc + ${TC * k}u >= limit${r}${windowed ? ` || block + tc + ${TC * k}u < first${r}` : ''}) { s${r}_${k} = NONE; }`,
)}
      red[(r0 + ${r}u) * RD + tc] = ${range(KT).reduce((acc, k) => (acc ? `max(${acc}, s${r}_${k})` : `s${r}_${k}`), '')};
    }`,
)}
    workgroupBarrier();
${each(
  RT,
  (r) => `    {
      var best = m${r};
      for (var i = 0u; i < ${TC}u; i++) { best = max(best, red[(r0 + ${r}u) * RD + i]); }
      let correction = select(1.0, exp(m${r} - best), m${r} > NONE);
      m${r} = best;
${each(
  KT,
  (k) => `      let p${k} = select(0.0, exp(s${r}_${k} - best), s${r}_${k} > NONE);
      pt[(tc + ${TC * k}u) * PT + r0 + ${r}u] = p${k};`,
)}
      l${r} = l${r} * correction + ${range(KT)
        .map((k) => `p${k}`)
        .join(' + ')};
${each(VQ, (v) => `      acc${r}_${v} *= correction;`)}
    }`,
)}
    workgroupBarrier();
    for (var j = 0u; j < n; j++) {
${each(RT, (r) => `      let p${r} = pt[j * PT + r0 + ${r}u];`)}
${each(VQ, (v) => `      let v${v} = vs[j * H4 + tc + ${TC * v}u];`)}
${rowsDims((r, v) => `      acc${r}_${v} += p${r} * v${v};`)}
    }
  }

  // Each invocation's sums cover its own keys: add the row's 16 of them.
  workgroupBarrier();
${each(RT, (r) => `  red[(r0 + ${r}u) * RD + tc] = l${r};`)}
  workgroupBarrier();
${each(
  RT,
  (r) => `  {
    let row = firstRow + r0 + ${r}u;
    if (t${r} < step.tokens) {
      var total = 0.0;
      for (var i = 0u; i < ${TC}u; i++) { total += red[(r0 + ${r}u) * RD + i]; }
      let h = kvh * group + row % group;
      if (params.splits == 1u) {
        let o = (t${r} * params.heads + h) * HD;
${each(VQ, (v) => `        store4(o + 4u * (tc + ${TC * v}u), acc${r}_${v} / total);`)}
      } else {
        let rec = ((t${r} * params.heads + h) * stepSplits + s) * (HD + 2u);
        if (tc == 0u) {
          dst[rec] = m${r};
          dst[rec + 1u] = total;
        }
${each(VQ, (v) => `        store4(rec + 2u + 4u * (tc + ${TC * v}u), acc${r}_${v});`)}
      }
    }
  }`,
)}
}

fn store4(at: u32, v: vec4<f32>) {
  dst[at] = v.x;
  dst[at + 1u] = v.y;
  dst[at + 2u] = v.z;
  dst[at + 3u] = v.w;
}
`;
}
