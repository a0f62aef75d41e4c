/**
 * The prefill matmul on 8-bit tensor cores, the way llama.cpp's MMQ does it: activations quantized to int8 per
 * 32-element block, weights turned into int8 codes per block, integer products on the tensor cores, and the two
 * blocks' scales applied to each 32-deep integer sum.
 *
 * WebGPU offers tensor cores only through Dawn's experimental subgroup matrices (`chromium-experimental-subgroup-
 * matrix`, enabled by `allow_unsafe_apis`); on NVIDIA through Vulkan its configurations are 8-bit only
 * (bench/results/2026-11-30-nvidia-h200-session4-dawn-features.txt; this kernel takes i8 x i8 -> i32, M = N = 16,
 * K = 32), so an f32 or f16 product cannot use them.
 *
 * - `quantizeActivationsWgsl`: x f32 [tokens, K] -> codes q = round(x / d), d = max|x| / 127 per block of 32
 *   (q in [-127, 127], packed 4 per word, token rows padded with zeros to the tile), and per block (d, d·Σq).
 * - `int8MatmulWgsl`: per 32-deep step the workgroup writes its weight rows' block as int8 codes c with a pair
 *   (s, m) such that w = s·c + m (Q4_0: c = q - 8; Q5_0: c = q - 16; Q4_1/Q5_1: c = q, m = min; Q8_0: c = q;
 *   Q4_K/Q5_K: c = q, s = d·scale, m = -dmin·min; Q6_K: c = q - 32 with a scale per 16-element half, on the
 *   dot4I8Packed kernel only), each subgroup multiplies 16x32 code tiles by 32x16 activation tiles into 16x16 integer
 * sums C,
 *   stores them to workgroup memory, and each output adds s·d·C + m·(d·Σq).
 */
import { GGML_TYPE_INFO, GgmlType } from '../core/gguf-types.ts';
import { type GatedActivation, gatedExpression } from './elementwise.wgsl.ts';
import { storeWgsl, weightDecodeWgsl } from './matmul.wgsl.ts';

/** Token rows of the activation codes are padded to this: no tile reads past it. */
export const INT8_TOKEN_PADDING = 64;

/** Workgroup size of the activation quantizer: one invocation per 32-element block. */
export const QUANTIZE_ACTIVATIONS_WORKGROUP = 64;

/**
 * `gated` ('swiglu' or 'geglu'): x is the feed-forward's gate and binding 4 its up, and the quantizer takes
 * silu(gate)·up (or gelu(gate)·up) as its input (the down projection's, without a pass that writes it out first).
 */
export function quantizeActivationsWgsl(gated: GatedActivation | null = null): string {
  const load = (i: string) => (gated ? gatedExpression(gated, `x[${i}]`, `up[${i}]`) : `x[${i}]`);
  return /* wgsl */ `
struct Params { K: u32, tokens: u32, paddedTokens: u32, _pad: u32 }
@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> codes: array<u32>;
@group(0) @binding(2) var<storage, read_write> scales: array<vec2<f32>>;
@group(0) @binding(3) var<uniform> params: Params;
${gated ? '@group(0) @binding(4) var<storage, read> up: array<vec4<f32>>;' : ''}

@compute @workgroup_size(${QUANTIZE_ACTIVATIONS_WORKGROUP})
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let block = gid.x + gid.y * 65535u * ${QUANTIZE_ACTIVATIONS_WORKGROUP}u;
  let blocks = params.K / 32u;
  if (block >= params.paddedTokens * blocks) { return; }
  // Block i of token t starts at element 32i of row t: vec4 index 8 · (t · blocks + i) = 8 · block.
  var v: array<vec4<f32>, 8>;
  var amax = 0.0;
  if (block / blocks < params.tokens) {
    for (var j = 0u; j < 8u; j++) {
      v[j] = ${load('8u * block + j')};
      let a = abs(v[j]);
      amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
  }
  let d = amax / 127.0;
  // A block of subnormal values would make 1 / d infinite: its codes stay zero (its share of any sum is nothing).
  let inverse = select(0.0, 1.0 / d, d > 1e-30);
  var sum = 0i;
  for (var j = 0u; j < 8u; j++) {
    let q = vec4<i32>(round(v[j] * inverse));
    sum += (q.x + q.y) + (q.z + q.w);
    codes[8u * block + j] = pack4xI8(q);
  }
  scales[block] = vec2<f32>(d, d * f32(sum));
}
`;
}

