/**
 * CPU dequantization of GGUF weight bytes (the ggml block layouts), the reference the weight kernels are tested
 * against. Written from the format description; element order within each block is spelled out per type.
 */
import { GGML_TYPE_INFO, GgmlType, IQ4_NL_LEVELS } from '../../core/gguf-types.ts';

const f16Scratch = new DataView(new ArrayBuffer(4));

/** IEEE half bits to a number (subnormals, infinities and NaN included). */
export function f16ToF32(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const frac = h & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? Number.NaN : sign * Number.POSITIVE_INFINITY;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

/** A number to IEEE half bits, rounding to nearest even (tests use it to write scales and F16 data). */
export function f32ToF16Bits(value: number): number {
  f16Scratch.setFloat32(0, value);
  const x = f16Scratch.getUint32(0);
  const sign = (x >>> 16) & 0x8000;
  const exp = (x >>> 23) & 0xff;
  let mant = x & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  const e = exp - 127 + 15;
  if (e >= 31) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    let half = mant >>> shift;
    const rest = mant & ((1 << shift) - 1);
    const mid = 1 << (shift - 1);
    if (rest > mid || (rest === mid && half & 1)) half++;
    return sign | half;
  }
  let half = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && half & 1)) half++; // a carry into the exponent is still correct
  return sign | half;
}

export function bf16ToF32(h: number): number {
  f16Scratch.setUint32(0, (h & 0xffff) << 16);
  return f16Scratch.getFloat32(0);
}

/** The 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes of a Q4_K/Q5_K block. */
export function scaleMinK4(scales: Uint8Array, j: number): [number, number] {
  if (j < 4) return [scales[j] & 63, scales[j + 4] & 63];
  return [(scales[j + 4] & 0xf) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)];
}

