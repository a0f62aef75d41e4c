/**
 * WGSL for weight matrices in the packed layout of kernels/weights.ts (read as `array<u32>` named `w`; kernels over
 * several weights rename it `w0`, `w1`, ... with `dotForWeight`).
 *
 * Every type provides two functions:
 * - `dq4(base, k) -> vec4<f32>`: elements k..k+3 (k a multiple of 4) of the row whose first word is `base`.
 *   Dense types may read past the row end when K % 4 != 0; callers mask those lanes.
 * - `unit_dot(base, u, xb) -> f32`: the dot product of matvec unit `u` of the row with x, element 0 of the row at x
 *   index xb. A unit is the span of weight words one thread reads at once (quants plus the block's scales; Q4_K's
 *   is 4 words of quants). Units per block: `matvecUnitsPerBlock`; dense types use one unit per word and may index x
 *   directly, quantized types read x only through `xv(i)` with i a multiple of 4 (see matvecInputWgsl).
 */
import { UnsupportedModelError } from '../core/errors.ts';
import { GGML_TYPE_INFO, GgmlType, IQ4_NL_LEVELS } from '../core/gguf-types.ts';
import { type GatedActivation, gatedExpression } from './elementwise.wgsl.ts';

/** IQ4_NL_LEVELS as 4 words of 4 int8 each (level q is byte q % 4 of word q / 4). */
const iq4LevelWords = [0, 1, 2, 3].map((i) =>
  IQ4_NL_LEVELS.slice(4 * i, 4 * i + 4).reduce((word, level, b) => word + (level & 255) * 2 ** (8 * b), 0),
);

const common = /* wgsl */ `
fn bytes4(v: u32) -> vec4<f32> {
  return vec4<f32>(f32(v & 255u), f32((v >> 8u) & 255u), f32((v >> 16u) & 255u), f32(v >> 24u));
}
fn sbytes4(v: u32) -> vec4<f32> {
  return vec4<f32>(f32(bitcast<i32>(v << 24u) >> 24u), f32(bitcast<i32>(v << 16u) >> 24u),
                   f32(bitcast<i32>(v << 8u) >> 24u), f32(bitcast<i32>(v) >> 24u));
}
fn f16lo(v: u32) -> f32 { return unpack2x16float(v).x; }
fn bf16x2(v: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(v << 16u), bitcast<f32>(v & 0xffff0000u)); }
fn sbyte(v: u32, i: u32) -> f32 { return f32(bitcast<i32>(v << (24u - 8u * i)) >> 24u); }
fn bits4(v: u32) -> vec4<f32> {
  return vec4<f32>(f32(v & 1u), f32((v >> 1u) & 1u), f32((v >> 2u) & 1u), f32((v >> 3u) & 1u));
}
// The 6-bit scales and mins of sub-blocks 2c and 2c+1 of a Q4_K block whose first 4 words are h (d and dmin, then
// the 12 scale bytes): (scale 2c, scale 2c+1, min 2c, min 2c+1). The same values as scale_min_k4, from words
// already loaded and without its branch (a warp's lanes hold different c).
fn k4_scales(h: vec4<u32>, c: u32) -> vec4<f32> {
  let upper = c >= 2u;
  let sc = select(h.y & 0x3f3f3f3fu, (h.w & 0x0f0f0f0fu) | ((h.y >> 2u) & 0x30303030u), upper);
  let mn = select(h.z & 0x3f3f3f3fu, ((h.w >> 4u) & 0x0f0f0f0fu) | ((h.z >> 2u) & 0x30303030u), upper);
  let sh = 16u * (c % 2u);
  return vec4<f32>(f32((sc >> sh) & 255u), f32((sc >> (sh + 8u)) & 255u), f32((mn >> sh) & 255u),
                   f32((mn >> (sh + 8u)) & 255u));
}
// The IQ4_NL levels of the 4 codes in the low nibbles of v's bytes (the table as 4 words of int8, picked by shifts
// rather than an indexed array, which some compilers put in slow local memory).
fn iq4_level(q: u32) -> f32 {
  let table = vec4<u32>(${iq4LevelWords.map((v) => `0x${v.toString(16).padStart(8, '0')}u`).join(', ')});
  return sbyte(table[q >> 2u], q & 3u);
}
fn iq4_levels(v: u32) -> vec4<f32> {
  return vec4<f32>(iq4_level(v & 15u), iq4_level((v >> 8u) & 15u), iq4_level((v >> 16u) & 15u),
                   iq4_level((v >> 24u) & 15u));
}
// The scale (6 bits, minus 32) of sub-block s of a Q3_K block whose 12 scale bytes are the words a, b, c: the low
// nibble of byte s % 8 (its high nibble for s >= 8), the high 2 bits from bits 2(s / 4) of byte 8 + s % 4.
fn q3k_scale(a: u32, b: u32, c: u32, s: u32) -> f32 {
  let low = (select(a, b, s % 8u >= 4u) >> (8u * (s % 4u) + 4u * (s / 8u))) & 15u;
  let high = (c >> (8u * (s % 4u) + 2u * (s / 4u))) & 3u;
  return f32(low | (high << 4u)) - 32.0;
}
`;

/** The helpers that read the weight words `w` (renamed per weight by `dotForWeight` in multi-weight kernels). */
const weightHelpers = /* wgsl */ `
// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (12 bytes at words base+1..base+3).
fn kbyte(base: u32, i: u32) -> u32 { return (w[base + 1u + i / 4u] >> (8u * (i % 4u))) & 255u; }
fn scale_min_k4(base: u32, j: u32) -> vec2<f32> {
  if (j < 4u) {
    return vec2<f32>(f32(kbyte(base, j) & 63u), f32(kbyte(base, j + 4u) & 63u));
  }
  let sc = (kbyte(base, j + 4u) & 15u) | ((kbyte(base, j - 4u) >> 6u) << 4u);
  let m = (kbyte(base, j + 4u) >> 4u) | ((kbyte(base, j) >> 6u) << 4u);
  return vec2<f32>(f32(sc), f32(m));
}
`;

/**
 * The matvec input x at `binding` and `xv(i)`, its elements i..i+3. Quantized types' dot products read x only
 * through xv at multiples of 4 (their blocks are multiples of 32), so x is bound as vec4s: one load instead of four.
 * Dense types read single elements of rows of any length, so x stays scalar for them.
 */
function matvecInputWgsl(binding: number, vec4: boolean): string {
  const input = vec4
    ? `@group(0) @binding(${binding}) var<storage, read> x: array<vec4<f32>>;
fn xv(i: u32) -> vec4<f32> { return x[i >> 2u]; }`
    : `@group(0) @binding(${binding}) var<storage, read> x: array<f32>;
fn xv(i: u32) -> vec4<f32> { return vec4<f32>(x[i], x[i + 1u], x[i + 2u], x[i + 3u]); }`;
  return `${input}
fn hsum(v: vec4<f32>) -> f32 { return v.x + v.y + v.z + v.w; }
`;
}

/** Dense weight types (F32, F16, BF16): matvec units are single words, and x is read element by element. */
export function isDenseMatvecType(type: GgmlType): boolean {
  return typeWgsl(type).units === 0;
}

/** Whether a matvec over these weight types reads x as vec4s (all quantized: see matvecInputWgsl). */
export function matvecReadsVec4(types: readonly GgmlType[]): boolean {
  return !types.some(isDenseMatvecType);
}

/**
 * Threads per matvec workgroup for rows of `unitsPerRow` units: 128 (measured best on a large GPU for long rows); a row
 * of fewer units gets the whole warps (32) that cover it, one unit each. Measured
 * (bench/results/2026-11-30-nvidia-h200-session10-matvec-threads.md): Qwen3-4B's rows of 2,560 are 80 Q4_K units, and
 * 96 threads ran them faster than the 64 of the earlier power-of-two rule, whose second round of units had 16 of 64
 * threads busy.
 */