/**
 * Per weight type: `code_word(base, b, j)`, word j (elements 4j..4j+3, one per byte) of the int8 codes of the row's
 * 32-element block b, and `code_scale(base, b)`, its (s, m). Nibbles n become signed codes n - 8 bytewise: setting
 * each byte's top bit, subtracting 8 and flipping the top bit back borrows across no byte.
 */
const CODE_WGSL: Partial<Record<GgmlType, string>> = {
  [GgmlType.Q4_0]: `
fn code_word(base: u32, b: u32, j: u32) -> u32 {
  let q = (w[base + b * 5u + 1u + (j & 3u)] >> select(0u, 4u, j >= 4u)) & 0x0f0f0f0fu;
  return ((q | 0x80808080u) - 0x08080808u) ^ 0x80808080u;
}
fn code_scale(base: u32, b: u32) -> vec2<f32> { return vec2<f32>(f16lo(w[base + b * 5u]), 0.0); }`,
  [GgmlType.Q4_1]: `
fn code_word(base: u32, b: u32, j: u32) -> u32 {
  return (w[base + b * 5u + 1u + (j & 3u)] >> select(0u, 4u, j >= 4u)) & 0x0f0f0f0fu;
}
fn code_scale(base: u32, b: u32) -> vec2<f32> { return unpack2x16float(w[base + b * 5u]); }`,
  // Q5_0/Q5_1: the fifth bit of element e is bit e of qh (word 1); spread 4 of them into the 4 bytes' bit 4.
  [GgmlType.Q5_0]: `
fn code_word(base: u32, b: u32, j: u32) -> u32 {
  let wb = base + b * 6u;
  return ((q5_word(wb, j) | 0x80808080u) - 0x10101010u) ^ 0x80808080u;
}
fn code_scale(base: u32, b: u32) -> vec2<f32> { return vec2<f32>(f16lo(w[base + b * 6u]), 0.0); }`,
  [GgmlType.Q5_1]: `
fn code_word(base: u32, b: u32, j: u32) -> u32 { return q5_word(base + b * 6u, j); }
fn code_scale(base: u32, b: u32) -> vec2<f32> { return unpack2x16float(w[base + b * 6u]); }`,
  [GgmlType.Q8_0]: `
fn code_word(base: u32, b: u32, j: u32) -> u32 { return w[base + b * 9u + 1u + j]; }
fn code_scale(base: u32, b: u32) -> vec2<f32> { return vec2<f32>(f16lo(w[base + b * 9u]), 0.0); }`,
  // Sub-block s (0..7) of a 256-element block: the low (s even) or high nibbles of qs[32·(s/2) ..].
  [GgmlType.Q4_K]: `
fn code_word(base: u32, b: u32, j: u32) -> u32 {
  let s = b % 8u;
  return (w[base + (b / 8u) * 36u + 4u + 8u * (s / 2u) + j] >> (4u * (s % 2u))) & 0x0f0f0f0fu;
}
fn code_scale(base: u32, b: u32) -> vec2<f32> {
  let wb = base + (b / 8u) * 36u;
  let dm = unpack2x16float(w[wb]);
  let sm = scale_min_k4(wb, b % 8u);
  return vec2<f32>(dm.x * sm.x, -dm.y * sm.y);
}`,
  // Q5_K: as Q4_K (qs at words 12..43), plus the fifth bit of element l of sub-block s in bit s of qh[l] (words 4..11).
  [GgmlType.Q5_K]: `
fn code_word(base: u32, b: u32, j: u32) -> u32 {
  let s = b % 8u;
  let wb = base + (b / 8u) * 44u;
  let q = (w[wb + 12u + 8u * (s / 2u) + j] >> (4u * (s % 2u))) & 0x0f0f0f0fu;
  return q | (((w[wb + 4u + j] >> s) & 0x01010101u) << 4u);
}
fn code_scale(base: u32, b: u32) -> vec2<f32> {
  let wb = base + (b / 8u) * 44u;
  let dm = unpack2x16float(w[wb]);
  let sm = scale_min_k4(wb, b % 8u);
  return vec2<f32>(dm.x * sm.x, -dm.y * sm.y);
}`,
  // Q6_K (repacked to 53 words per 256, kernels/weights.ts): sub-block s = 4n + g of a 256-element block takes the
  // low (g < 2) or high nibbles of ql[64n + 32·(g % 2) ..], bits 2g.. of qh[32n ..], codes q - 32; its two halves of
  // 16 have their own int8 scales sc[2s], sc[2s + 1]: code_scale is (d·sc[2s], d·sc[2s + 1]), not (s, m).
  [GgmlType.Q6_K]: `
fn code_word(base: u32, b: u32, j: u32) -> u32 {
  let s = b % 8u;
  let wb = base + (b / 8u) * 53u;
  let lo = (w[wb + 16u * (s / 4u) + 8u * (s % 2u) + j] >> (4u * ((s % 4u) / 2u))) & 0x0f0f0f0fu;
  let hi = (w[wb + 32u + 8u * (s / 4u) + j] >> (2u * (s % 4u))) & 0x03030303u;
  return (((lo | (hi << 4u)) | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
}
fn code_scale(base: u32, b: u32) -> vec2<f32> {
  let s = b % 8u;
  let wb = base + (b / 8u) * 53u;
  let pair = w[wb + 48u + s / 2u] >> (16u * (s % 2u));
  return f16lo(w[wb + 52u]) * vec2<f32>(f32(bitcast<i32>(pair << 24u) >> 24u), f32(bitcast<i32>(pair << 16u) >> 24u));
}`,
};

