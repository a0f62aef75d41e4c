/**
 * Prefill attention on 8-bit tensor cores (Dawn's experimental subgroup matrices, i8 x i8 -> i32 at 16x16x32; see
 * matmul-int8.wgsl.ts): the flash-attention loop of attention-prefill.wgsl.ts with both of its products, q·k and p·v,
 * as integer matrix products. What each operand is quantized against (every scale is constant along the sum it
 * enters, so an integer sum needs one scale per output):
 *   - q: per query row, over the head's dims (d_q = max|q·scale| / 127), once per workgroup;
 *   - k: per key, over the head's dims (d_k), as the key tile is staged: s = d_q·d_k·Σ q_c·k_c;
 *   - v: per key too (d_v); its scale goes into the probabilities instead of the codes: Σ_j p_j·v_j =
 *     Σ_j (p_j·d_v,j)·c_j, and w_j = p_j·d_v,j is quantized per row of the tile (d_w = max_j w_j / 127), so an
 *     output dim takes d_w·Σ_j c(w_j)·c(v_j) with one scale per row.
 * The row sums l take the unquantized p. Per-tile scales keep each tile's weights on its own 127 steps: a tile far
 * below the row's maximum is not rounded to zero wholesale.
 *
 * Workgroup (split s, kv head, row tile): 4 subgroups of 32 invocations and 64 query rows (the (token, head of the
 * GQA group) pairs, as the other attention kernels order them); subgroup g owns rows 16g..16g+15 of both products,
 * and its lanes 2m, 2m + 1 own row (or key) 16g + m when staging and in the softmax. Per tile of 64 keys:
 *   1. stage the keys' K and V as int8 codes and scales in workgroup memory: the converted build (the default)
 *      copies them from the int8 keys buffer a conversion pass filled for the whole step (attentionKeysInt8Source),
 *      the other converts them from the pages (f16 words, or quant codes as lo + code·scale);
 *   2. S = Q·Kᵀ into workgroup memory (16x16 tiles, the head's dims 32 at a time; the converted build 32 keys at a
 *      time, each half's scores read into registers before the next);
 *   3. the row's maxima, correction, p, l, and the codes of w into workgroup memory;
 *   4. P·V through workgroup memory, 4 dim tiles per subgroup per round (the converted build 2), each lane adding its
 *      8 outputs per tile to f32 accumulators (rescaled by the correction).
 * The converted build is compact: S in halves, q's and then p's codes in the K tile's words (free once S is made), and
 * at head size 128 V's tile in two halves of its dims (splitValues). It takes 24,064 bytes of workgroup memory at head
 * size 128 and 19,968 at 64, against 41,472 and 33,280 for the other layout (and 42,496 for the converted build's
 * earlier one): on a large GPU, where WebGPU gets about 48 KiB of workgroup memory an SM
 * (bench/results/2026-12-01-nvidia-h200-session19-occupancy-probe.txt, from bench/occupancy-probe.ts), two workgroups
 * an SM instead of one, measured faster on Qwen3-4B's layer at 32K keys
 * (bench/results/2026-12-01-nvidia-h200-session20-kernel-experiments.txt).
 * Output as the split kernel (attentionPartialSource): splits = 1 the normalized rows, else (max, sum, Σ p·V) per
 * (t, h, s) for the merge pass. Bindings as the split kernel's, except that the converted build binds the int8 keys
 * buffer in place of the page table, and no pages.
 */
import { attentionBindingsWgsl, attentionParamsWgsl, SPLIT_CHUNK_WGSL, splitTileWgsl } from './attention.wgsl.ts';
import { type DecodeQuantShape, quantGroupsFitHeads } from './attention-decode.wgsl.ts';
import { KV_STEP_WGSL, kvPagesReadableWgsl } from './kv-append.wgsl.ts';

export interface AttentionPrefillInt8Shape {
  headDim: 64 | 128;
  /** Quant pages (pool mode 'quant') and their formats; null for an f16-only pool. */
  quant: DecodeQuantShape | null;
  /**
   * Read the keys as int8 codes a conversion pass wrote for the whole step (attentionKeysInt8Source), instead of
   * converting each tile from the pages in every workgroup that reads it. The build then no longer depends on `quant`.
   */
  converted: boolean;
  /** A sliding-window layer's build (WindowedShape). */
  windowed?: boolean;
}

/** Query rows per workgroup. */
export const INT8_ATTENTION_ROWS = 64;
/** Keys per tile. */
export const INT8_ATTENTION_TILE_KEYS = 64;
const BK = INT8_ATTENTION_TILE_KEYS;

/**
 * Words between rows of a build's workgroup arrays, and the sums' size. Rows of codes are padded by a vec4: the 16-byte
 * rows a matrix load reads together then fall in different banks (measured faster on both models:
 * bench/results/2026-12-01-nvidia-h200-session15-attention-int8-padded-{f16,int2}.json).
 * Rows of S are BK + 1 words apart (the converted build's halves BK / 2 + 1), for the softmax's reads (68 and 72 were
 * no faster).
 */