export function matvecThreads(unitsPerRow: number): number {
  return Math.min(128, 32 * Math.max(1, Math.ceil(unitsPerRow / 32)));
}

interface TypeWgsl {
  /** Units per block for matvec (dense types: 0, one unit per word). */
  units: number;
  dq4: string;
  dot: string;
  /**
   * The matvec reads the weight as `array<vec4<u32>>` (`unit_dot` still gets `base` in u32 words): for blocks that
   * are whole vec4s, so a unit's words come in a few 16-byte loads, each bounds-checked once.
   */
  vec4Words?: boolean;
}

const TYPE_WGSL: Partial<Record<GgmlType, TypeWgsl>> = {
  [GgmlType.F32]: {
    units: 0,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let i = base + k;
  return bitcast<vec4<f32>>(vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]));
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 { return bitcast<f32>(w[base + u]) * x[xb + u]; }`,
  },
  [GgmlType.F16]: {
    units: 0,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let i = base + k / 2u;
  return vec4<f32>(unpack2x16float(w[i]), unpack2x16float(w[i + 1u]));
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let v = unpack2x16float(w[base + u]);
  let k = 2u * u;
  return v.x * x[xb + k] + select(0.0, v.y * x[xb + k + 1u], k + 1u < params.K);
}`,
  },
  [GgmlType.BF16]: {
    units: 0,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let i = base + k / 2u;
  return vec4<f32>(bf16x2(w[i]), bf16x2(w[i + 1u]));
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let v = bf16x2(w[base + u]);
  let k = 2u * u;
  return v.x * x[xb + k] + select(0.0, v.y * x[xb + k + 1u], k + 1u < params.K);
}`,
  },
  // Q4_0: 5 words; element e < 16 is the low nibble of qs[e], element e >= 16 the high nibble of qs[e-16].
  [GgmlType.Q4_0]: {
    units: 4,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 32u) * 5u;
  let e = k % 32u;
  let q = (w[wb + 1u + (e % 16u) / 4u] >> select(0u, 4u, e >= 16u)) & 0x0f0f0f0fu;
  return f16lo(w[wb]) * (bytes4(q) - 8.0);
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 4u; let j = u % 4u;
  let wb = base + b * 5u; let xk = xb + b * 32u + 4u * j;
  let q = w[wb + 1u + j];
  let lo = bytes4(q & 0x0f0f0f0fu) - 8.0;
  let hi = bytes4((q >> 4u) & 0x0f0f0f0fu) - 8.0;
  return f16lo(w[wb]) * (dot(lo, xv(xk)) + dot(hi, xv(xk + 16u)));
}`,
  },
  [GgmlType.Q4_1]: {
    units: 4,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 32u) * 5u;
  let e = k % 32u;
  let q = (w[wb + 1u + (e % 16u) / 4u] >> select(0u, 4u, e >= 16u)) & 0x0f0f0f0fu;
  let dm = unpack2x16float(w[wb]);
  return dm.x * bytes4(q) + dm.y;
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 4u; let j = u % 4u;
  let wb = base + b * 5u; let xk = xb + b * 32u + 4u * j;
  let q = w[wb + 1u + j];
  let dm = unpack2x16float(w[wb]);
  let xa = xv(xk); let xc = xv(xk + 16u);
  return dm.x * (dot(bytes4(q & 0x0f0f0f0fu), xa) + dot(bytes4((q >> 4u) & 0x0f0f0f0fu), xc)) + dm.y * (hsum(xa) + hsum(xc));
}`,
  },
  // Q5_0/Q5_1: the fifth bit of element e (0..31) is bit e of qh.
  [GgmlType.Q5_0]: {
    units: 4,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 32u) * 6u;
  let e = k % 32u;
  let q = (w[wb + 2u + (e % 16u) / 4u] >> select(0u, 4u, e >= 16u)) & 0x0f0f0f0fu;
  return f16lo(w[wb]) * (bytes4(q) + 16.0 * bits4(w[wb + 1u] >> e) - 16.0);
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 4u; let j = u % 4u;
  let wb = base + b * 6u; let xk = xb + b * 32u + 4u * j;
  let q = w[wb + 2u + j]; let qh = w[wb + 1u];
  let lo = bytes4(q & 0x0f0f0f0fu) + 16.0 * bits4(qh >> (4u * j)) - 16.0;
  let hi = bytes4((q >> 4u) & 0x0f0f0f0fu) + 16.0 * bits4(qh >> (16u + 4u * j)) - 16.0;
  return f16lo(w[wb]) * (dot(lo, xv(xk)) + dot(hi, xv(xk + 16u)));
}`,
  },
  [GgmlType.Q5_1]: {
    units: 4,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 32u) * 6u;
  let e = k % 32u;
  let q = (w[wb + 2u + (e % 16u) / 4u] >> select(0u, 4u, e >= 16u)) & 0x0f0f0f0fu;
  let dm = unpack2x16float(w[wb]);
  return dm.x * (bytes4(q) + 16.0 * bits4(w[wb + 1u] >> e)) + dm.y;
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 4u; let j = u % 4u;
  let wb = base + b * 6u; let xk = xb + b * 32u + 4u * j;
  let q = w[wb + 2u + j]; let qh = w[wb + 1u];
  let dm = unpack2x16float(w[wb]);
  let lo = bytes4(q & 0x0f0f0f0fu) + 16.0 * bits4(qh >> (4u * j));
  let hi = bytes4((q >> 4u) & 0x0f0f0f0fu) + 16.0 * bits4(qh >> (16u + 4u * j));
  let xa = xv(xk); let xc = xv(xk + 16u);
  return dm.x * (dot(lo, xa) + dot(hi, xc)) + dm.y * (hsum(xa) + hsum(xc));
}`,
  },
  [GgmlType.Q8_0]: {
    units: 8,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 32u) * 9u;
  return f16lo(w[wb]) * sbytes4(w[wb + 1u + (k % 32u) / 4u]);
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 8u; let j = u % 8u;
  let wb = base + b * 9u;
  return f16lo(w[wb]) * dot(sbytes4(w[wb + 1u + j]), xv(xb + b * 32u + 4u * j));
}`,
  },
  // Q4_K: 64-element chunk c uses qs[32c..32c+31]: low nibbles are sub-block 2c, high nibbles sub-block 2c+1.
  [GgmlType.Q4_K]: {
    units: 8,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 256u) * 36u;
  let e = k % 256u; let c = e / 64u; let r = e % 64u; let hi = r / 32u;
  let q = (w[wb + 4u + 8u * c + (r % 32u) / 4u] >> (4u * hi)) & 0x0f0f0f0fu;
  let dm = unpack2x16float(w[wb]);
  let sm = scale_min_k4(wb, 2u * c + hi);
  return dm.x * sm.x * bytes4(q) - dm.y * sm.y;
}`,
    // A unit is 4 words of qs (16 bytes, one vec4 of the 9 in a block): 16 low-nibble elements of sub-block 2c and
    // 16 high-nibble ones of 2c+1, so the block's scales are read once per 32 elements (once per 8 with one-word
    // units: a large GPU's matvec was bound by load instructions, not bytes;
    // bench/results/2026-11-30-nvidia-h200-session5-matvec-profile-f16-1k.txt). The header
    // vec4 holds d, dmin and scales.
    vec4Words: true,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 8u; let j = u % 8u; let c = j / 2u;
  let wb = base / 4u + b * 9u; let xk = xb + b * 256u + 64u * c + 16u * (j % 2u);
  let h = w[wb]; let q = w[wb + 1u + j];
  let dm = unpack2x16float(h.x);
  let s = k4_scales(h, c);
  let l0 = xv(xk); let l1 = xv(xk + 4u); let l2 = xv(xk + 8u); let l3 = xv(xk + 12u);
  let h0 = xv(xk + 32u); let h1 = xv(xk + 36u); let h2 = xv(xk + 40u); let h3 = xv(xk + 44u);
  let m = 0x0f0f0f0fu;
  let lo = dot(bytes4(q.x & m), l0) + dot(bytes4(q.y & m), l1) + dot(bytes4(q.z & m), l2) + dot(bytes4(q.w & m), l3);
  let hi = dot(bytes4((q.x >> 4u) & m), h0) + dot(bytes4((q.y >> 4u) & m), h1) + dot(bytes4((q.z >> 4u) & m), h2)
         + dot(bytes4((q.w >> 4u) & m), h3);
  return dm.x * (s.x * lo + s.y * hi) - dm.y * (s.z * hsum(l0 + l1 + l2 + l3) + s.w * hsum(h0 + h1 + h2 + h3));
}`,
  },
  // Q5_K: as Q4_K, plus the fifth bit of element l of chunk c in bit 2c (low nibble) or 2c+1 (high) of qh[l].
  [GgmlType.Q5_K]: {
    units: 32,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 256u) * 44u;
  let e = k % 256u; let c = e / 64u; let r = e % 64u; let hi = r / 32u; let l = r % 32u;
  let q = (w[wb + 12u + 8u * c + l / 4u] >> (4u * hi)) & 0x0f0f0f0fu;
  let h = (w[wb + 4u + l / 4u] >> (2u * c + hi)) & 0x01010101u;
  let dm = unpack2x16float(w[wb]);
  let sm = scale_min_k4(wb, 2u * c + hi);
  return dm.x * sm.x * (bytes4(q) + 16.0 * bytes4(h)) - dm.y * sm.y;
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 32u; let j = u % 32u; let c = j / 8u;
  let wb = base + b * 44u; let xk = xb + b * 256u + 64u * c + 4u * (j % 8u);
  let q = w[wb + 12u + j]; let qh = w[wb + 4u + j % 8u];
  let dm = unpack2x16float(w[wb]);
  let s1 = scale_min_k4(wb, 2u * c); let s2 = scale_min_k4(wb, 2u * c + 1u);
  let lo = bytes4(q & 0x0f0f0f0fu) + 16.0 * bytes4((qh >> (2u * c)) & 0x01010101u);
  let hi = bytes4((q >> 4u) & 0x0f0f0f0fu) + 16.0 * bytes4((qh >> (2u * c + 1u)) & 0x01010101u);
  let xa = xv(xk); let xc = xv(xk + 32u);
  return dm.x * (s1.x * dot(lo, xa) + s2.x * dot(hi, xc)) - dm.y * (s1.y * hsum(xa) + s2.y * hsum(xc));
}`,
  },
  // Q6_K: 128-element half n, quarter g: low 4 bits from ql[64n + 32(g&1) + l] (nibble g>>1),
  // high 2 bits from qh[32n + l] bits 2g..2g+1, scale scales[8n + 2g + l/16].
  [GgmlType.Q6_K]: {
    units: 16,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 256u) * 53u;
  let e = k % 256u; let n = e / 128u; let g = (e % 128u) / 32u; let l = e % 32u;
  let lo = (w[wb + 16u * n + 8u * (g & 1u) + l / 4u] >> (4u * (g >> 1u))) & 0x0f0f0f0fu;
  let hi = ((w[wb + 32u + 8u * n + l / 4u] >> (2u * g)) & 0x03030303u) << 4u;
  let s = 8u * n + 2u * g + l / 16u;
  return f16lo(w[wb + 52u]) * sbyte(w[wb + 48u + s / 4u], s % 4u) * (bytes4(lo | hi) - 32.0);
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 16u; let j = u % 16u; let n = j / 8u; let l4 = j % 8u;
  let wb = base + b * 53u; let xk = xb + b * 256u + 128u * n + 4u * l4;
  let qa = w[wb + 16u * n + l4]; let qb = w[wb + 16u * n + 8u + l4];
  let qh = w[wb + 32u + 8u * n + l4];
  let s = 8u * n + l4 / 4u;
  let sw = w[wb + 48u + s / 4u]; let sw2 = w[wb + 48u + (s + 4u) / 4u];
  let q1 = bytes4((qa & 0x0f0f0f0fu) | ((qh & 0x03030303u) << 4u)) - 32.0;
  let q2 = bytes4((qb & 0x0f0f0f0fu) | (((qh >> 2u) & 0x03030303u) << 4u)) - 32.0;
  let q3 = bytes4(((qa >> 4u) & 0x0f0f0f0fu) | (((qh >> 4u) & 0x03030303u) << 4u)) - 32.0;
  let q4 = bytes4(((qb >> 4u) & 0x0f0f0f0fu) | (((qh >> 6u) & 0x03030303u) << 4u)) - 32.0;
  return f16lo(w[wb + 52u]) * (sbyte(sw, s % 4u) * dot(q1, xv(xk)) + sbyte(sw, (s + 2u) % 4u) * dot(q2, xv(xk + 32u))
       + sbyte(sw2, s % 4u) * dot(q3, xv(xk + 64u)) + sbyte(sw2, (s + 2u) % 4u) * dot(q4, xv(xk + 96u)));
}`,
  },
  // Q2_K and Q3_K: element 128n + 32j + 16h + l is bits 2j..2j+1 of qs[32n + 16h + l] (qs words 8n + 4h + l/4), in
  // sub-block s = 8n + 2j + h. A unit is one qs word: 4 elements in each of the 4 sub-blocks j = 0..3.
  [GgmlType.Q2_K]: {
    units: 16,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 256u) * 21u;
  let e = k % 256u; let n = e / 128u; let j = (e % 128u) / 32u; let h = (e % 32u) / 16u; let l = e % 16u;
  let q = (w[wb + 4u + 8u * n + 4u * h + l / 4u] >> (2u * j)) & 0x03030303u;
  let s = 8u * n + 2u * j + h;
  let sc = (w[wb + s / 4u] >> (8u * (s % 4u))) & 255u;
  let dm = unpack2x16float(w[wb + 20u]);
  return dm.x * f32(sc & 15u) * bytes4(q) - dm.y * f32(sc >> 4u);
}`,
    // The unit's 4 sub-blocks 8n + h + 2j have their (scale, min) bytes at bytes h and h + 2 of scale words 2n and
    // 2n + 1.
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 16u; let v = u % 16u; let n = v / 8u; let h = (v % 8u) / 4u;
  let wb = base + b * 21u; let xk = xb + b * 256u + 128u * n + 16u * h + 4u * (v % 4u);
  let q = w[wb + 4u + v];
  let sa = w[wb + 2u * n] >> (8u * h); let sb = w[wb + 2u * n + 1u] >> (8u * h);
  let sc = vec4<f32>(f32(sa & 15u), f32((sa >> 16u) & 15u), f32(sb & 15u), f32((sb >> 16u) & 15u));
  let mn = vec4<f32>(f32((sa >> 4u) & 15u), f32((sa >> 20u) & 15u), f32((sb >> 4u) & 15u), f32((sb >> 20u) & 15u));
  let x0 = xv(xk); let x1 = xv(xk + 32u); let x2 = xv(xk + 64u); let x3 = xv(xk + 96u);
  let m = 0x03030303u;
  let qx = vec4<f32>(dot(bytes4(q & m), x0), dot(bytes4((q >> 2u) & m), x1), dot(bytes4((q >> 4u) & m), x2),
                     dot(bytes4((q >> 6u) & m), x3));
  let dm = unpack2x16float(w[wb + 20u]);
  return dm.x * dot(sc, qx) - dm.y * dot(mn, vec4<f32>(hsum(x0), hsum(x1), hsum(x2), hsum(x3)));
}`,
  },
  // Q3_K: as Q2_K, plus the third bit in bit 4n + j of hmask[16h + l] (words 4h + l/4): clear means q - 4.
  [GgmlType.Q3_K]: {
    units: 16,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 256u) * 28u;
  let e = k % 256u; let n = e / 128u; let j = (e % 128u) / 32u; let h = (e % 32u) / 16u; let l = e % 16u;
  let q = (w[wb + 8u + 8u * n + 4u * h + l / 4u] >> (2u * j)) & 0x03030303u;
  let hb = (w[wb + 4u * h + l / 4u] >> (4u * n + j)) & 0x01010101u;
  let sc = q3k_scale(w[wb + 24u], w[wb + 25u], w[wb + 26u], 8u * n + 2u * j + h);
  return f16lo(w[wb + 27u]) * sc * (bytes4(q) + 4.0 * bytes4(hb) - 4.0);
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 16u; let v = u % 16u; let n = v / 8u; let h = (v % 8u) / 4u;
  let wb = base + b * 28u; let xk = xb + b * 256u + 128u * n + 16u * h + 4u * (v % 4u);
  let q = w[wb + 8u + v]; let hm = w[wb + 4u * h + v % 4u] >> (4u * n);
  let sa = w[wb + 24u]; let sb = w[wb + 25u]; let sh = w[wb + 26u];
  let s = 8u * n + h;
  let sc = vec4<f32>(q3k_scale(sa, sb, sh, s), q3k_scale(sa, sb, sh, s + 2u), q3k_scale(sa, sb, sh, s + 4u),
                     q3k_scale(sa, sb, sh, s + 6u));
  let m = 0x03030303u; let one = 0x01010101u;
  let q0 = bytes4(q & m) + 4.0 * bytes4(hm & one) - 4.0;
  let q1 = bytes4((q >> 2u) & m) + 4.0 * bytes4((hm >> 1u) & one) - 4.0;
  let q2 = bytes4((q >> 4u) & m) + 4.0 * bytes4((hm >> 2u) & one) - 4.0;
  let q3 = bytes4((q >> 6u) & m) + 4.0 * bytes4((hm >> 3u) & one) - 4.0;
  return f16lo(w[wb + 27u]) * dot(sc, vec4<f32>(dot(q0, xv(xk)), dot(q1, xv(xk + 32u)), dot(q2, xv(xk + 64u)),
                                              dot(q3, xv(xk + 96u))));
}`,
  },
  // IQ4_NL: Q4_0's layout, a code picking one of the 16 IQ4_NL levels instead of q - 8.
  [GgmlType.IQ4_NL]: {
    units: 4,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 32u) * 5u;
  let e = k % 32u;
  return f16lo(w[wb]) * iq4_levels(w[wb + 1u + (e % 16u) / 4u] >> select(0u, 4u, e >= 16u));
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 4u; let j = u % 4u;
  let wb = base + b * 5u; let xk = xb + b * 32u + 4u * j;
  let q = w[wb + 1u + j];
  return f16lo(w[wb]) * (dot(iq4_levels(q), xv(xk)) + dot(iq4_levels(q >> 4u), xv(xk + 16u)));
}`,
  },
  // IQ4_XS: eight IQ4_NL sub-blocks of 32 (qs words 2 + 4b..), each with the 6-bit scale ls - 32: low nibble from
  // scales_l (word 1, bits 4b..), high 2 bits from scales_h (the upper half of word 0, bits 2b..).
  [GgmlType.IQ4_XS]: {
    units: 32,
    dq4: `fn dq4(base: u32, k: u32) -> vec4<f32> {
  let wb = base + (k / 256u) * 34u;
  let e = k % 256u; let b = e / 32u; let r = e % 32u;
  let h = w[wb];
  let ls = ((w[wb + 1u] >> (4u * b)) & 15u) | (((h >> (16u + 2u * b)) & 3u) << 4u);
  return f16lo(h) * (f32(ls) - 32.0) * iq4_levels(w[wb + 2u + 4u * b + (r % 16u) / 4u] >> (4u * (r / 16u)));
}`,
    dot: `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 32u; let j = u % 32u; let sb = j / 4u;
  let wb = base + b * 34u; let xk = xb + b * 256u + 32u * sb + 4u * (j % 4u);
  let h = w[wb]; let q = w[wb + 2u + j];
  let ls = ((w[wb + 1u] >> (4u * sb)) & 15u) | (((h >> (16u + 2u * sb)) & 3u) << 4u);
  return f16lo(h) * (f32(ls) - 32.0) * (dot(iq4_levels(q), xv(xk)) + dot(iq4_levels(q >> 4u), xv(xk + 16u)));
}`,
  },
};