/**
 * Types whose 32-element blocks have two scales, one per half of 16 (code_scale gives both): only the dot4I8Packed
 * kernel sums the halves apart; a tensor-core product covers the whole block.
 */
const HALF_BLOCK_SCALES: ReadonlySet<GgmlType> = new Set([GgmlType.Q6_K]);

/** Q5_0/Q5_1 block at word wb: the 5-bit values of elements 4j..4j+3, one per byte. */
const Q5_WORD = `
fn q5_word(wb: u32, j: u32) -> u32 {
  let q = (w[wb + 2u + (j & 3u)] >> select(0u, 4u, j >= 4u)) & 0x0f0f0f0fu;
  let bits = (w[wb + 1u] >> (4u * j)) & 15u;
  return q | (((bits & 1u) | ((bits & 2u) << 7u) | ((bits & 4u) << 14u) | ((bits & 8u) << 21u)) << 4u);
}`;

/**
 * What both int8 matmuls declare: their parameters and bindings (the activation codes as `codes` of
 * `codesElement`, 4 per word), the weight decoding helpers and the type's `code_word`/`code_scale`.
 */
function int8MatmulHeaderWgsl(type: GgmlType, hasBias: boolean, codesElement: 'i32' | 'u32'): string {
  const code = CODE_WGSL[type];
  if (!code) throw new Error(`int8 matmul: no int8 codes for weight type ${type}`);
  return `
struct Params { K: u32, rows: u32, tokens: u32, rowWords: u32, firstRow: u32, outStride: u32, _p0: u32, _p1: u32 }
@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> codes: array<${codesElement}>;
@group(0) @binding(2) var<storage, read> scales: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> params: Params;
${hasBias ? '@group(0) @binding(5) var<storage, read> bias: array<f32>;' : ''}
${weightDecodeWgsl()}
${type === GgmlType.Q5_0 || type === GgmlType.Q5_1 ? Q5_WORD : ''}
${code}
`;
}