function int8TileLayout(headDim: number, converted: boolean) {
  // The converted build keeps q's codes (ROWS rows) and p's (rows PS words) in the K tile (BK keys, KS words apart).
  if (converted && (INT8_ATTENTION_ROWS > BK || BK / 4 + 4 > headDim / 4 + 4)) {
    throw new Error('int8 attention: q and p codes do not fit the K tile of the converted build');
  }
  // Words between keys of the K code tile (and of the V one staged from the pages), and between rows of q's codes.
  const KS = headDim / 4 + 4;
  // Words between rows of the p codes, and between dims of the transposed V tile (the converted build).
  const PS = BK / 4 + 4;
  // Words between rows of S (converted: of half of S's keys at a time).
  const SP = (converted ? BK / 2 : BK) + 1;
  // P·V tiles a subgroup stores per round (of 256 words each).
  const roundTiles = converted ? 2 : 4;
  // The sums hold S, then a round of P·V tiles; before the first tile, q's codes (converted: the K tile holds those).
  const sumsWords = Math.max(INT8_ATTENTION_ROWS * SP, converted ? 0 : INT8_ATTENTION_ROWS * KS, 4 * roundTiles * 256);
  // V's tile: [key][dim] as staged from the pages, or [dim][key] as the conversion pass wrote it, at head size 128
  // half its dims at a time (splitValues).
  const vTileWords = converted ? (splitValues(headDim, converted) ? headDim / 2 : headDim) * PS : BK * KS;
  return { KS, PS, SP, roundTiles, sumsWords, vTileWords };
}

/**
 * Whether the converted build stages V's tile in two halves of its dims, the second after the P·V rounds of the first:
 * at head size 128 that takes its workgroup memory from 29,184 to 24,064 bytes, under what a large GPU needs to keep
 * two workgroups an SM (bench/results/2026-12-01-nvidia-h200-session19-occupancy-probe.txt; at 29,184 it kept one:
 * bench/results/2026-12-01-nvidia-h200-session20-kernel-experiments.txt).
 */
function splitValues(headDim: number, converted: boolean): boolean {
  return converted && headDim === 128;
}

/**
 * Workgroup storage of a build: the K and V code tiles, the sums, the p codes (the converted build: in the K tile's
 * words), five per-row or per-key scales.
 */
export function attentionPrefillInt8WorkgroupBytes(headDim: number, converted: boolean): number {
  const rows = INT8_ATTENTION_ROWS;
  const { KS, PS, sumsWords, vTileWords } = int8TileLayout(headDim, converted);
  return 4 * (BK * KS + vTileWords + sumsWords + (converted ? 0 : rows * PS) + 3 * rows + 2 * BK);
}

/** The build for a head size and page formats, or null where the kernel does not serve them. */
export function attentionPrefillInt8Shape(
  headDim: number,
  quant: DecodeQuantShape | null,
  maxWorkgroupBytes: number,
  converted = false,
): AttentionPrefillInt8Shape | null {
  if ((headDim !== 64 && headDim !== 128) || !quantGroupsFitHeads(headDim, quant)) return null;
  if (quant && (32 / quant.kBits > headDim / 2 || 32 / quant.vBits > headDim / 2)) return null;
  return attentionPrefillInt8WorkgroupBytes(headDim, converted) <= maxWorkgroupBytes
    ? { headDim, quant, converted }
    : null;
}

/**
 * Bytes of the int8 keys buffer for steps of up to `maxKeys` keys (attentionKeysInt8Source): per KV head and key,
 * K's and V's codes (a byte per dim) and scales (f32). Keys are counted in whole tiles, and tiles start on multiples
 * of BK keys, so no tile reads past a KV head's keys.
 */
export function keysInt8Bytes(maxKeys: number, kvHeads: number, headDim: number): number {
  return kvHeads * keysInt8Capacity(maxKeys) * 2 * (headDim + 4);
}

/** Keys per KV head the int8 keys buffer holds for steps of up to `maxKeys` keys (params.int8Keys). */
export function keysInt8Capacity(maxKeys: number): number {
  return Math.ceil(maxKeys / BK) * BK;
}

/**
 * The int8 keys buffer's layout, in i32 words (C = params.int8Keys keys per KV head): K codes [kvHeads][C][HD / 4],
 * then V codes in the same words but each tile of BK keys transposed ([dim][key]: a word holds 4 keys' codes of one
 * dim), then K scales [kvHeads][C] (f32 bits), then V scales; `kind` 0 is K, 1 is V. The P·V product takes V's tile as
 * its right operand, keys along the sum: transposed, it loads as a column-major matrix, which 8-bit tensor-core
 * fragments load whole (a row-major one measured much slower:
 * bench/results/2026-12-01-nvidia-h200-session16-attention-int8-ablate-colmajor-f16.json). Written by the conversion
 * pass, read by the converted build (keysInt8ByteAt spells it for the tests); the including shader declares HW and
 * params.
 */
const KEYS_INT8_LAYOUT_WGSL = `
/**
 * Word of the first code of key \`key\` of KV head kvh (kind 0: K, 1: V) in the int8 keys buffer; for V, of a tile's
 * first key only (its tile is transposed), which is all the readers ask for.
 */
fn keyCodesAt(kind: u32, kvh: u32, key: u32) -> u32 {
  return ((kind * params.kvHeads + kvh) * params.int8Keys + key) * HW;
}
/** Word of that key's scale. */
fn keyScaleAt(kind: u32, kvh: u32, key: u32) -> u32 {
  return 2u * params.kvHeads * params.int8Keys * HW + (kind * params.kvHeads + kvh) * params.int8Keys + key;
}`;

/**
 * Byte of code `dim` of key `key` (K: kind 0, V: 1) of KV head kvh in an int8 keys buffer of `capacity` keys per KV
 * head (KEYS_INT8_LAYOUT_WGSL), and the byte of its scale.
 */
export function keysInt8ByteAt(
  kind: 0 | 1,
  kvh: number,
  key: number,
  dim: number,
  { capacity, kvHeads, headDim }: { capacity: number; kvHeads: number; headDim: number },
): { code: number; scale: number } {
  const head = (kind * kvHeads + kvh) * capacity;
  const tile = key - (key % BK);
  const code = kind === 0 ? (head + key) * headDim + dim : (head + tile) * headDim + dim * BK + (key % BK);
  const scale = 4 * (2 * kvHeads * capacity * (headDim / 4) + head + key);
  return { code, scale };
}

