/**
 * The quantized KV row format (INT2 by default; 1-bit exists as the weak control, 4-bit for boosted layers).
 *
 * A token's K (or V) of one layer is `width = kvHeads × headDim` values (already rotated). A stored row is one token,
 * or, where `groupSize` is a multiple of `width` (rows narrower than a group), `groupSize / width` consecutive
 * positions, their values one after the other (`positionsPerRow`, `storedRowWidth`). A stored row is cut into groups
 * of `groupSize` consecutive values (a group may span heads when headDim < groupSize, and positions when width <
 * groupSize). Per group, an asymmetric uniform quantizer with `levels = 2^bits`:
 *     lo, hi = the (1-q) and q quantiles of the group (q = clipQuantile; q = 1 is plain min/max)
 *     scale = (hi - lo) / (levels - 1), both lo and scale rounded to f16 BEFORE coding
 *     code  = clamp(round((x - lo) / scale), 0, levels - 1);   x̂ = lo + code · scale
 * Storage of a stored row, in u32 words: `storedRowWidth × bits / 32` code words (value i at bit (i mod (32/bits))·bits
 * of word i / (32/bits)), then one word per group = pack2x16float(lo, scale) (lo in the low half).
 * Effective bits per element: bits + 32 / groupSize (2.25 at groupSize 128).
 */

export interface QuantRowFormat {
  /** Values of one token's row: kvHeads × headDim. */
  width: number;
  /** Values per (lo, scale) pair: a divisor of width, or a multiple of it (then a group spans positions). */
  groupSize: number;
  bits: 1 | 2 | 4;
  clipQuantile: number;
}

/** Values per quant group where the row allows it: one (lo, scale) pair costs 32 / 128 = 0.25 bits an element. */
export const PREFERRED_GROUP_VALUES = 128;

/**
 * The quant group of a row of `kvHeads` heads of `headDim` values when none is asked for: 128 values where they
 * divide the row and lie inside one head or hold whole heads (the attention kernels' rule); a row narrower than 128
 * that divides it (one KV head of 64: 4:1 GQA at head_dim 64) in groups of 128 over consecutive positions, whose
 * pairs cost 0.25 bits an element, not the 0.5 bits of a pair per row; else the fewest whole heads that hold at least
 * 128 values and divide the row. Rows of 5 or 3 heads of 64 (SmolLM2-360M, SmolLM-135M) so take one group of 320 or
 * 192 values. Pairs of 0.5 bits would leave no room in the plan's 2.5-bit budget for the 2-bit codes themselves.
 */
export function defaultGroupSize(kvHeads: number, headDim: number): number {
  const width = kvHeads * headDim;
  if (width < PREFERRED_GROUP_VALUES && PREFERRED_GROUP_VALUES % width === 0 && width % 32 === 0) {
    return PREFERRED_GROUP_VALUES;
  }
  if (width <= PREFERRED_GROUP_VALUES) return width;
  const fitsHeads = headDim % PREFERRED_GROUP_VALUES === 0 || PREFERRED_GROUP_VALUES % headDim === 0;
  if (fitsHeads && width % PREFERRED_GROUP_VALUES === 0) return PREFERRED_GROUP_VALUES;
  for (let heads = 1; heads < kvHeads; heads++) {
    if (kvHeads % heads === 0 && heads * headDim >= PREFERRED_GROUP_VALUES) return heads * headDim;
  }
  return width;
}

/** Consecutive positions in one stored row: groupSize / width where a group is wider than a token's row, else 1. */
export function positionsPerRow(f: Pick<QuantRowFormat, 'width' | 'groupSize'>): number {
  return f.groupSize > f.width ? f.groupSize / f.width : 1;
}

/** Values of one stored row: width × positionsPerRow. */
export function storedRowWidth(f: Pick<QuantRowFormat, 'width' | 'groupSize'>): number {
  return f.width * positionsPerRow(f);
}

export function codeWordsPerRow(f: QuantRowFormat): number {
  return (storedRowWidth(f) * f.bits) / 32;
}

export function rowWords(f: QuantRowFormat): number {
  return codeWordsPerRow(f) + storedRowWidth(f) / f.groupSize;
}

export function validateQuantRowFormat(f: QuantRowFormat): string | null {
  if (![1, 2, 4].includes(f.bits)) return `bits must be 1, 2 or 4, got ${f.bits}`;
  if (Number.isInteger(f.groupSize) && f.groupSize > f.width && f.groupSize % f.width === 0) {
    // A group over positions: each position's codes fill whole words under every code width (1, 2 or 4 bits).
    if (f.width % 32 !== 0) {
      return `a group of ${f.groupSize} values spans positions, so the row width ${f.width} (kvHeads × headDim) must be a multiple of 32`;
    }
    return f.clipQuantile > 0.5 && f.clipQuantile <= 1 ? null : `clip quantile ${f.clipQuantile} must be in (0.5, 1]`;
  }
  if (!Number.isInteger(f.groupSize) || f.groupSize < 32 / f.bits || f.width % f.groupSize !== 0) {
    return `group size ${f.groupSize} must divide the row width ${f.width} (kvHeads × headDim) or be a multiple of it, and be at least ${32 / f.bits}`;
  }
  if (f.groupSize % (32 / f.bits) !== 0) return `group size ${f.groupSize} must be a multiple of ${32 / f.bits}`;
  if (!(f.clipQuantile > 0.5 && f.clipQuantile <= 1)) return `clip quantile ${f.clipQuantile} must be in (0.5, 1]`;
  return null;
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** Round to the nearest f16 value (ties to even), returned as a number; matches WGSL pack2x16float. */
export function roundToF16(x: number): number {
  if (!Number.isFinite(x)) return x;
  const bits = f16Bits(x);
  return f16BitsToNumber(bits);
}

export function f16Bits(x: number): number {
  f32[0] = x;
  const b = u32[0];
  const sign = (b >>> 16) & 0x8000;
  const exp = (b >>> 23) & 0xff;
  let mant = b & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  let e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    const half = 1 << (shift - 1);
    let m = mant >>> shift;
    const rest = mant & ((1 << shift) - 1);
    if (rest > half || (rest === half && m & 1)) m++;
    return sign | m;
  }
  let m = mant >>> 13;
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && m & 1)) {
    m++;
    if (m === 0x400) {
      m = 0;
      e++;
      if (e >= 0x1f) return sign | 0x7c00;
    }
  }
  return sign | (e << 10) | m;
}