/** s·d·C + m·(d·Σq) of an integer sum C, the weight block's (s, m) and the activation block's (d, d·Σq). */
function scaledSumWgsl(sum: string, weightScales: string, activationScales: string, withMin: boolean): string {
  const scaled = `f32(${sum}) * (${weightScales}.x * ${activationScales}.x)`;
  return withMin ? `${scaled} + ${weightScales}.y * ${activationScales}.y` : scaled;
}

/** The store of output `acc[a]` (row `col`, element `at` of y), plus its bias, added to y when accumulating. */
function int8StoreWgsl(hasBias: boolean, accumulate: boolean): string {
  return storeWgsl('y[at]', 'acc[a]', hasBias ? 'bias[col]' : null, accumulate);
}

/**
 * Weight types an int8 kernel reads. Q6_K only on 'dot4': its 16-element scales split a tensor core's 32-deep product,
 * and its codes times those scales do not fit 8 bits.
 */
export function int8MatmulSupportsType(type: GgmlType, variant: Int8MatmulVariant): boolean {
  return CODE_WGSL[type] !== undefined && (variant === 'dot4' || !HALF_BLOCK_SCALES.has(type));
}

/**
 * A workgroup of 4 subgroups of 32 invocations (the kernel assumes that subgroup size) in a `subgroupsAlongRows` x
 * (4 / subgroupsAlongRows) grid; each subgroup computes `tilesAlongRows` x `tilesAlongTokens` 16x16 output tiles.
 */
export interface Int8MatmulTile {
  subgroupsAlongRows: 1 | 2 | 4;
  tilesAlongRows: number;
  tilesAlongTokens: number;
}

/**
 * The tensor-core tiles. Measured on a large GPU (bench/int8-matmul.ts;
 * bench/results/2026-11-30-nvidia-h200-session11-int8-matmul-schedules.txt,
 * bench/results/2026-12-01-nvidia-h200-session12-int8-matmul-dot4.json): 32x32 is the faster tile over 128 tokens and
 * for Q4_K weights; 64x64 beat it over 512 tokens for the other types, but dot4I8Packed beat both there
 * (defaultInt8Variant no longer picks 64x64; it stays selectable and tested). Tiles of 64x32, a one-barrier schedule
 * (double-buffered sums: 32 KiB of workgroup memory for 64x64) and two blocks per barrier pair were slower.
 */
export const INT8_MATMUL_TILES = {
  '64x64': { subgroupsAlongRows: 2, tilesAlongRows: 2, tilesAlongTokens: 2 },
  '32x32': { subgroupsAlongRows: 2, tilesAlongRows: 1, tilesAlongTokens: 1 },
} as const satisfies Record<string, Int8MatmulTile>;
/** A tensor-core tile, or 'dot4': the kernel on dot4I8Packed that every adapter runs (int8DotMatmulWgsl). */
export type Int8MatmulVariant = keyof typeof INT8_MATMUL_TILES | 'dot4';

/** Weight rows and tokens of one workgroup's output tile. */
export function int8TileShape(tile: Int8MatmulTile): { rows: number; tokens: number } {
  return {
    rows: tile.subgroupsAlongRows * tile.tilesAlongRows * 16,
    tokens: (4 / tile.subgroupsAlongRows) * tile.tilesAlongTokens * 16,
  };
}

/** Bytes of workgroup memory the kernel declares: codes, two buffers of scales, the integer sums. */
export function int8WorkgroupBytes(tile: Int8MatmulTile): number {
  const { rows, tokens } = int8TileShape(tile);
  return (rows + tokens) * (32 + 2 * 8) + 4 * tile.tilesAlongRows * tile.tilesAlongTokens * 1024;
}

/**
 * acc += s·d·C + m·(d·Σq) for the step's block, from its integer sums and its scales (buffer `scaleBuffer`) in
 * workgroup memory; `withMin`: the weight type has a min (m != 0).
 */