/**
 * Converts every key of the step (0..step.length) of one layer into int8 codes, once, for the converted build of the
 * prefill attention: workgroup (tile of BK keys, KV head), the staging of int8AttentionStagingWgsl into the int8 keys
 * buffer (keys8, read_write; KEYS_INT8_LAYOUT_WGSL), V's codes through workgroup memory to transpose them.
 */
export function attentionKeysInt8Source(headDim: 64 | 128, quant: DecodeQuantShape | null): string {
  const HD = headDim;
  const HALF = HD / 2;
  const { fetchWgsl, codeScaleWgsl, stage } = int8AttentionStagingWgsl(HD, quant);
  // The invocation's half of key `block + r`'s codes of a kind, and the key's scale.
  const codesAt = (kind: number) => (i: string) => `keys8[codes${kind} + ${i}]`;
  const scaleAt = (kind: number) => (d: string) => `keys8[keyScaleAt(${kind}u, kvh, block + r)] = bitcast<i32>(${d});`;
  const VT = HD / 4 + 1; // words between keys of the V tile in workgroup memory: the transposing reads spread over the banks
  return /* wgsl */ `
enable subgroups;
${attentionParamsWgsl(quant !== null)}
${kvPagesReadableWgsl(4)}
@group(0) @binding(0) var<storage, read_write> keys8: array<i32>;
@group(0) @binding(1) var<storage, read> pageTable: array<u32>;
@group(0) @binding(2) var<uniform> step: KvStep;
@group(0) @binding(3) var<uniform> params: Params;
${fetchWgsl}
${codeScaleWgsl}
${KEYS_INT8_LAYOUT_WGSL}

const HD: u32 = ${HD}u;
const HW: u32 = ${HD / 4}u;
const BK: u32 = ${BK}u;

var<workgroup> vStaged: array<i32, ${BK * VT}>; // the tile's V codes, [key][dim], keys ${VT} words apart

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32,
        @builtin(subgroup_size) width: u32) {
  let kvh = wg.y;
  let block = wg.x * BK;
  if (block >= step.length) { return; }
  // Lanes 2m, 2m + 1 share a key (their shuffles meet), as in the attention kernels' staging.
  let r = sg * (width / 2u) + lane / 2u;
  let half = lane % 2u;
  let f = fetchTile(block, min(BK, step.length - block), kvh, r, half);
  let codes0 = keyCodesAt(0u, kvh, block + r) + half * ${HALF / 4}u;
${stage('k', codesAt(0), scaleAt(0))}
${stage('v', (i) => `vStaged[r * ${VT}u + half * ${HALF / 4}u + ${i}]`, scaleAt(1))}
  workgroupBarrier();
  let vTileWord = keyCodesAt(1u, kvh, block);
${transposeTileWgsl(
  HD,
  (key, word) => `vStaged[(${key}) * ${VT}u + ${word}]`,
  (w, word) => `keys8[vTileWord + ${w}] = ${word};`,
)}
}
`;
}

/**
 * WGSL by which the 128 invocations `li` transpose a tile of BK keys' int8 codes from [key][dim] words (`from(key,
 * word)`: the i32 holding dims 4·word.. of key `key`) to [dim][key] words: word w holds dim w / (BK / 4)'s codes of
 * keys 4·(w % (BK / 4)).., the lowest byte the first, and `store(w, value)` writes it.
 */
export function transposeTileWgsl(
  HD: number,
  from: (key: string, word: string) => string,
  store: (w: string, value: string) => string,
): string {
  return `  for (var w = li; w < ${(HD * BK) / 4}u; w += 128u) {
    let dim = w / ${BK / 4}u;
    let first = 4u * (w % ${BK / 4}u);
    var word = 0u;
    for (var b = 0u; b < 4u; b++) {
      let codes = bitcast<u32>(${from('first + b', 'dim / 4u')});
      word |= ((codes >> (8u * (dim % 4u))) & 0xffu) << (8u * b);
    }
    ${store('w', 'bitcast<i32>(word)')}
  }`;
}

/**
 * The first key of the int8 kernels' first tile: tiles of BK keys start on multiples of BK, which divides the 64-key
 * tiles the conversion pass transposes V's codes in, so a split that starts inside one masks that tile's keys before
 * its start.
 */
const TILE_START_WGSL = `  let tileStart = select(start, start - start % BK, start < end);`;

/**
 * What both int8 prefill kernels share, for a head of HD dims where invocation pair (row or key r, half) handles HD/2
 * dims: the tile fetch a tile ahead (Fetched, fetchTile: f16 words or quant code words), the opening of the loop
 * over tiles (`tileLoopHead`: tiles start on multiples of BK keys, so a split's first tile may hold keys before its
 * start, which `tileMask`'s `skip` masks), whose stages turn the fetched half-row into int8 codes
 * `kcodes`/`vcodes[r * KS + ..]` (KS: the including shader's words between keys) and its scale `kscale`/`vscale[r]`
 * (arrays of f32, or with `scaleQuads` of vec4<f32>, four keys each; through `codeScaleWgsl`'s codeScale, the pair's
 * max by subgroupShuffleXor), and `stageQuery(codes, stride)`, which does the same for row r of q into `codes`.
 * `stage(p, codesAt, storeScale)` is one such stage with its targets given (the conversion pass).
 */