/** Dequantizes `count` elements (a whole number of blocks) of GGUF bytes of `type` to f32. */
export function dequantize(type: GgmlType, bytes: Uint8Array, count: number): Float32Array {
  const info = GGML_TYPE_INFO[type];
  if (!info) throw new Error(`unknown GGML type ${type}`);
  if (count % info.blockSize !== 0) throw new Error(`${count} elements is not a whole number of ${info.name} blocks`);
  const blocks = count / info.blockSize;
  if (bytes.byteLength < blocks * info.blockBytes) throw new Error(`too few bytes for ${count} ${info.name} elements`);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Float32Array(count);
  const half = (o: number) => f16ToF32(view.getUint16(o, true));
  for (let b = 0; b < blocks; b++) {
    const o = b * info.blockBytes;
    const y = b * info.blockSize;
    switch (type) {
      case GgmlType.F32:
        out[y] = view.getFloat32(o, true);
        break;
      case GgmlType.F16:
        out[y] = half(o);
        break;
      case GgmlType.BF16:
        out[y] = bf16ToF32(view.getUint16(o, true));
        break;
      case GgmlType.Q4_0: {
        // d, qs[16]: element j is the low nibble of qs[j], element j+16 the high nibble; value (q - 8)·d.
        const d = half(o);
        for (let j = 0; j < 16; j++) {
          const q = bytes[o + 2 + j];
          out[y + j] = ((q & 0xf) - 8) * d;
          out[y + j + 16] = ((q >> 4) - 8) * d;
        }
        break;
      }
      case GgmlType.Q4_1: {
        // d, m, qs[16]: value q·d + m.
        const d = half(o);
        const m = half(o + 2);
        for (let j = 0; j < 16; j++) {
          const q = bytes[o + 4 + j];
          out[y + j] = (q & 0xf) * d + m;
          out[y + j + 16] = (q >> 4) * d + m;
        }
        break;
      }
      case GgmlType.Q5_0:
      case GgmlType.Q5_1: {
        // d, [m], qh (u32 LE), qs[16]: bit e of qh is the fifth bit of element e. Q5_0: (q - 16)·d, Q5_1: q·d + m.
        const hasMin = type === GgmlType.Q5_1;
        const d = half(o);
        const m = hasMin ? half(o + 2) : 0;
        const qhAt = o + (hasMin ? 4 : 2);
        const qh = view.getUint32(qhAt, true);
        for (let j = 0; j < 16; j++) {
          const q = bytes[qhAt + 4 + j];
          const lo = (q & 0xf) | (((qh >>> j) & 1) << 4);
          const hi = (q >> 4) | (((qh >>> (j + 16)) & 1) << 4);
          out[y + j] = hasMin ? lo * d + m : (lo - 16) * d;
          out[y + j + 16] = hasMin ? hi * d + m : (hi - 16) * d;
        }
        break;
      }
      case GgmlType.Q8_0: {
        const d = half(o);
        for (let j = 0; j < 32; j++) out[y + j] = view.getInt8(o + 2 + j) * d;
        break;
      }
      case GgmlType.Q4_K:
      case GgmlType.Q5_K: {
        // d, dmin, scales[12], [qh[32]], qs[128]. Chunk c (64 elements) reads qs[32c..32c+31]: low nibbles are
        // sub-block 2c, high nibbles sub-block 2c+1; value d·sc·q - dmin·m. Q5_K: fifth bit of element l of
        // chunk c is bit 2c (low) / 2c+1 (high) of qh[l].
        const five = type === GgmlType.Q5_K;
        const d = half(o);
        const dmin = half(o + 2);
        const scales = bytes.subarray(o + 4, o + 16);
        const qhAt = o + 16;
        const qsAt = o + (five ? 48 : 16);
        for (let c = 0; c < 4; c++) {
          const [sc1, m1] = scaleMinK4(scales, 2 * c);
          const [sc2, m2] = scaleMinK4(scales, 2 * c + 1);
          for (let l = 0; l < 32; l++) {
            const q = bytes[qsAt + 32 * c + l];
            const h = five ? bytes[qhAt + l] : 0;
            const lo = (q & 0xf) + (five && h & (1 << (2 * c)) ? 16 : 0);
            const hi = (q >> 4) + (five && h & (1 << (2 * c + 1)) ? 16 : 0);
            out[y + 64 * c + l] = d * sc1 * lo - dmin * m1;
            out[y + 64 * c + 32 + l] = d * sc2 * hi - dmin * m2;
          }
        }
        break;
      }
      case GgmlType.Q6_K: {
        // ql[128], qh[64], scales[16] (int8), d. Half n (128 elements), l in 0..31:
        //   element 128n + l      : ql[64n + l] low  | qh[32n + l] bits 0-1, scale 8n + l/16
        //   element 128n + l + 32 : ql[64n+32+l] low | bits 2-3,               scale 8n + l/16 + 2
        //   element 128n + l + 64 : ql[64n + l] high | bits 4-5,               scale 8n + l/16 + 4
        //   element 128n + l + 96 : ql[64n+32+l] high| bits 6-7,               scale 8n + l/16 + 6
        // value d·scale·(q - 32).
        const d = half(o + 208);
        for (let n = 0; n < 2; n++) {
          for (let l = 0; l < 32; l++) {
            const a = bytes[o + 64 * n + l];
            const b2 = bytes[o + 64 * n + 32 + l];
            const h = bytes[o + 128 + 32 * n + l];
            const s = 8 * n + (l >> 4);
            const sc = (i: number) => view.getInt8(o + 192 + s + i);
            out[y + 128 * n + l] = d * sc(0) * (((a & 0xf) | ((h & 3) << 4)) - 32);
            out[y + 128 * n + l + 32] = d * sc(2) * (((b2 & 0xf) | (((h >> 2) & 3) << 4)) - 32);
            out[y + 128 * n + l + 64] = d * sc(4) * (((a >> 4) | (((h >> 4) & 3) << 4)) - 32);
            out[y + 128 * n + l + 96] = d * sc(6) * (((b2 >> 4) | (((h >> 6) & 3) << 4)) - 32);
          }
        }
        break;
      }
      case GgmlType.Q2_K: {
        // scales[16], qs[64], d, dmin. Element 128n + 32j + 16h + l (n 0..1, j 0..3, h 0..1, l 0..15) is bits
        // 2j..2j+1 of qs[32n + 16h + l]; its sub-block s = 8n + 2j + h has scale scales[s] & 15 and min
        // scales[s] >> 4; value d·scale·q - dmin·min.
        const d = half(o + 80);
        const dmin = half(o + 82);
        for (let n = 0; n < 2; n++) {
          for (let j = 0; j < 4; j++) {
            for (let h = 0; h < 2; h++) {
              const sc = bytes[o + 8 * n + 2 * j + h];
              for (let l = 0; l < 16; l++) {
                const q = (bytes[o + 16 + 32 * n + 16 * h + l] >> (2 * j)) & 3;
                out[y + 128 * n + 32 * j + 16 * h + l] = d * (sc & 0xf) * q - dmin * (sc >> 4);
              }
            }
          }
        }
        break;
      }
      case GgmlType.Q3_K: {
        // hmask[32], qs[64], scales[12], d. Element 128n + 32j + 16h + l as in Q2_K: low 2 bits from bits 2j..2j+1
        // of qs[32n + 16h + l], the third bit is bit 4n + j of hmask[16h + l] (set: q, clear: q - 4). Sub-block
        // s = 8n + 2j + h has the 6-bit scale (low nibble of scales[s % 8], high if s >= 8) | (bits 2(s/4)..+1 of
        // scales[8 + s % 4]) << 4; value d·(scale - 32)·q.
        const d = half(o + 108);
        const scale = (s: number) => {
          const low = (bytes[o + 96 + (s % 8)] >> (4 * (s >> 3))) & 0xf;
          const high = (bytes[o + 104 + (s % 4)] >> (2 * (s >> 2))) & 3;
          return (low | (high << 4)) - 32;
        };
        for (let n = 0; n < 2; n++) {
          for (let j = 0; j < 4; j++) {
            for (let h = 0; h < 2; h++) {
              const dl = d * scale(8 * n + 2 * j + h);
              for (let l = 0; l < 16; l++) {
                const low = (bytes[o + 32 + 32 * n + 16 * h + l] >> (2 * j)) & 3;
                const high = (bytes[o + 16 * h + l] >> (4 * n + j)) & 1;
                out[y + 128 * n + 32 * j + 16 * h + l] = dl * (low - (high ? 0 : 4));
              }
            }
          }
        }
        break;
      }
      case GgmlType.IQ4_NL: {
        // d, qs[16]: as Q4_0, but a code selects one of the 16 IQ4_NL levels: value d·level[q].
        const d = half(o);
        for (let j = 0; j < 16; j++) {
          const q = bytes[o + 2 + j];
          out[y + j] = d * IQ4_NL_LEVELS[q & 0xf];
          out[y + j + 16] = d * IQ4_NL_LEVELS[q >> 4];
        }
        break;
      }
      case GgmlType.IQ4_XS: {
        // d, scales_h (u16), scales_l[4], qs[128]. Sub-block b (32 elements) is an IQ4_NL block of qs[16b..16b+15]
        // with scale d·(ls - 32), ls = nibble b % 2 of scales_l[b / 2] | (bits 2b..2b+1 of scales_h) << 4.
        const d = half(o);
        const scalesHigh = view.getUint16(o + 2, true);
        for (let b = 0; b < 8; b++) {
          const ls = ((bytes[o + 4 + (b >> 1)] >> (4 * (b & 1))) & 0xf) | (((scalesHigh >> (2 * b)) & 3) << 4);
          const dl = d * (ls - 32);
          for (let j = 0; j < 16; j++) {
            const q = bytes[o + 8 + 16 * b + j];
            out[y + 32 * b + j] = dl * IQ4_NL_LEVELS[q & 0xf];
            out[y + 32 * b + j + 16] = dl * IQ4_NL_LEVELS[q >> 4];
          }
        }
        break;
      }
      default:
        throw new Error(`no reference dequantizer for ${info.name}`);
    }
  }
  return out;
}