function applyWgsl(scaleBuffer: string, withMin: boolean): string {
  const term = scaledSumWgsl('sums[tileBase + (2u * r + h) * 16u + c]', 'ws[r]', 's', withMin);
  return `let scaleSlot = ${scaleBuffer};
    for (var i = 0u; i < SN; i++) {
      var ws: array<vec2<f32>, 8>;
      for (var r = 0u; r < 8u; r++) { ws[r] = wscales[scaleSlot * RN + (sn * SN + i) * 16u + 2u * r + h]; }
      for (var j = 0u; j < ST; j++) {
        let s = xscales[scaleSlot * RT + (st * ST + j) * 16u + c];
        let tileBase = (sg * TILES + i * ST + j) * 256u;
        for (var r = 0u; r < 8u; r++) {
          let a = (i * ST + j) * 8u + r;
          acc[a] += ${term};
        }
      }
    }`;
}

/** Types whose blocks have no min (w = s·c): their outputs skip the m·(d·Σq) term. */
const WITHOUT_MIN: ReadonlySet<GgmlType> = new Set([GgmlType.Q4_0, GgmlType.Q5_0, GgmlType.Q8_0]);

export function int8MatmulWgsl(type: GgmlType, hasBias: boolean, tile: Int8MatmulTile, accumulate = false): string {
  const GN = tile.subgroupsAlongRows;
  const SN = tile.tilesAlongRows;
  const ST = tile.tilesAlongTokens;
  const { rows: RN, tokens: RT } = int8TileShape(tile);
  // Activation rows are padded to 64 tokens; staging gives each of the 128 invocations whole words of codes and at
  // most one token's scales.
  if (RT > INT8_TOKEN_PADDING || (RN * 8) % 128 !== 0 || (RT * 8) % 128 !== 0) {
    throw new Error(`int8 matmul: a ${RN}x${RT} tile does not fit the staging of 128 invocations and 64-token rows`);
  }
  if (HALF_BLOCK_SCALES.has(type)) {
    throw new Error(`int8 matmul: a tensor-core tile cannot scale half blocks (${GGML_TYPE_INFO[type]?.name})`);
  }
  const WPT = (RN * 8) / 128;
  const XPT = (RT * 8) / 128;
  const withMin = !WITHOUT_MIN.has(type);
  return /* wgsl */ `
enable chromium_experimental_subgroup_matrix;
enable subgroups;
diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);
${int8MatmulHeaderWgsl(type, hasBias, 'i32')}
const GN: u32 = ${GN}u;       // subgroups along rows
const SN: u32 = ${SN}u;       // 16-row tiles per subgroup
const ST: u32 = ${ST}u;       // 16-token tiles per subgroup
const RN: u32 = ${RN}u;       // rows per workgroup
const RT: u32 = ${RT}u;       // tokens per workgroup
const WPT: u32 = ${WPT}u;     // weight code words each invocation stages per step
const XPT: u32 = ${XPT}u;     // activation code words each invocation stages per step
const TILES: u32 = SN * ST;
var<workgroup> wcodes: array<i32, ${RN * 8}>;          // [RN][32] int8 codes of the step's weight block
var<workgroup> xcodes: array<i32, ${RT * 8}>;          // [RT][32] int8 codes of the step's activation block
var<workgroup> wscales: array<vec2<f32>, ${2 * RN}>;   // [2][RN] (s, m) per row
var<workgroup> xscales: array<vec2<f32>, ${2 * RT}>;   // [2][RT] (d, d·Σq) per token
var<workgroup> sums: array<i32, ${4 * SN * ST * 256}>;  // [subgroup][tile][16][16] integer sums

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32, @builtin(subgroup_id) sg: u32,
        @builtin(subgroup_invocation_id) lane: u32) {
  let n0 = (wg.x + wg.y * nwg.x) * RN;
  if (n0 >= params.rows) { return; }
  let t0 = wg.z * RT;
  let sn = sg % GN;
  let st = sg / GN;
  let K = params.K;
  let blocks = K / 32u;
  // Lane (h, c) = (lane / 16, lane % 16) takes column c and the rows of parity h of each 16x16 tile: the two halves
  // of the subgroup read rows 16 words apart, in different banks.
  let h = lane / 16u;
  let c = lane % 16u;
  var acc: array<f32, ${SN * ST * 8}>;
  // Invocation li stages word li % 8 of weight rows and activation tokens (li + 128u) / 8: block b + 1's words are
  // loaded into registers while block b is multiplied, so the loads' latency overlaps it.
  let word = li % 8u;
  var wnext: array<u32, WPT>;
  // Scales of the 8 blocks from b (b a multiple of 8), invocation word holding block b + word's: computed once per
  // 8 steps by all 8 invocations of a row, not every step by one (Q4_K's 6-bit scales take a dozen operations).
  var sahead: array<vec2<f32>, WPT>;
  var xnext: array<i32, XPT>;
  var xsnext = vec2<f32>(0.0);
  // Step b (1..blocks) stages block m = b - 1 (its scales into buffer m % 2), loads block b into registers, and
  // between two barriers multiplies block m into the integer sums, then applies its scales. A subgroup still
  // applying block m's scales when another stages block m + 1 is why the scales have two buffers; the codes and
  // sums are rewritten only after the barrier every subgroup reaches once done with them.
  for (var b = 0u; b <= blocks; b++) {
    if (b > 0u) {
      let scaleBuffer = (b - 1u) % 2u;
      for (var u = 0u; u < WPT; u++) {
        wcodes[li + u * 128u] = bitcast<i32>(wnext[u]);
        if (word == (b - 1u) % 8u) { wscales[scaleBuffer * RN + (li + u * 128u) / 8u] = sahead[u]; }
      }
      for (var u = 0u; u < XPT; u++) { xcodes[li + u * 128u] = xnext[u]; }
      if (li < RT) { xscales[scaleBuffer * RT + li] = xsnext; }
    }
    if (b < blocks) {
      for (var u = 0u; u < WPT; u++) {
        let base = min(n0 + (li + u * 128u) / 8u, params.rows - 1u) * params.rowWords;
        wnext[u] = code_word(base, b, word);
        if (b % 8u == 0u && b + word < blocks) { sahead[u] = code_scale(base, b + word); }
      }
      for (var u = 0u; u < XPT; u++) {
        xnext[u] = codes[(t0 + (li + u * 128u) / 8u) * (K / 4u) + b * 8u + word];
      }
      if (li < RT) { xsnext = scales[(t0 + li) * blocks + b]; }
    }
    if (b == 0u) { continue; }
    workgroupBarrier();
    for (var i = 0u; i < SN; i++) {
      // Offsets and strides count the arrays' i32 words: 8 per row of 32 codes.
      let left = subgroupMatrixLoad<subgroup_matrix_left<i8, 32, 16>, row_major>(
        &wcodes, (sn * SN + i) * 16u * 8u, 8u);
      for (var j = 0u; j < ST; j++) {
        let right = subgroupMatrixLoad<subgroup_matrix_right<i8, 16, 32>, col_major>(
          &xcodes, (st * ST + j) * 16u * 8u, 8u);
        let product = subgroupMatrixMultiply<i32>(left, right);
        subgroupMatrixStore<row_major>(&sums, (sg * TILES + i * ST + j) * 256u, product, 16u);
      }
    }
    workgroupBarrier();
    ${applyWgsl('(b - 1u) % 2u', withMin)}
  }
  for (var i = 0u; i < SN; i++) {
    for (var j = 0u; j < ST; j++) {
      let t = t0 + (st * ST + j) * 16u + c;
      for (var r = 0u; r < 8u; r++) {
        let n = n0 + (sn * SN + i) * 16u + 2u * r + h;
        if (n < params.rows && t < params.tokens) {
          let a = (i * ST + j) * 8u + r;
          let col = params.firstRow + n;
          let at = t * params.outStride + col;
          ${int8StoreWgsl(hasBias, accumulate)}
        }
      }
    }
  }
}
`;
}