export function int8AttentionStagingWgsl(
  HD: number,
  quant: DecodeQuantShape | null,
  scaleQuads = false,
  windowed = false,
) {
  const HALF = HD / 2; // dims an invocation stages of a row or key
  // One invocation's half of a key's row: fetched into registers a tile ahead (fetchTile), then as f32 into
  // vals[0..HALF/4) and int8 codes (stage). Quant pages: code words and their groups' (lo, scale) words.
  const perK = quant ? 32 / quant.kBits : 0;
  const perV = quant ? 32 / quant.vBits : 0;
  const quantFetch = (p: 'k' | 'v', per: number) => `
      {
        let row = (entry & 0xffffffu) * params.quantPageWords + params.quant${p.toUpperCase()}Offset +
          quantRow(key % params.pageTokens) * params.${p}RowWords;
        for (var wi = 0u; wi < ${HALF / per}u; wi++) {
          // A code word never straddles groups (groupSize is a multiple of 32 / bits).
          let e0 = quantRowStart(key % params.pageTokens) + kvh * HD + half * ${HALF}u + wi * ${per}u;
          f.${p}Codes[wi] = slabWord(slot, row + e0 / ${per}u);
          f.${p}LoHi[wi] = slabWord(slot, row + params.${p}CodeWords + e0 / params.${p}Group);
        }
      }`;
  const quantValues = (p: 'k' | 'v', bits: number) => {
    const per = 32 / bits;
    const mask = `${(1 << bits) - 1}u`;
    return `{
        for (var wi = 0u; wi < ${HALF / per}u; wi++) {
          let codes = f.${p}Codes[wi];
          let lohi = unpack2x16float(f.${p}LoHi[wi]);
          for (var c = 0u; c < ${per}u; c += 4u) {
            let code = vec4<f32>(f32((codes >> (c * ${bits}u)) & ${mask}), f32((codes >> ((c + 1u) * ${bits}u)) & ${mask}),
                                 f32((codes >> ((c + 2u) * ${bits}u)) & ${mask}), f32((codes >> ((c + 3u) * ${bits}u)) & ${mask}));
            vals[(wi * ${per}u + c) / 4u] = vec4<f32>(lohi.x) + code * lohi.y;
          }
        }
      }`;
  };
  const f16Values = (p: 'k' | 'v') => `{
        for (var i = 0u; i < ${HD / 16}u; i++) {
          let w = f.${p}[i];
          vals[2u * i] = vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
          vals[2u * i + 1u] = vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w));
        }
      }`;
  // Where the codes go: word i of this invocation's half (an l-value) and the statement that stores the key's scale d;
  // by default the tile's rows in workgroup memory.
  const stage = (
    p: 'k' | 'v',
    codesAt = (i: string) => `${p}codes[r * KS + half * ${HALF / 4}u + ${i}]`,
    storeScale = (d: string) => (scaleQuads ? `${p}scale[r / 4u][r % 4u] = ${d};` : `${p}scale[r] = ${d};`),
  ) => `
    {
      var vals: array<vec4<f32>, ${HALF / 4}>;
      ${quant ? `if (f.quant) ${quantValues(p, p === 'k' ? quant.kBits : quant.vBits)} else ${f16Values(p)}` : f16Values(p)}
      let d = codeScale(vals);
      let inverse = select(0.0, 1.0 / d, d > 1e-30);
      for (var i = 0u; i < ${HALF / 4}u; i++) {
        ${codesAt('i')} = bitcast<i32>(pack4xI8(vec4<i32>(round(vals[i] * inverse))));
      }
      if (half == 0u) { ${storeScale('d')} }
    }`;
  const fetchWgsl = `
/**
 * Invocation (2j + half)'s words of key j of the tile at block (n keys): its half of the key's K and V row. Zero past
 * n (codes and scale 0; masked in the softmax).
 */
struct Fetched {
  k: array<vec4<u32>, ${HD / 16}>,
  v: array<vec4<u32>, ${HD / 16}>,${
    quant
      ? `
  kCodes: array<u32, ${HALF / perK}>,
  kLoHi: array<u32, ${HALF / perK}>,
  vCodes: array<u32, ${HALF / perV}>,
  vLoHi: array<u32, ${HALF / perV}>,
  quant: bool,`
      : ''
  }
}

fn fetchTile(block: u32, n: u32, kvh: u32, j: u32, half: u32) -> Fetched {
  var f: Fetched;
  if (j < n) {
    let key = block + j;
    let entry = pageTable[step.tableOffset + key / params.pageTokens];
    let slot = (entry >> 24u) & 0xfu;
    ${
      quant
        ? `if ((entry >> 28u) == 1u) {
      f.quant = true;${quantFetch('k', perK)}${quantFetch('v', perV)}
    } else `
        : ''
    }{
      let at = (entry & 0xffffffu) * (params.pageWords / 4u) +
        (kvh * params.pageTokens + key % params.pageTokens) * (HD / 8u) + half * (HD / 16u);
      for (var i = 0u; i < ${HD / 16}u; i++) {
        f.k[i] = slabQuad(slot, params.kOffset / 4u + at + i);
        f.v[i] = slabQuad(slot, params.vOffset / 4u + at + i);
      }
    }
  }
  return f;
}`;

  const codeScaleWgsl = `
/** d = max|x| / 127 over this invocation's values and its pair's (lanes 2m, 2m + 1 share a row or key). */
fn codeScale(vals: array<vec4<f32>, ${HALF / 4}>) -> f32 {
  var amax = 0.0;
  for (var i = 0u; i < ${HALF / 4}u; i++) {
    let a = abs(vals[i]);
    amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
  }
  return max(amax, subgroupShuffleXor(amax, 1u)) / 127.0;
}`;
  /** Row r of q (times params.scale) as codes at codes[r * stride + ..] and qscale[r]; rowT is r's token. */
  const stageQuery = (codes: string, stride: string) => `  {
    var vals: array<vec4<f32>, ${HALF / 4}>;
    if (rowT < step.tokens) {
      let at = (rowT * params.heads + kvh * group + (firstRow + r) % group) * HD + half * ${HALF}u;
      for (var i = 0u; i < ${HALF / 4}u; i++) {
        vals[i] = vec4<f32>(q[at + 4u * i], q[at + 4u * i + 1u], q[at + 4u * i + 2u], q[at + 4u * i + 3u]) * params.scale;
      }
    }
    let d = codeScale(vals);
    let inverse = select(0.0, 1.0 / d, d > 1e-30);
    for (var i = 0u; i < ${HALF / 4}u; i++) {
      ${codes}[r * ${stride} + half * ${HALF / 4}u + i] = bitcast<i32>(pack4xI8(vec4<i32>(round(vals[i] * inverse))));
    }
    if (half == 0u) { qscale[r] = d; }
  }`;
  // The opening of the kernels' loop over tiles of BK keys, up to the staged tile: fetch the first tile, then per
  // tile stage its K and V codes and fetch the next one's words while this one is computed (its page loads were a
  // fifth of the tensor-core kernel's time). Leaves `block` and `n` (the tile's keys) in scope; the caller closes it.
  const tileLoopHead = `${TILE_START_WGSL}
  var f = fetchTile(tileStart, select(0u, min(BK, end - tileStart), tileStart < end), kvh, r, half);
  for (var block = tileStart; block < end; block += BK) {
    let n = min(BK, end - block);
    // The previous tile's readers are done with the codes, the scales and what else the tile rewrites.
    workgroupBarrier();
${stage('k')}
${stage('v')}
    workgroupBarrier();
    if (block + BK < end) { f = fetchTile(block + BK, min(BK, end - block - BK), kvh, r, half); }`;
  // Row r's keys of the tile it may see: those before `visible` (causal, and the tile's n) and from `skip` (a split's
  // first tile may start before the split, and a sliding-window row's before its window's `first`).
  const tileMask = (indent: string) =>
    `${indent}let visible = select(0u, min(n, limit - block), limit > block); // keys 0..visible-1: row r sees them
${
  windowed
    ? `${indent}let lower = max(start, first);
${indent}let skip = select(0u, lower - block, lower > block); // keys 0..skip-1: the split's before, or the window's`
    : `${indent}let skip = select(0u, start - block, start > block); // keys 0..skip-1 of a first tile: the split's before`
}`;
  return {
    fetchWgsl,
    codeScaleWgsl,
    stage,
    stageQuery,
    tileLoopHead,
    tileMask,
  };
}

export function attentionPrefillInt8Source(shape: AttentionPrefillInt8Shape): string {
  const { headDim: HD, quant, windowed = false } = shape;
  // The converted build is the compact one (the file's comment).
  const compact = shape.converted;
  const ROWS = INT8_ATTENTION_ROWS;
  const { KS, PS, SP, roundTiles, sumsWords, vTileWords } = int8TileLayout(HD, compact);
  const P_CODES = compact ? 'kcodes' : 'pcodes';
  const splitV = splitValues(HD, compact);
  const range = (n: number) => Array.from({ length: n }, (_, i) => i);
  const each = (n: number, f: (i: number) => string, sep = '\n') => range(n).map(f).join(sep);
  const KSTEPS = HD / 32; // 32-deep steps of q·k
  const DT = HD / 16; // dim tiles of a subgroup's output rows
  const ROUNDS = DT / roundTiles; // rounds of P·V tiles through the sums buffer
  const PM = BK / 32; // 32-key left operands of P·V a tile: its w codes
  // Softmax lane (row r, half)'s keys of a tile: LK of them, from LK·half, visited from ROT·half on (rows of S 65
  // words apart put both halves' first keys in one bank otherwise); a vec4 of scales or a word of w codes holds 4 of
  // them. Compact: the lane's keys are 16·half.. of each half of S, i = 0..15 from the first, 16..31 from the second
  // (rows 33 words apart: the 32 lanes' reads meet 32 banks).
  const LK = BK / 2;
  const ROT = 16;
  const keyOf = (i: number) =>
    compact
      ? `${i < 16 ? 0 : 32}u + 16u * half + ${i % 16}u`
      : `${LK}u * half + ((${i}u + ${ROT}u * half) & ${LK - 1}u)`;
  const quadOf4 = (a: number) =>
    compact
      ? `${a < 4 ? a : a + 4}u + 4u * half`
      : `${LK / 4}u * half + ((${a}u + ${ROT / 4}u * half) & ${LK / 4 - 1}u)`;
  // Where lane key i's score is in the sums: column keyOf(i), or compact, its column in its half of S.
  const scoreColumn = (i: number) => (compact ? `16u * half + ${i % 16}u` : `j${i}`);
  const { fetchWgsl, codeScaleWgsl, stageQuery, tileLoopHead, tileMask } = int8AttentionStagingWgsl(
    HD,
    quant,
    true,
    windowed,
  );
  // V's codes of dim tile t (16 dims) and the tile's keys 32·half.. as the right operand of P·V: column-major from the
  // transposed tile (converted), row-major from the one staged from the pages.
  const vMatrix = (t: string, half: number) =>
    shape.converted
      ? `subgroupMatrixLoad<subgroup_matrix_right<i8, 16, 32>, col_major>(&vcodes, ${t} * 16u * PS + ${8 * half}u, PS)`
      : `subgroupMatrixLoad<subgroup_matrix_right<i8, 16, 32>, row_major>(&vcodes, ${32 * half}u * KS + ${t} * 4u, KS)`;
  // The scores of the tile's keys 16t.. for the subgroup's rows: q·k over the head's dims, stored to the sums.
  const scoresTile = (t: string) => `    {
      var scores = subgroupMatrixMultiply<i32>(q0,
        subgroupMatrixLoad<subgroup_matrix_right<i8, 16, 32>, col_major>(&kcodes, ${t} * 16u * KS, KS));
${each(
  KSTEPS - 1,
  (k) => `      scores = subgroupMatrixMultiplyAccumulate(q${k + 1},
        subgroupMatrixLoad<subgroup_matrix_right<i8, 16, 32>, col_major>(&kcodes, ${t} * 16u * KS + ${8 * (k + 1)}u, KS), scores);`,
)}
      subgroupMatrixStore<row_major>(&sums, sg * 16u * SP + ${compact ? `(${t} % 2u)` : t} * 16u, scores, SP);
    }`;
  // Round \`round\` of the P·V products (roundTiles dim tiles) and their apply to the accumulators.
  const valuesRound = (round: number) => {
    const RT = roundTiles;
    const product = (u: string) => {
      // The dim tile in the staged V tile (split: in its half of the dims).
      const t = `(${splitV ? (round * RT) % (DT / 2) : round * RT}u + ${u})`;
      return `        var o = subgroupMatrixMultiply<i32>(p0, ${vMatrix(t, 0)});