function typeWgsl(type: GgmlType): TypeWgsl {
  const t = TYPE_WGSL[type];
  if (!t) {
    throw new UnsupportedModelError(`No GPU kernel for weights of type ${GGML_TYPE_INFO[type]?.name ?? type}.`, {
      type,
    });
  }
  return t;
}

/** Matvec units per block (0 for dense types, which use one unit per u32 word). */
export function matvecUnitsPerBlock(type: GgmlType): number {
  return typeWgsl(type).units;
}

/** The helpers that decode packed weight words (f16 scales, bytes, Q4_K's 6-bit scales; needs `w: array<u32>`). */
export function weightDecodeWgsl(): string {
  return common + weightHelpers;
}

/** The dequantizing functions of a type (needs `w: array<u32>` declared). */
export function dequantWgsl(type: GgmlType): string {
  return common + weightHelpers + typeWgsl(type).dq4;
}

/** The WGSL type a matvec binds a weight of this type as (`vec4Words`). */
function matvecWeightArray(type: GgmlType): string {
  return typeWgsl(type).vec4Words ? 'array<vec4<u32>>' : 'array<u32>';
}

/** Parameters and bindings of the single-weight kernels; `input` declares x at binding 1, `weights` w's type. */
function paramsStructWgsl(input: string, weights = 'array<u32>'): string {
  return `
struct Params { K: u32, rows: u32, tokens: u32, rowWords: u32, unitsPerRow: u32, firstRow: u32, outStride: u32, _pad: u32 }
@group(0) @binding(0) var<storage, read> w: ${weights};
${input}
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;
`;
}