/** Rows and tokens of the dot4I8Packed kernel's workgroup tile (16 x 16 invocations, 4 x 4 outputs each). */
const INT8_DOT_TILE = { rows: 64, tokens: 64 } as const;

/** Weight rows and tokens of one workgroup's output tile, for either kernel. */
export function int8VariantShape(variant: Int8MatmulVariant): { rows: number; tokens: number } {
  const shape = variant === 'dot4' ? INT8_DOT_TILE : int8TileShape(INT8_MATMUL_TILES[variant]);
  if (shape.tokens > INT8_TOKEN_PADDING) {
    throw new Error(`int8 matmul: ${shape.tokens}-token tiles read past activations padded to ${INT8_TOKEN_PADDING}`);
  }
  return shape;
}

/** The WGSL of either int8 kernel: a tensor-core tile, or 'dot4'. */
export function int8VariantWgsl(
  type: GgmlType,
  variant: Int8MatmulVariant,
  hasBias: boolean,
  accumulate = false,
): string {
  return variant === 'dot4'
    ? int8DotMatmulWgsl(type, hasBias, accumulate)
    : int8MatmulWgsl(type, hasBias, INT8_MATMUL_TILES[variant], accumulate);
}

/**
 * How the dot4I8Packed kernel walks K: 32-deep blocks staged `blocksPerStage` at a time between a barrier pair.
 * Measured on a large GPU over 1024 tokens (bench/int8-matmul.ts --schedules;
 * bench/results/2026-12-01-nvidia-h200-session20-kernel-experiments.txt): 2 blocks
 * were faster than 1 at every shape of Qwen3-4B and Llama-3.2-1B; 4 blocks (twice the workgroup memory again),
 * 128-token tiles (8 tokens an invocation) and the next stage's loads issued before the products were slower.
 */