${each(PM - 1, (k) => `        o = subgroupMatrixMultiplyAccumulate(p${k + 1}, ${vMatrix(t, k + 1)}, o);\n`, '')}        subgroupMatrixStore<row_major>(&sums, (sg * ${RT}u + ${u}) * 256u, o, 16u);`;
    };
    const products = each(RT, (u) => `      {\n${product(`${u}u`)}\n      }`);
    // Row 2i + h's correction and scale (rowCorr, rowScale) were read once for the tile.
    const apply = each(RT, (u) =>
      each(8, (i) => {
        const a = (round * RT + u) * 8 + i;
        return `      acc[${a}] = acc[${a}] * rowCorr${i} + rowScale${i} * f32(sums[(sg * ${RT}u + ${u}u) * 256u + ${2 * i}u * 16u + h * 16u + c]);`;
      }),
    );
    // Split V: once the first half's products are done, its second half is staged (the barrier closing this round
    // orders it before the next round's products) and the next tile's words of it are fetched.
    const secondHalf =
      splitV && round === ROUNDS / 2 - 1
        ? `${range(AHEAD).filter(deferred).map(copyQuad).join('\n')}
      if (block + BK < end) {
${range(AHEAD)
  .filter(deferred)
  .map((i) => `        ${loadQuad(i, 'block + BK')}`)
  .join('\n')}
      }