/** The tiled kernels' x: rows of K scalars. */
const tiledParamsStruct = paramsStructWgsl('@group(0) @binding(1) var<storage, read> x: array<f32>;');

const biasBinding = `@group(0) @binding(4) var<storage, read> bias: array<f32>;\n`;

export const MATVEC_ROWS_PER_WORKGROUP = 4;

/** WGSL that stores `value` into `out`, plus `bias` when given, added to what `out` holds when `accumulate`. */
export function storeWgsl(out: string, value: string, bias: string | null, accumulate: boolean): string {
  const v = bias ? `${value} + ${bias}` : value;
  return `${out} = ${accumulate ? `${out} + (${v})` : v};`;
}

/**
 * The loop of one matvec workgroup over the 4 rows from `row0` of one weight: thread `li` walks units li,
 * li + threads, ... of the 4 rows at once (each weight word is read once, and the x values a unit needs are loaded
 * once for the 4 rows), adding one lane per row to the vec4 `acc`. `threads` is that weight's own thread count
 * (matvecThreads); in a kernel with more (TPR), `forThreads` keeps the threads past it out of the loop, so the tree
 * reduction over TPR adds exact zeros first and then the same sums in the same order as a kernel of `threads`.
 */
function matvecRowsWgsl(
  dot: string,
  rows: string,
  rowWords: string,
  units: string,
  acc: string,
  threads: number,
  build: MatvecBuild,
): string {
  const rowsOf = (u: string) =>
    `vec4<f32>(${dot}(b0, ${u}, 0u), ${dot}(b1, ${u}, 0u), ${dot}(b2, ${u}, 0u), ${dot}(b3, ${u}, 0u))`;
  // Two units per iteration: both units' loads are issued before either's arithmetic. They are added one after the
  // other, so the sums are those of the one-unit loop.
  const loop =
    build.unroll === 2
      ? `var u = li;
    for (; u + ${threads}u < ${units}; u += ${2 * threads}u) {
      let first = ${rowsOf('u')};
      let second = ${rowsOf(`u + ${threads}u`)};
      ${acc} += first;
      ${acc} += second;
    }
    if (u < ${units}) { ${acc} += ${rowsOf('u')}; }`
      : `for (var u = li; u < ${units}; u += ${threads}u) { ${acc} += ${rowsOf('u')}; }`;
  return `{
    // Rows past the end repeat the last row (discarded when stored) so the loop has no per-row branches.
    let last = ${rows} - 1u;
    let b0 = min(row0, last) * ${rowWords};
    let b1 = min(row0 + 1u, last) * ${rowWords};
    let b2 = min(row0 + 2u, last) * ${rowWords};
    let b3 = min(row0 + 3u, last) * ${rowWords};
    ${loop}
  }`;
}