export interface Dot4Schedule {
  blocksPerStage: 1 | 2;
}

export const DOT4_SCHEDULE: Dot4Schedule = { blocksPerStage: 2 };

/**
 * The same int8 matmul without tensor cores, on core WGSL's `dot4I8Packed` (four 8-bit products and their sum in one
 * instruction): every adapter runs it. Per stage of 32-deep blocks (Dot4Schedule), the workgroup stages its 64 rows'
 * weight codes and its 64 tokens' activation codes (8 words a block each, rows padded by a word so 16 consecutive
 * rows fall in different banks) with the blocks' scale pairs; invocation (tx, ty) takes rows tx + 16·i and tokens
 * ty + 16·j, sums 8 dot4I8Packed per output and block into an integer and adds s·d·C + m·(d·Σq) to its f32
 * accumulator.
 */
export function int8DotMatmulWgsl(
  type: GgmlType,
  hasBias: boolean,
  accumulate = false,
  schedule: Dot4Schedule = DOT4_SCHEDULE,
): string {
  const withMin = !WITHOUT_MIN.has(type);
  const halves = HALF_BLOCK_SCALES.has(type);
  const B = schedule.blocksPerStage;
  const STAGE_WORDS = 8 * B; // code words of a row (or token) per stage
  const PER_INVOCATION = (64 * STAGE_WORDS) / 256; // words of each operand an invocation stages
  // The products of words k0..k1 of the stage's block `blk` into the integer sums `into`.
  const products = (into: string, blk: number, k0: number, k1: number) => `
      for (var k = ${8 * blk + k0}u; k < ${8 * blk + k1}u; k++) {
        var wv: array<u32, 4>;
        var xv: array<u32, 4>;
        for (var i = 0u; i < 4u; i++) {
          wv[i] = wcodes[(lid.x + 16u * i) * ROW_WORDS + k];
          xv[i] = xcodes[(lid.y + 16u * i) * ROW_WORDS + k];
        }
        for (var i = 0u; i < 4u; i++) {
          for (var j = 0u; j < 4u; j++) { ${into}[i * 4u + j] += dot4I8Packed(wv[i], xv[j]); }
        }
      }`;
  // Half-block scales (ws = (s of elements 0..15, s of 16..31)): d·(s0·C0 + s1·C1), no min.
  const term = halves
    ? 's.x * (ws.x * f32(sums[i * 4u + j]) + ws.y * f32(high[i * 4u + j]))'
    : scaledSumWgsl('sums[i * 4u + j]', 'ws', 's', withMin);
  const block = (blk: number) => `
    if (b0 + ${blk}u < blocks) {
      // Initialized explicitly: a declaration without one was not zeroed again on each iteration (lavapipe).
      var sums = array<i32, 16>();${
        halves
          ? `
      var high = array<i32, 16>();${products('sums', blk, 0, 4)}${products('high', blk, 4, 8)}`
          : products('sums', blk, 0, 8)
      }
      for (var i = 0u; i < 4u; i++) {
        let ws = wscales[${64 * blk}u + lid.x + 16u * i];
        for (var j = 0u; j < 4u; j++) {
          let s = xscales[${64 * blk}u + lid.y + 16u * j];
          acc[i * 4u + j] += ${term};
        }
      }
    }`;
  return /* wgsl */ `${int8MatmulHeaderWgsl(type, hasBias, 'u32')}
const ROW_WORDS: u32 = ${STAGE_WORDS + 1}u;  // ${STAGE_WORDS} words of codes per row or token, padded
var<workgroup> wcodes: array<u32, ${64 * (STAGE_WORDS + 1)}>;
var<workgroup> xcodes: array<u32, ${64 * (STAGE_WORDS + 1)}>;
var<workgroup> wscales: array<vec2<f32>, ${64 * B}>;  // [block][row]
var<workgroup> xscales: array<vec2<f32>, ${64 * B}>;  // [block][token]

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
  let n0 = (wg.x + wg.y * nwg.x) * 64u;
  if (n0 >= params.rows) { return; }
  let t0 = wg.z * 64u;
  let K = params.K;
  let blocks = K / 32u;
  var acc: array<f32, 16>;  // [i][j]: row tx + 16i, token ty + 16j
  for (var b0 = 0u; b0 < blocks; b0 += ${B}u) {
    // Word li + 256·u of each operand's 64 rows of STAGE_WORDS, and scale pair li % 64B of the weights (li < 64B)
    // or of the activations (li < 128B). Blocks past K (an odd count in stages of 2) read the last block again; their
    // products are skipped.
    for (var u = 0u; u < ${PER_INVOCATION}u; u++) {
      let q = li + 256u * u;
      let r = q / ${STAGE_WORDS}u;
      let blk = min(b0 + (q % ${STAGE_WORDS}u) / 8u, blocks - 1u);
      let word = q % 8u;
      wcodes[r * ROW_WORDS + q % ${STAGE_WORDS}u] = code_word(min(n0 + r, params.rows - 1u) * params.rowWords, blk, word);
      xcodes[r * ROW_WORDS + q % ${STAGE_WORDS}u] = codes[(t0 + r) * (K / 4u) + blk * 8u + word];
    }
    {
      let slot = li % ${64 * B}u;
      let blk = min(b0 + slot / 64u, blocks - 1u);
      if (li < ${64 * B}u) {
        wscales[slot] = code_scale(min(n0 + slot % 64u, params.rows - 1u) * params.rowWords, blk);
      } else if (li < ${128 * B}u) {
        xscales[slot] = scales[(t0 + slot % 64u) * blocks + blk];
      }
    }
    workgroupBarrier();${Array.from({ length: B }, (_, blk) => block(blk)).join('')}
    workgroupBarrier();
  }
  for (var i = 0u; i < 4u; i++) {
    for (var j = 0u; j < 4u; j++) {
      let n = n0 + lid.x + 16u * i;
      let t = t0 + lid.y + 16u * j;
      if (n < params.rows && t < params.tokens) {
        let a = i * 4u + j;
        let col = params.firstRow + n;
        let at = t * params.outStride + col;
        ${int8StoreWgsl(hasBias, accumulate)}
      }
    }
  }
}
`;
}