export function f16BitsToNumber(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const e = (h >>> 10) & 0x1f;
  const m = h & 0x3ff;
  if (e === 0) return sign * m * 2 ** -24;
  if (e === 0x1f) return m ? Number.NaN : sign * Number.POSITIVE_INFINITY;
  return sign * (1 + m / 1024) * 2 ** (e - 15);
}

/** The value at fractional rank q of sorted values (no interpolation: rank rounded, the same rule as the kernel). */
export function quantileOfSorted(sorted: ArrayLike<number>, q: number): number {
  const rank = Math.min(sorted.length - 1, Math.max(0, Math.round(q * (sorted.length - 1))));
  return sorted[rank];
}

/** Quantizes one stored row (storedRowWidth values); returns its words (codes then group parameters). */
export function quantizeRow(values: ArrayLike<number>, f: QuantRowFormat): Uint32Array {
  if (values.length !== storedRowWidth(f)) {
    throw new RangeError(`quantizeRow: ${values.length} values for a stored row of ${storedRowWidth(f)}`);
  }
  const out = new Uint32Array(rowWords(f));
  const perWord = 32 / f.bits;
  const levels = (1 << f.bits) - 1;
  const codeWords = codeWordsPerRow(f);
  const groups = storedRowWidth(f) / f.groupSize;
  for (let g = 0; g < groups; g++) {
    const group = Array.from({ length: f.groupSize }, (_, i) => values[g * f.groupSize + i]);
    const sorted = group.slice().sort((a, b) => a - b);
    const lo = roundToF16(quantileOfSorted(sorted, 1 - f.clipQuantile));
    const hi = quantileOfSorted(sorted, f.clipQuantile);
    const scale = roundToF16(Math.max(hi - lo, 0) / levels);
    out[codeWords + g] = (f16Bits(lo) | (f16Bits(scale) << 16)) >>> 0;
    for (let i = 0; i < f.groupSize; i++) {
      const index = g * f.groupSize + i;
      const code = scale > 0 ? Math.min(levels, Math.max(0, Math.round((group[i] - lo) / scale))) : 0;
      out[Math.floor(index / perWord)] |= code << ((index % perWord) * f.bits);
    }
  }
  return out;
}

/** The values of one stored row (storedRowWidth of them). */
export function dequantizeRow(words: Uint32Array, f: QuantRowFormat): Float32Array {
  const out = new Float32Array(storedRowWidth(f));
  const perWord = 32 / f.bits;
  const mask = (1 << f.bits) - 1;
  const codeWords = codeWordsPerRow(f);
  for (let i = 0; i < out.length; i++) {
    const param = words[codeWords + Math.floor(i / f.groupSize)];
    const lo = f16BitsToNumber(param & 0xffff);
    const scale = f16BitsToNumber(param >>> 16);
    const code = (words[Math.floor(i / perWord)] >>> ((i % perWord) * f.bits)) & mask;
    out[i] = lo + code * scale;
  }
  return out;
}

/**
 * What consecutive positions read back from quant rows (quantizeRow, then dequantizeRow): `rows` holds their token
 * rows of `f.width` values, the first at a position that starts a stored row (a page start, position 0). Where the
 * last stored row lacks positions (emulations over any count of tokens; a pool's quant pages are whole), the last
 * position's row stands in for the missing ones.
 */
export function roundTripRows(rows: ArrayLike<number>, f: QuantRowFormat): Float32Array {
  const tokens = rows.length / f.width;
  const perRow = positionsPerRow(f);
  const out = new Float32Array(rows.length);
  const stored = new Float32Array(storedRowWidth(f));
  for (let t0 = 0; t0 < tokens; t0 += perRow) {
    for (let j = 0; j < perRow; j++) {
      const t = Math.min(t0 + j, tokens - 1);
      for (let i = 0; i < f.width; i++) stored[j * f.width + i] = rows[t * f.width + i];
    }
    const back = dequantizeRow(quantizeRow(stored, f), f);
    out.set(back.subarray(0, Math.min(perRow, tokens - t0) * f.width), t0 * f.width);
  }
  return out;
}

/** Effective bits per element of a cache holding `tokens` positions, `f16Tokens` of them in 16-bit pages. */
export function effectiveBitsPerElement(f: QuantRowFormat, tokens: number, f16Tokens: number): number {
  const quantBits = (rowWords(f) * 32) / storedRowWidth(f);
  return (f16Tokens * 16 + (tokens - f16Tokens) * quantBits) / tokens;
}