/**
 * Sums each [workgroup array, vec4 accumulator] pair over the workgroup's TPR threads into `<array>Sum`, a vec4 that
 * holds the 4 rows' totals in threads li < ROWS (read as `<array>Sum[li]`). A thread past a weight's own thread count
 * has an accumulator of zeros (forThreads), so a fused kernel's members sum as their own dispatches do: exactly so
 * while the subgroup size divides the thread counts (multiples of 32), zeros then filling whole subgroups.
 * - With subgroups: subgroupAdd, one vec4 per subgroup through workgroup memory, one barrier.
 * - Without: a tree over workgroup memory, log2(TPR) barriers.
 */
function reduceWgsl(pairs: [array: string, acc: string][], threads: number, subgroups: boolean): string {
  const sums = pairs.map(([n]) => `var ${n}Sum = vec4<f32>(0.0);`).join(' ');
  if (subgroups) {
    return `${pairs.map(([n, acc]) => `{ let s = subgroupAdd(${acc}); if (lane == 0u) { ${n}[sg] = s; } }`).join('\n  ')}
  workgroupBarrier();
  ${sums}
  if (li < ROWS) {
    for (var i = 0u; i < (TPR + sgSize - 1u) / sgSize; i++) { ${pairs.map(([n]) => `${n}Sum += ${n}[i];`).join(' ')} }
  }`;
  }
  // A thread count that is not a power of two (96) first folds the threads past the largest power of two below it
  // onto the first ones; a power of two gets the plain tree.
  const top = 2 ** Math.floor(Math.log2(threads));
  const fold =
    top === threads
      ? ''
      : `
  if (li < TPR - ${top}u) { ${pairs.map(([n]) => `${n}[li] += ${n}[li + ${top}u];`).join(' ')} }
  workgroupBarrier();`;
  return `${pairs.map(([n, acc]) => `${n}[li] = ${acc};`).join(' ')}
  workgroupBarrier();${fold}
  for (var s = ${top / 2}u; s > 0u; s >>= 1u) {
    if (li < s) { ${pairs.map(([n]) => `${n}[li] += ${n}[li + s];`).join(' ')} }
    workgroupBarrier();
  }
  ${sums}
  if (li < ROWS) { ${pairs.map(([n]) => `${n}Sum = ${n}[0];`).join(' ')} }`;
}

/** `body` run by the threads below `threads` only (all of them when that is the kernel's TPR). */
function forThreads(threads: number, kernelThreads: number, body: string): string {
  return threads === kernelThreads ? body : `{ if (li < ${threads}u) ${body} }`;
}

/**
 * The type's dot product and the helpers it needs, reading weight binding `w${i}` as `unit_dot_${i}`: kernels over
 * several weights (of possibly different types) get one copy per weight, since WGSL cannot pass a storage array.
 */