/** Byte offsets of the f16 scale fields in one block, per quantized type. */
export const F16_SCALE_OFFSETS: Readonly<Partial<Record<GgmlType, readonly number[]>>> = {
  [GgmlType.Q4_0]: [0],
  [GgmlType.Q4_1]: [0, 2],
  [GgmlType.Q5_0]: [0],
  [GgmlType.Q5_1]: [0, 2],
  [GgmlType.Q8_0]: [0],
  [GgmlType.Q4_K]: [0, 2],
  [GgmlType.Q5_K]: [0, 2],
  [GgmlType.Q6_K]: [208],
  [GgmlType.Q2_K]: [80, 82],
  [GgmlType.Q3_K]: [108],
  [GgmlType.IQ4_NL]: [0],
  [GgmlType.IQ4_XS]: [0],
};

/**
 * Random but valid GGUF bytes for `count` elements of `type`: random block bytes with every f16 scale set to a
 * random value in ±scale (so nothing is infinite or NaN); dense types get random values in ±1.
 */
export function randomWeightBytes(type: GgmlType, count: number, random: () => number, scale = 0.05): Uint8Array {
  const info = GGML_TYPE_INFO[type];
  if (!info) throw new Error(`unknown GGML type ${type}`);
  const blocks = count / info.blockSize;
  const bytes = new Uint8Array(blocks * info.blockBytes);
  const view = new DataView(bytes.buffer);
  const value = () => random() * 2 - 1;
  if (type === GgmlType.F32) {
    for (let i = 0; i < count; i++) view.setFloat32(i * 4, value(), true);
    return bytes;
  }
  if (type === GgmlType.F16) {
    for (let i = 0; i < count; i++) view.setUint16(i * 2, f32ToF16Bits(value()), true);
    return bytes;
  }
  if (type === GgmlType.BF16) {
    for (let i = 0; i < count; i++) {
      f16Scratch.setFloat32(0, value());
      view.setUint16(i * 2, f16Scratch.getUint32(0) >>> 16, true);
    }
    return bytes;
  }
  for (let i = 0; i < bytes.length; i++) bytes[i] = Math.floor(random() * 256);
  const offsets = F16_SCALE_OFFSETS[type] ?? [];
  for (let b = 0; b < blocks; b++) {
    for (const at of offsets) view.setUint16(b * info.blockBytes + at, f32ToF16Bits(value() * scale), true);
  }
  return bytes;
}