`
        : '';
    return `    {
${products}
      workgroupBarrier();
${secondHalf}${apply}${round + 1 < ROUNDS ? '\n      workgroupBarrier();' : ''}
    }`;
  };
  // Key j_i's scale in the softmax: keys 4a..4a+3 of the lane's are one vec4 of kscale/vscale.
  const keyScale = (p: 'k' | 'v', i: number) => `${p}scale[${quadOf4(Math.floor(i / 4))}][${i % 4}]`;
  // The lane's score of its key i, read from the sums.
  const scoreHead = (indent: string) => `${indent}let dq = qscale[r];\n${tileMask(indent)}`;
  const scoreOf = (i: number, indent = '      ') => `${indent}let j${i} = ${keyOf(i)};
${indent}let s${i} = select(NONE, f32(sums[r * SP + ${scoreColumn(i)}]) * dq * ${keyScale('k', i)}, j${i} >= skip && j${i} < visible);`;
  // Compact: S's first 32 keys, their scores read (into registers), then its other 32 into the same sums.
  const compactScores = `${each(2, (t) => scoresTile(`${t}u`))}
    workgroupBarrier();
${scoreHead('    ')}
${each(16, (i) => scoreOf(i, '    '))}
    workgroupBarrier();
${each(2, (t) => scoresTile(`${t + 2}u`))}
    workgroupBarrier();
${each(16, (i) => scoreOf(i + 16, '    '))}`;
  // The converted build: bindings 0, 1, 3, 4 as the others, the int8 keys buffer in place of the page table, no pages.
  const bindings = shape.converted
    ? `${attentionParamsWgsl(false, windowed)}
${KV_STEP_WGSL}
@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read> keys8: array<vec4<i32>>;
@group(0) @binding(3) var<uniform> step: KvStep;
@group(0) @binding(4) var<uniform> params: Params;`
    : `${attentionBindingsWgsl(quant !== null, windowed)}