function dotForWeight(type: GgmlType, i: number): string {
  return withWeightHelpers(typeWgsl(type).dot)
    .replace(/\bw\[/g, `w${i}[`)
    .replace(/\b(kbyte|scale_min_k4|unit_dot)\(/g, `$1_${i}(`);
}

/**
 * `dot` (a type's unit_dot, or a replacement for it) preceded by the word-reading helpers it calls: scale_min_k4
 * reads single words, so only kernels that bind the weight as `array<u32>` may take them.
 */
export function withWeightHelpers(dot: string): string {
  return `${dot.includes('scale_min_k4') ? weightHelpers : ''}${dot}`;
}

/** How a matvec kernel is built for a device. */
export interface MatvecBuild {
  /** Reduce with subgroupAdd (the device has `subgroups`; the module then enables them). */
  subgroups: boolean;
  /** Units per loop iteration of a thread (1 or 2): the same sums, more loads in flight. Default 1. */
  unroll?: 1 | 2;
}

/**
 * The matvec build for a device: subgroup reductions where it has subgroups, two units per loop iteration. On a large
 * GPU, with weights streaming from memory (bench/results/2026-12-01-nvidia-h200-session14-matvec-unroll.md), two units
 * per iteration made Q4_0, Q6_K and Q8_0 matvecs and Q4_K rows of 8,192 faster; Q4_K rows of 2,560 fit one iteration.
 */
export function matvecBuildFor(features: { subgroups: boolean }): MatvecBuild {
  return { subgroups: features.subgroups, unroll: 2 };
}

/**
 * The entry point the matvec kernels share: TPR threads, ROWS (4) weight rows per workgroup, one vec4 workgroup array
 * of TPR per name in `partials` (for reduceWgsl), and `body` with `wg`, `nwg` and `li` in scope (and the subgroup
 * builtins `sg`, `lane`, `sgSize` in a subgroups build).
 */
function matvecEntryWgsl(threads: number, partials: readonly string[], body: string, build: MatvecBuild): string {
  const subgroupBuiltins = build.subgroups
    ? `,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_size) sgSize: u32`
    : '';
  return `const TPR: u32 = ${threads}u;
const ROWS: u32 = ${MATVEC_ROWS_PER_WORKGROUP}u;
${partials.map((name) => `var<workgroup> ${name}: array<vec4<f32>, TPR>;`).join('\n')}

@compute @workgroup_size(TPR)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32${subgroupBuiltins}) {
${body}
}
`;
}

/** A matvec module: `enable subgroups;` first in a subgroups build (WGSL wants directives before declarations). */
function matvecModule(build: MatvecBuild, code: string): string {
  return `${build.subgroups ? 'enable subgroups;\n' : ''}${code}`;
}

/**
 * y[firstRow + r] = W[r, :] · x (+ bias) for one weight part, tokens = 1; with `accumulate`, y[...] += instead (the
 * residual add folded into the projection). A workgroup of `threads` threads (matvecThreads) handles 4 rows
 * (matvecRowsWgsl), then one reduction of the vec4 partial sums (reduceWgsl: subgroupAdd, or a tree).
 * Measured on a large GPU (4096x4096 and 4096x14336): faster than one row per 64 threads (4 rows per 256-thread
 * workgroup, x re-read per row); 128 threads was the best or near-best of 64/128/256 for every type, with the one-word
 * units of then (commit 16cf8bd, before the result files; the units and thread counts since:
 * bench/results/2026-11-30-nvidia-h200-session5-matvec.json).
 */
export function matvecWgsl(
  type: GgmlType,
  hasBias: boolean,
  accumulate: boolean,
  threads: number,
  build: MatvecBuild,
): string {
  return matvecModule(
    build,
    `${paramsStructWgsl(matvecInputWgsl(1, matvecReadsVec4([type])), matvecWeightArray(type))}${hasBias ? biasBinding : ''}${common}
${withWeightHelpers(typeWgsl(type).dot)}
${matvecEntryWgsl(
  threads,
  ['partial'],
  `  let row0 = (wg.x + wg.y * nwg.x) * ROWS;
  var acc = vec4<f32>(0.0);
  ${matvecRowsWgsl('unit_dot', 'params.rows', 'params.rowWords', 'params.unitsPerRow', 'acc', threads, build)}
  ${reduceWgsl([['partial', 'acc']], threads, build.subgroups)}
  if (li < ROWS && row0 + li < params.rows) {
    let n = params.firstRow + row0 + li;
    ${storeWgsl('y[n]', 'partialSum[li]', hasBias ? 'bias[n]' : null, accumulate)}
  }`,
  build,
)}`,
  );
}

/** One weight of a fused matvec: its type, whether it adds a bias, and its own matvec's thread count. */
export interface MatvecGroupMember {
  type: GgmlType;
  hasBias: boolean;
  threads: number;
}

/**
 * Several matvecs over the same x in one dispatch (q, k and v of a decode step): weight i (whole, one part) owns
 * workgroups firstGroup_i .. firstGroup_{i+1} - 1, 4 rows each, and writes its own output y_i exactly as
 * `matvecWgsl` would with its own thread count (same loop, same reduction: the same floats; the workgroup has the
 * largest member's count). Bindings: x, params, then per weight w_i, y_i and, if it has one, bias_i.
 */
export function matvecGroupWgsl(members: readonly MatvecGroupMember[], build: MatvecBuild): string {
  let binding = 2;
  const decls: string[] = [];
  for (const [i, m] of members.entries()) {
    decls.push(`@group(0) @binding(${binding++}) var<storage, read> w${i}: ${matvecWeightArray(m.type)};`);
    decls.push(`@group(0) @binding(${binding++}) var<storage, read_write> y${i}: array<f32>;`);
    if (m.hasBias) decls.push(`@group(0) @binding(${binding++}) var<storage, read> bias${i}: array<f32>;`);
  }
  const tpr = Math.max(...members.map((m) => m.threads));
  const section = (i: number) => `params.members[${i}]`;
  const branches = (body: (i: number) => string) =>
    members.map((_, i) => `${i === 0 ? '' : ' else '}if (member == ${i}u) ${body(i)}`).join('');
  const loop = (i: number) =>
    forThreads(
      members[i].threads,
      tpr,
      matvecRowsWgsl(
        `unit_dot_${i}`,
        `${section(i)}.rows`,
        `${section(i)}.rowWords`,
        `${section(i)}.unitsPerRow`,
        'acc',
        members[i].threads,
        build,
      ),
    );
  return matvecModule(
    build,
    `struct Member { rows: u32, rowWords: u32, unitsPerRow: u32, firstGroup: u32 }
struct Params { K: u32, _p0: u32, _p1: u32, _p2: u32, members: array<Member, ${members.length}> }
${matvecInputWgsl(0, matvecReadsVec4(members.map((m) => m.type)))}
@group(0) @binding(1) var<uniform> params: Params;
${decls.join('\n')}
${common}
${members.map((m, i) => dotForWeight(m.type, i)).join('\n')}
${matvecEntryWgsl(
  tpr,
  ['partial'],
  `  let g = wg.x + wg.y * nwg.x;
  var member = 0u;
  for (var i = 1u; i < ${members.length}u; i++) {
    if (g >= params.members[i].firstGroup) { member = i; }
  }
  let row0 = (g - params.members[member].firstGroup) * ROWS;
  var acc = vec4<f32>(0.0);
  ${branches(loop)}
  ${reduceWgsl([['partial', 'acc']], tpr, build.subgroups)}
  let r = row0 + li;
  if (li < ROWS && r < params.members[member].rows) {
    ${branches((i) => `{ ${storeWgsl(`y${i}[r]`, 'partialSum[li]', members[i].hasBias ? `bias${i}[r]` : null, false)} }`)}
  }`,
  build,
)}`,
  );
}

/**
 * The feed-forward's gate and up matvecs and SwiGLU in one dispatch (tokens = 1): a workgroup computes the same 4
 * rows of both weights (matvecRowsWgsl with each weight's own thread count, so the same floats as two matvec
 * dispatches) and writes silu(gate)·up, or gelu(gate)·up with `activation` 'geglu'. Bindings: x, params, gate weight,
 * up weight, output.
 */
export function matvecSwigluWgsl(
  gate: Omit<MatvecGroupMember, 'hasBias'>,
  up: Omit<MatvecGroupMember, 'hasBias'>,
  build: MatvecBuild,
  activation: GatedActivation = 'swiglu',
): string {
  const tpr = Math.max(gate.threads, up.threads);
  return matvecModule(
    build,
    `struct Params { K: u32, rows: u32, gateRowWords: u32, gateUnits: u32, upRowWords: u32, upUnits: u32, _p0: u32, _p1: u32 }
${matvecInputWgsl(0, matvecReadsVec4([gate.type, up.type]))}
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read> w0: ${matvecWeightArray(gate.type)};
@group(0) @binding(3) var<storage, read> w1: ${matvecWeightArray(up.type)};
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
${common}
${dotForWeight(gate.type, 0)}
${dotForWeight(up.type, 1)}
${matvecEntryWgsl(
  tpr,
  ['gatePartial', 'upPartial'],
  `  let row0 = (wg.x + wg.y * nwg.x) * ROWS;
  var gateAcc = vec4<f32>(0.0);
  var upAcc = vec4<f32>(0.0);
  ${forThreads(gate.threads, tpr, matvecRowsWgsl('unit_dot_0', 'params.rows', 'params.gateRowWords', 'params.gateUnits', 'gateAcc', gate.threads, build))}
  ${forThreads(up.threads, tpr, matvecRowsWgsl('unit_dot_1', 'params.rows', 'params.upRowWords', 'params.upUnits', 'upAcc', up.threads, build))}
  ${reduceWgsl(
    [
      ['gatePartial', 'gateAcc'],
      ['upPartial', 'upAcc'],
    ],
    tpr,
    build.subgroups,
  )}
  if (li < ROWS && row0 + li < params.rows) {
    let g = gatePartialSum[li];
    y[row0 + li] = ${gatedExpression(activation, 'g', 'upPartialSum[li]')};
  }`,
  build,
)}`,
  );
}

/**
 * Tiled-matmul variants for tokens > 1, named rows x tokens of one workgroup's output tile. '32x32' is the first
 * kernel (2x2 outputs per thread, scalar reads of a padded tile); the others are `registerTiledMatmulWgsl` with the
 * tiles below. Kept side by side so the GPU bench (bench/matmul-micro.ts) can compare them.
 */
export const MATMUL_VARIANTS = ['32x32', '64x64', '64x32', '128x64'] as const;
export type MatmulVariant = (typeof MATMUL_VARIANTS)[number];

/** The variant prepareMatmul uses when none is given. */
export const DEFAULT_MATMUL_VARIANT: MatmulVariant = '32x32';

/** The shape of a register-tiled matmul workgroup (see `registerTiledMatmulWgsl`). */
export interface MatmulTile {
  /** Weight rows per workgroup tile. */
  rows: number;
  /** Tokens per workgroup tile. */
  tokens: number;
  /** Outputs per thread along rows and tokens (1..8; rows / rowsPerThread and tokens / tokensPerThread threads). */
  rowsPerThread: number;
  tokensPerThread: number;
  /** K elements per step: 16 or 32 (a divisor of every quantized block). */
  k: number;
  /** Dequantize the next K step into registers before computing the current one (the loads' latency overlaps it). */
  prefetch: boolean;
}

/**
 * 64x64: 256 threads of 4x4, K step 32, 16 KiB of workgroup memory (all of WebGPU's default limit). 64x32: half the
 * tokens on 128 threads (12 KiB), twice the workgroups for grids too small to fill the GPU (e.g. 2048 rows at 128
 * tokens: 64 workgroups of 64x64). 128x64: 8x4 per thread (128 FMAs per 12 vec4 reads instead of 64 per 8), K step
 * 16 to fit 12 KiB. (A 128x128 tile, 8x8 per thread, won only at 8192 rows x 512 tokens, and narrowly:
 * bench/results/2026-11-30-nvidia-h200-session9-matmul-128x128.md.)
 */
export const MATMUL_TILES: Readonly<Record<Exclude<MatmulVariant, '32x32'>, MatmulTile>> = {
  '64x64': { rows: 64, tokens: 64, rowsPerThread: 4, tokensPerThread: 4, k: 32, prefetch: true },
  '64x32': { rows: 64, tokens: 32, rowsPerThread: 4, tokensPerThread: 4, k: 32, prefetch: true },
  '128x64': { rows: 128, tokens: 64, rowsPerThread: 8, tokensPerThread: 4, k: 16, prefetch: true },
};

/** Weight rows and tokens of one workgroup's output tile. */
export function matmulTileShape(variant: MatmulVariant): { rows: number; tokens: number } {
  if (variant === '32x32') return { rows: 32, tokens: 32 };
  const { rows, tokens } = MATMUL_TILES[variant];
  return { rows, tokens };
}

/** WebGPU's default maxComputeWorkgroupStorageSize and maxComputeInvocationsPerWorkgroup: every variant fits both. */
const WORKGROUP_STORAGE_BYTES = 16384;
const WORKGROUP_INVOCATIONS = 256;

/** Tiled matmul for tokens > 1 (see MATMUL_VARIANTS). */
export function matmulWgsl(
  type: GgmlType,
  hasBias: boolean,
  variant: MatmulVariant = DEFAULT_MATMUL_VARIANT,
  accumulate = false,
): string {
  if (variant === '32x32') return matmul32Wgsl(type, hasBias, accumulate);
  const tile = MATMUL_TILES[variant];
  if (!tile) throw new Error(`Unknown matmul variant '${variant}'.`);
  return registerTiledMatmulWgsl(type, hasBias, tile, accumulate);
}

/**
 * The first tiled matmul: a 16x16 workgroup computes 32 weight rows x 32 tokens (2x2 per thread). Each K step
 * dequantizes a 32x32 weight tile (4 elements per thread, via dq4) and loads a 32x32 x tile into workgroup memory.
 */
function matmul32Wgsl(type: GgmlType, hasBias: boolean, accumulate: boolean): string {
  return `${tiledParamsStruct}${hasBias ? biasBinding : ''}${common}${weightHelpers}${typeWgsl(type).dq4}
const TN: u32 = 32u;
const TT: u32 = 32u;
const TK: u32 = 32u;
const PAD: u32 = 33u;
var<workgroup> wt: array<f32, 1056>; // [TN][PAD]
var<workgroup> xt: array<f32, 1056>; // [TT][PAD]

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
  let n0 = (wg.x + wg.y * nwg.x) * TN;
  let t0 = wg.z * TT;
  let lr = li / 8u;          // tile row (weight row or token) this thread loads
  let lk = (li % 8u) * 4u;   // first of the 4 k it loads
  var a00 = 0.0; var a01 = 0.0; var a10 = 0.0; var a11 = 0.0;
  for (var k0 = 0u; k0 < params.K; k0 += TK) {
    let k = k0 + lk;
    let kin = vec4<u32>(k, k + 1u, k + 2u, k + 3u) < vec4<u32>(params.K);
    var v = vec4<f32>(0.0);
    if (n0 + lr < params.rows && k < params.K) {
      v = select(vec4<f32>(0.0), dq4((n0 + lr) * params.rowWords, k), kin);
    }
    wt[lr * PAD + lk] = v.x; wt[lr * PAD + lk + 1u] = v.y; wt[lr * PAD + lk + 2u] = v.z; wt[lr * PAD + lk + 3u] = v.w;
    let t = t0 + lr;
    for (var i = 0u; i < 4u; i++) {
      var xval = 0.0;
      if (t < params.tokens && k + i < params.K) { xval = x[t * params.K + k + i]; }
      xt[lr * PAD + lk + i] = xval;
    }
    workgroupBarrier();
    let r0 = lid.x * 2u * PAD;
    let c0 = lid.y * 2u * PAD;
    for (var kk = 0u; kk < TK; kk++) {
      let w0 = wt[r0 + kk]; let w1 = wt[r0 + PAD + kk];
      let x0 = xt[c0 + kk]; let x1 = xt[c0 + PAD + kk];
      a00 += w0 * x0; a01 += w0 * x1; a10 += w1 * x0; a11 += w1 * x1;
    }
    workgroupBarrier();
  }
  let n = n0 + lid.x * 2u;
  let t = t0 + lid.y * 2u;
  let acc = array<f32, 4>(a00, a01, a10, a11);
  for (var i = 0u; i < 4u; i++) {
    let nn = n + i / 2u; let tt = t + i % 2u;
    if (nn < params.rows && tt < params.tokens) {
      let col = params.firstRow + nn;
      ${storeWgsl('y[tt * params.outStride + col]', 'acc[i]', hasBias ? 'bias[col]' : null, accumulate)}
    }
  }
}
`;
}

/**
 * Register-tiled matmul for tokens > 1: one workgroup computes `rows` weight rows x `tokens` tokens, thread (tx, ty)
 * the rows tx + TX·i and tokens ty + TY·j of the tile (TX, TY threads along each side). Per K step of `k` elements,
 * every weight element of the tile is dequantized once (dq4: 4 consecutive k of one row) and every x element loaded
 * once, into workgroup memory as vec4s of 4 consecutive k (ws[row][k/4], xs[token][k/4]). The inner loop reads one
 * vec4 per row and per token of the thread and does 4 FMAs per (row, token) pair from registers: 4x4 outputs per
 * thread is 64 FMAs per 8 vec4 reads (the 32x32 kernel: 1 FMA per scalar read).
 *
 * Loads: consecutive threads take consecutive k-quads of one row (QK = k/4 per row), so a warp reads a few rows'
 * contiguous blocks and x rows, and stores whole vec4s. Quad kq of row n is stored at slot kq ^ ((n / SW) % QK)
 * (SW = 8 / QK): the 8 rows that 8 consecutive threads read at once then sit in 8 different bank groups.
 *
 * Edges: rows past the end read the last row and tokens past the end the last token (their outputs are not
 * written); k past K reads zeros on both sides (select, so garbage from a partial dense quad never reaches the sum).
 * With `prefetch`, the next step's dq4 and x loads go to registers right after the barrier that publishes the
 * current step, so their latency can overlap its FMAs (no second tile buffer: workgroup memory stays <= 16 KiB).
 * Each output accumulates over k in order, as in the 32x32 kernel (fused multiply-adds).
 */
export function registerTiledMatmulWgsl(
  type: GgmlType,
  hasBias: boolean,
  tile: MatmulTile,
  accumulate = false,
): string {
  const { rows: TN, tokens: TT, rowsPerThread: RN, tokensPerThread: RT, k: TK } = tile;
  const TX = TN / RN;
  const TY = TT / RT;
  const threads = TX * TY;
  const QK = TK / 4;
  const SW = 8 / QK;
  const WQ = (TN * QK) / threads;
  const XQ = (TT * QK) / threads;
  const storage = TK * (TN + TT) * 4;
  const problems = [
    !(TK === 16 || TK === 32) && 'k must be 16 or 32',
    !(Number.isInteger(RN) && Number.isInteger(RT) && RN >= 1 && RT >= 1 && RN <= 8 && RT <= 8) &&
      'rows/tokens per thread must be 1..8',
    !(Number.isInteger(TX) && Number.isInteger(TY) && TX % 8 === 0 && TY % 8 === 0) &&
      'threads along rows and tokens must be multiples of 8',
    !(threads % 32 === 0 && threads <= WORKGROUP_INVOCATIONS) && `${threads} threads (needs a multiple of 32, <= 256)`,
    !(Number.isInteger(WQ) && Number.isInteger(XQ)) && 'loads must divide among threads',
    storage > WORKGROUP_STORAGE_BYTES && `${storage} bytes of workgroup memory (limit ${WORKGROUP_STORAGE_BYTES})`,
  ].filter(Boolean);
  if (problems.length > 0) throw new Error(`Bad matmul tile ${JSON.stringify(tile)}: ${problems.join('; ')}.`);

  const range = (n: number) => Array.from({ length: n }, (_, i) => i);
  const plus = (v: number) => (v === 0 ? '' : ` + ${v}u`);
  const acc = (i: number, j: number) => `a${i}_${j}`; // row tx + TX·i, token ty + TY·j
  const decls = range(RN)
    .map(
      (i) =>
        `  var ${range(RT)
          .map((j) => `${acc(i, j)} = 0.0`)
          .join('; var ')};`,
    )
    .join('\n');
  const quad = (i: number) => `li${plus(i * threads)}`;
  const loads = (k0: string, assign: (name: string) => string, indent: string) =>
    [
      ...range(WQ).map((i) => `${assign(`pw${i}`)}load_w(${quad(i)}, n0, ${k0});`),
      ...range(XQ).map((i) => `${assign(`px${i}`)}load_x(${quad(i)}, t0, ${k0});`),
    ].map((line) => `${indent}${line}`);
  const stores = (value: (kind: 'w' | 'x', i: number) => string) =>
    [
      ...range(WQ).map((i) => `ws[slot(${quad(i)})] = ${value('w', i)};`),
      ...range(XQ).map((i) => `xs[slot(${quad(i)})] = ${value('x', i)};`),
    ].map((line) => `    ${line}`);
  const fma = (a: string, w: string, x: string) =>
    `${a} = fma(${w}.w, ${x}.w, fma(${w}.z, ${x}.z, fma(${w}.y, ${x}.y, fma(${w}.x, ${x}.x, ${a}))));`;
  const inner = [
    `      let cw = tx * QK + (kq ^ ((tx / SW) % QK));`,
    `      let cx = ty * QK + (kq ^ ((ty / SW) % QK));`,
    ...range(RT).map((j) => `      let x${j} = xs[cx${plus(j * TY * QK)}];`),
    ...range(RN).map(
      (i) =>
        `      { let w = ws[cw${plus(i * TX * QK)}];\n        ${range(RT)
          .map((j) => fma(acc(i, j), 'w', `x${j}`))
          .join('\n        ')} }`,
    ),
  ].join('\n');
  const body = tile.prefetch
    ? [
        ...loads('0u', (n) => `var ${n} = `, '  '),
        '  for (var k0 = 0u; k0 < params.K; k0 += TK) {',
        ...stores((kind, i) => `p${kind}${i}`),
        '    workgroupBarrier();',
        ...loads('k0 + TK', (n) => `${n} = `, '    '),
      ]
    : [
        '  for (var k0 = 0u; k0 < params.K; k0 += TK) {',
        ...stores((kind, i) => (kind === 'w' ? `load_w(${quad(i)}, n0, k0)` : `load_x(${quad(i)}, t0, k0)`)),
        '    workgroupBarrier();',
      ];
  const puts = range(RN)
    .flatMap((i) => range(RT).map((j) => `  put(t0 + ty${plus(j * TY)}, n0 + tx${plus(i * TX)}, ${acc(i, j)});`))
    .join('\n');

  return `${tiledParamsStruct}${hasBias ? biasBinding : ''}${common}${weightHelpers}${typeWgsl(type).dq4}
const TN: u32 = ${TN}u; // weight rows per tile (${RN} per thread)
const TT: u32 = ${TT}u; // tokens per tile (${RT} per thread)
const TK: u32 = ${TK}u; // k per step
const QK: u32 = ${QK}u; // vec4s of k per row and step
const TX: u32 = ${TX}u; // threads along rows (${TY} along tokens)
const SW: u32 = ${SW}u; // swizzle: quad kq of row n sits at kq ^ ((n / SW) % QK)
var<workgroup> ws: array<vec4<f32>, ${TN * QK}>; // [TN][QK]: ${(TN * TK * 4) / 1024} KiB
var<workgroup> xs: array<vec4<f32>, ${TT * QK}>; // [TT][QK]: ${(TT * TK * 4) / 1024} KiB

// Tile slot of quad q (row or token q / QK, k-quad q % QK).
fn slot(q: u32) -> u32 {
  let n = q / QK; let kq = q % QK;
  return n * QK + (kq ^ ((n / SW) % QK));
}
// Quad q of the weight tile: row n0 + q / QK, elements k0 + 4 (q % QK) .. +3.
fn load_w(q: u32, n0: u32, k0: u32) -> vec4<f32> {
  let k = k0 + 4u * (q % QK);
  let row = min(n0 + q / QK, params.rows - 1u);
  let kin = vec4<u32>(k, k + 1u, k + 2u, k + 3u) < vec4<u32>(params.K);
  return select(vec4<f32>(0.0), dq4(row * params.rowWords, select(k, 0u, k >= params.K)), kin);
}
// Quad q of the x tile: token t0 + q / QK, elements k0 + 4 (q % QK) .. +3.
fn load_x(q: u32, t0: u32, k0: u32) -> vec4<f32> {
  let k = vec4<u32>(k0 + 4u * (q % QK)) + vec4<u32>(0u, 1u, 2u, 3u);
  let i = vec4<u32>(min(t0 + q / QK, params.tokens - 1u) * params.K) + min(k, vec4<u32>(params.K - 1u));
  return select(vec4<f32>(0.0), vec4<f32>(x[i.x], x[i.y], x[i.z], x[i.w]), k < vec4<u32>(params.K));
}
// Output of token t, row r of this weight part.
fn put(t: u32, r: u32, v: f32) {
  if (t < params.tokens && r < params.rows) {
    let col = params.firstRow + r;
    ${storeWgsl('y[t * params.outStride + col]', 'v', hasBias ? 'bias[col]' : null, accumulate)}
  }
}

@compute @workgroup_size(${threads})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
  let n0 = (wg.x + wg.y * nwg.x) * TN;
  if (n0 >= params.rows) { return; } // a spare workgroup of the folded grid (uniform: no barrier is skipped)
  let t0 = wg.z * TT;
  let tx = li % TX;
  let ty = li / TX;
${decls}
${body.join('\n')}
    for (var kq = 0u; kq < QK; kq++) {
${inner}
    }
    workgroupBarrier();
  }
${puts}
}
`;
}