${kvPagesReadableWgsl(5)}
${fetchWgsl}`;
  // Converted builds copy each tile's codes from the int8 keys buffer into workgroup memory, as vec4s loaded a tile
  // ahead into registers: a subgroup matrix loaded from workgroup memory fed the tensor cores several times faster than
  // one loaded from a storage buffer (bench/results/2026-12-01-nvidia-h200-session15-subgroup-matrix-probe.json, from
  // bench/int8-dot-probe.ts).
  const TILE_QUADS = (BK * HD) / 16; // vec4s of a tile's K codes, and of its V codes
  // Invocation li's vec4 i of a tile, ahead[i], is vec4 li + 128·i of its K codes (i < K_AHEAD), else of its V codes
  // (128 invocations: 2·ROWS). Every index is written out (as is the rest of the tile loop): loops over the private
  // arrays measured slower (bench/results/2026-12-01-nvidia-h200-session19-attention-int8-unrolled-{f16,int2}.json).
  const K_AHEAD = TILE_QUADS / (2 * ROWS);
  if (!Number.isInteger(K_AHEAD))
    throw new Error(`int8 attention: a tile's ${TILE_QUADS} vec4s of K do not split evenly`);
  const AHEAD = 2 * K_AHEAD; // vec4s an invocation loads per tile, K's then V's
  const quadOf = (i: number) => ({ kind: i < K_AHEAD ? 0 : 1, at: `li + ${(i % K_AHEAD) * 2 * ROWS}u` });
  // V's vec4s come from the conversion pass's transposed tiles (KEYS_INT8_LAYOUT_WGSL).
  const loadQuad = (i: number, first: string) => {
    const { kind, at } = quadOf(i);
    return `ahead[${i}] = keys8[keyCodesAt(${kind}u, kvh, ${first}) / 4u + ${at}];`;
  };
  // Split V: the vec4s of its second half of dims (its last half of vec4s), staged mid-tile.
  const deferred = (i: number) => splitV && i >= K_AHEAD + (AHEAD - K_AHEAD) / 2;
  const staged = range(AHEAD).filter((i) => !deferred(i)); // the vec4s staged at the top of a tile
  // K's vec4s go to key at / (HD / 16), V's (transposed tiles) to dim at / (BK / 16) (split: in its half of the dims).
  const copyQuad = (i: number) => {
    const { kind, at } = quadOf(i);
    const [codes, per, stride] = kind === 0 ? ['kcodes', HD / 16, 'KS'] : ['vcodes', BK / 16, 'PS'];
    const row = kind === 1 && splitV ? `(((${at}) / ${per}u) % ${HD / 2}u)` : `((${at}) / ${per}u)`;
    return `    {
      let word = ${row} * ${stride} + 4u * ((${at}) % ${per}u);
      ${each(4, (e) => `${codes}[word + ${e}u] = ahead[${i}][${e}];`, ' ')}
    }`;
  };
  const convertedLoopHead = `${TILE_START_WGSL}
  // Invocation li's vec4s of the next tile; first those of the first tile.
  var ahead: array<vec4<i32>, ${AHEAD}>;
  if (tileStart < end) {
${each(AHEAD, (i) => `    ${loadQuad(i, 'tileStart')}`)}
  }
  for (var block = tileStart; block < end; block += BK) {
    let n = min(BK, end - block);
    // The previous tile's readers are done with the codes, the sums and the scales.
    workgroupBarrier();
    // The tile's K scales, then its V scales; past the split's keys 0 (their scores are masked; their value weights
    // must stay finite).
    for (var i = li; i < 2u * BK; i += ${2 * ROWS}u) {
      let j = i % BK;
      let at = keyScaleAt(i / BK, kvh, block + j);
      let scale = bitcast<f32>(keys8[at / 4u][at % 4u]);
      if (i < BK) { kscale[j / 4u][j % 4u] = select(0.0, scale, j < n); } else { vscale[j / 4u][j % 4u] = select(0.0, scale, j < n); }
    }
${staged.map(copyQuad).join('\n')}
    workgroupBarrier();
    if (block + BK < end) {
${staged.map((i) => `      ${loadQuad(i, 'block + BK')}`).join('\n')}
    }`;

  return /* wgsl */ `
enable chromium_experimental_subgroup_matrix;
enable subgroups;
diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);
${bindings}
${SPLIT_CHUNK_WGSL}
${codeScaleWgsl}

const HD: u32 = ${HD}u;
const HW: u32 = ${HD / 4}u; // words of a row's or key's codes
const ROWS: u32 = ${ROWS}u;
const BK: u32 = ${BK}u;
// Words between rows: of the key tiles' codes and of q's (a vec4 of padding: a matrix load's rows of 16 bytes fall in
// different banks), of the p codes (and of the dims of a transposed V tile), and of S in the sums (row r's key j in
// bank (r + j) % 32).
const KS: u32 = ${KS}u;
const PS: u32 = ${PS}u;
const SP: u32 = ${SP}u;
const NONE: f32 = -1e30;
${shape.converted ? KEYS_INT8_LAYOUT_WGSL : ''}

${
  compact
    ? `// The K tile; before the first tile, q's codes (rows KS apart) until the subgroups hold them; after each tile's S,
// its p codes (rows PS apart).
var<workgroup> kcodes: array<i32, ${BK * KS}>;
// V's tile, [dim][key]${splitV ? ', half its dims at a time' : ''}.
var<workgroup> vcodes: array<i32, ${vTileWords}>;
// Half of a tile's S [row][key] at a time, then a round of P·V tiles.
var<workgroup> sums: array<i32, ${sumsWords}>;`
    : `var<workgroup> kcodes: array<i32, ${BK * KS}>;
var<workgroup> vcodes: array<i32, ${vTileWords}>;
// q's codes (rows KS apart) until the subgroups hold them; then S of a tile [row][key], then a round of P·V tiles.
var<workgroup> sums: array<i32, ${sumsWords}>;`
}
${compact ? '' : `var<workgroup> pcodes: array<i32, ${ROWS * PS}>;\n`}var<workgroup> qscale: array<f32, ${ROWS}>;
// The tile's K and V scales, four keys a vec4: the softmax reads them so (measured faster than a load per key:
// bench/results/2026-12-01-nvidia-h200-session19-attention-int8-scale-quads-row-lanes-f16.json).
var<workgroup> kscale: array<vec4<f32>, ${BK / 4}>;
var<workgroup> vscale: array<vec4<f32>, ${BK / 4}>;
var<workgroup> wscale: array<f32, ${ROWS}>; // the tile's d_w per row; at the end, the row sums
var<workgroup> corr: array<f32, ${ROWS}>; // the tile's correction per row; at the end, the row maxima


@compute @workgroup_size(${2 * ROWS})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
${splitTileWgsl('ROWS', windowed)}
  // The row (or key) this invocation stages and takes through the softmax: lanes 2m and 2m + 1 of subgroup g take
  // row 16g + m, from the subgroup builtins (WGSL does not promise lane = index % 32), so the pair's shuffles and
  // the subgroup's matrix rows agree.
  let r = sg * 16u + lane / 2u;
  let half = lane % 2u;
  let rowT = (firstRow + r) / group;
  let limit = select(0u, step.position + rowT + 1u, rowT < step.tokens); // keys visible to row r (causal)${
    windowed ? "\n  let first = windowStart(step.position + rowT); // ... from its sliding window's first" : ''
  }
${stageQuery(compact ? 'kcodes' : 'sums', 'KS')}
  workgroupBarrier();
  // The subgroup's q rows, 32 dims per matrix, for every tile.
${each(
  KSTEPS,
  (k) =>
    `  let q${k} = subgroupMatrixLoad<subgroup_matrix_left<i8, 32, 16>, row_major>(&${compact ? 'kcodes' : 'sums'}, sg * 16u * KS + ${8 * k}u, KS);`,
)}
  var m = NONE;
  var l = 0.0;
  // Lane (h, c) holds column c of rows 2i + h of each 16x16 output tile: acc[t * 8 + i], dim tile t.
  let h = lane / 16u;
  let c = lane % 16u;
  var acc: array<f32, ${DT * 8}>;

${shape.converted ? convertedLoopHead : tileLoopHead}
${
  compact
    ? compactScores
    : `${each(BK / 16, (t) => scoresTile(`${t}u`))}
    workgroupBarrier();`
}
${
  compact
    ? ''
    : `    // Row r's keys half·LK.. (keyOf): with rows SP = BK + 1 words apart, the 32 lanes of a subgroup (16 rows, both
    // halves) read 32 different banks.
`
}    // Written out key by key (s_i, w_i in registers, one read of the sums): as loops with the sums read twice and w
    // written back, this phase took half the kernel's time.
    {
${compact ? '' : `${scoreHead('      ')}\n${each(LK, (i) => scoreOf(i))}\n`}      var tileMax = ${range(LK).reduce((acc, i) => (acc ? `max(${acc}, s${i})` : `s${i}`), '')};
      tileMax = max(tileMax, subgroupShuffleXor(tileMax, 1u));
      let best = max(m, tileMax);
      let correction = select(1.0, exp(m - best), m > NONE);
${each(
  LK,
  (i) => `      let p${i} = select(0.0, exp(s${i} - best), s${i} > NONE);
      let w${i} = p${i} * ${keyScale('v', i)};`,
)}
      var pSum = ${range(LK)
        .map((i) => `p${i}`)
        .join(' + ')};
      var wMax = ${range(LK).reduce((acc, i) => (acc ? `max(${acc}, w${i})` : `w${i}`), '')};
      pSum += subgroupShuffleXor(pSum, 1u);
      wMax = max(wMax, subgroupShuffleXor(wMax, 1u));
      l = l * correction + pSum;
      m = best;
      let inverse = select(0.0, 127.0 / wMax, wMax > 1e-30);
      // w_4a..w_4a+3 are 4 consecutive keys (keyOf): one word of codes.
${each(
  LK / 4,
  (a) => `      ${P_CODES}[r * PS + ${quadOf4(a)}] =
        bitcast<i32>(pack4xI8(vec4<i32>(round(vec4<f32>(w${4 * a}, w${4 * a + 1}, w${4 * a + 2}, w${4 * a + 3}) * inverse))));`,
)}
      if (half == 0u) {
        wscale[r] = wMax / 127.0;
        corr[r] = correction;
      }
    }
    workgroupBarrier();
    // The subgroup's rows of the tile's w codes, 32 keys each.
${each(
  PM,
  (k) =>
    `    let p${k} = subgroupMatrixLoad<subgroup_matrix_left<i8, 32, 16>, row_major>(&${P_CODES}, sg * 16u * PS + ${8 * k}u, PS);`,
)}
${each(
  8,
  (i) => `    let rowCorr${i} = corr[sg * 16u + ${2 * i}u + h];
    let rowScale${i} = wscale[sg * 16u + ${2 * i}u + h];`,
)}
${each(ROUNDS, valuesRound)}
  }

  workgroupBarrier();
  if (half == 0u) {
    wscale[r] = l;
    corr[r] = m;
  }
  workgroupBarrier();
  for (var i = 0u; i < 8u; i++) {
    let row = sg * 16u + 2u * i + h;
    let t = (firstRow + row) / group;
    if (t < step.tokens) {
      let head = kvh * group + (firstRow + row) % group;
      for (var u = 0u; u < ${DT}u; u++) {
        let dim = u * 16u + c;
        if (params.splits == 1u) {
          dst[(t * params.heads + head) * HD + dim] = acc[u * 8u + i] / wscale[row];
        } else {
          let rec = ((t * params.heads + head) * stepSplits + s) * (HD + 2u);
          if (dim == 0u) {
            dst[rec] = corr[row];
            dst[rec + 1u] = wscale[row];
          }
          dst[rec + 2u + dim] = acc[u * 8u + i];
        }
      }
    }
  }
}
`;
}
