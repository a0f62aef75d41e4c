import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { randomFloats, seededRandom } from '../../test/random.ts';
import {
  defaultGroupSize,
  dequantizeRow,
  effectiveBitsPerElement,
  f16Bits,
  f16BitsToNumber,
  positionsPerRow,
  type QuantRowFormat,
  quantizeRow,
  roundToF16,
  roundTripRows,
  rowWords,
  storedRowWidth,
  validateQuantRowFormat,
} from './quant-format.ts';

describe('quantized KV row format', () => {
  it('f16 rounding round-trips every f16 value and matches known roundings', () => {
    for (let h = 0; h < 0x7c00; h += 7) expect(f16Bits(f16BitsToNumber(h))).toBe(h);
    expect(roundToF16(1 + 2 ** -11)).toBe(1); // tie to even
    expect(roundToF16(1 + 3 * 2 ** -11)).toBe(1 + 2 ** -9);
    expect(roundToF16(65520)).toBe(Number.POSITIVE_INFINITY);
  });

  it.each([
    [2, 128, 1],
    [2, 64, 1],
    [1, 128, 1],
    [4, 32, 1],
    [2, 128, 0.96],
  ] as const)(
    '%i-bit codes in groups of %i (clip %s): every value within half a step of its clipped range',
    (bits, groupSize, clipQuantile) => {
      const f: QuantRowFormat = { width: 256, groupSize, bits, clipQuantile };
      const random = seededRandom(bits * 100 + groupSize);
      for (let trial = 0; trial < 20; trial++) {
        const row = randomFloats(random, f.width, 1 + trial);
        const words = quantizeRow(row, f);
        expect(words.length).toBe(rowWords(f));
        const back = dequantizeRow(words, f);
        for (let g = 0; g < f.width / groupSize; g++) {
          const group = Array.from(row.subarray(g * groupSize, (g + 1) * groupSize)).sort((a, b) => a - b);
          const step = (group[group.length - 1] - group[0]) / ((1 << bits) - 1);
          for (let i = g * groupSize; i < (g + 1) * groupSize; i++) {
            if (clipQuantile === 1)
              expect(Math.abs(back[i] - row[i])).toBeLessThanOrEqual(step / 2 + 2e-3 * (1 + trial));
            else expect(Math.abs(back[i] - row[i])).toBeLessThanOrEqual(step + 2e-3 * (1 + trial)); // clipped tails
          }
        }
      }
    },
  );

  it('more bits never increase the mean squared error (property)', () => {
    fc.assert(
      fc.property(
        fc.array(fc.float({ min: -50, max: 50, noNaN: true }), { minLength: 128, maxLength: 128 }),
        (values) => {
          const mse = (bits: 1 | 2 | 4) => {
            const f: QuantRowFormat = { width: 128, groupSize: 128, bits, clipQuantile: 1 };
            const back = dequantizeRow(quantizeRow(values, f), f);
            return back.reduce((s, v, i) => s + (v - values[i]) ** 2, 0);
          };
          const tolerance = 1e-3 * values.reduce((s, v) => s + v * v, 1);
          return mse(2) <= mse(1) + tolerance && mse(4) <= mse(2) + tolerance;
        },
      ),
      { numRuns: 100 },
    );
  });

  it('effective bits: 2.25 for INT2 in groups of 128, approaching it as the 16-bit window amortizes', () => {
    const f: QuantRowFormat = { width: 128, groupSize: 128, bits: 2, clipQuantile: 1 };
    expect(effectiveBitsPerElement(f, 1000, 0)).toBeCloseTo(2.25, 10);
    expect(effectiveBitsPerElement(f, 229376, 320)).toBeLessThan(2.3);
  });

  it('default groups: 128 values where they divide the row, else the fewest whole heads of at least 128 values', () => {
    const cases: [string, number, number, number][] = [
      ['Llama-3.2-1B: 8 heads of 64', 8, 64, 128],
      ['Qwen2.5-0.5B: 2 heads of 64', 2, 64, 128],
      ['Qwen3: 8 heads of 128', 8, 128, 128],
      ['SmolLM2-360M: 5 heads of 64, one group of the row', 5, 64, 320],
      ['SmolLM-135M: 3 heads of 64', 3, 64, 192],
      ['6 heads of 64: 128 values, two heads', 6, 64, 128],
      ['7 heads of 64: no whole heads but the row hold 128 and divide it', 7, 64, 448],
      ['10 heads of 48: 5 heads, the fewest that hold 128 and divide 10', 10, 48, 240],
      ['one head of 64 (4:1 GQA): 128 values over two positions', 1, 64, 128],
      ['stories260K: 4 heads of 8, 128 values over four positions', 4, 8, 128],
      ['one head of 96: the row (128 is no multiple of it)', 1, 96, 96],
      ['2 heads of 8: the row (16 values; a position fills no 1-bit word)', 2, 8, 16],
      ['heads of 160: one head a group', 4, 160, 160],
    ];
    for (const [name, kvHeads, headDim, group] of cases) {
      expect(defaultGroupSize(kvHeads, headDim), name).toBe(group);
      const width = kvHeads * headDim;
      expect(width % group === 0 || group % width === 0, name).toBe(true);
      expect(validateQuantRowFormat({ width, groupSize: group, bits: 2, clipQuantile: 1 }), name).toBeNull();
      // A group lies inside one head or holds whole heads (the attention kernels' rule).
      expect(headDim % group === 0 || group % headDim === 0, name).toBe(true);
    }
  });

  it('a group wider than a row spans positions: a stored row holds them in order, as one row of their values', () => {
    const f: QuantRowFormat = { width: 64, groupSize: 128, bits: 2, clipQuantile: 1 };
    expect(positionsPerRow(f)).toBe(2);
    expect(storedRowWidth(f)).toBe(128);
    expect(rowWords(f)).toBe(8 + 1); // 256 bits of codes, one (lo, scale) pair for both positions
    expect(effectiveBitsPerElement(f, 1000, 0)).toBeCloseTo(2.25, 10);
    const random = seededRandom(7);
    const a = Float32Array.from({ length: 64 }, () => random() * 2 - 1);
    const b = Float32Array.from({ length: 64 }, () => random() * 8 - 4); // the wider range sets the shared scale
    const words = quantizeRow([...a, ...b], f);
    const back = dequantizeRow(words, f);
    const alone = dequantizeRow(quantizeRow([...b, ...b], f), f);
    expect(back.subarray(64)).toEqual(alone.subarray(64)); // one group: b's range decides, a is coded on it
    const step = f16BitsToNumber(words[8] >>> 16);
    expect(step).toBeGreaterThan(7 / 3 - 0.1);
    for (let i = 0; i < 64; i++) expect(Math.abs(back[i] - a[i])).toBeLessThanOrEqual(step / 2 + 1e-6);
    // Three positions: the last stored row repeats the third in its missing place.
    const rows = Float32Array.from({ length: 3 * 64 }, () => random() - 0.5);
    const trip = roundTripRows(rows, f);
    const last = dequantizeRow(quantizeRow([...rows.subarray(128), ...rows.subarray(128)], f), f);
    expect(trip.subarray(0, 128)).toEqual(dequantizeRow(quantizeRow(rows.subarray(0, 128), f), f));
    expect(trip.subarray(128)).toEqual(last.subarray(0, 64));
    expect(() => quantizeRow(a, f)).toThrow(RangeError);
  });

  it('rejects groups over positions where a position would not fill whole code words', () => {
    expect(validateQuantRowFormat({ width: 16, groupSize: 32, bits: 2, clipQuantile: 1 })).toMatch(/multiple of 32/);
    expect(validateQuantRowFormat({ width: 64, groupSize: 192, bits: 2, clipQuantile: 1 })).toBeNull();
    expect(validateQuantRowFormat({ width: 64, groupSize: 96, bits: 2, clipQuantile: 1 })).toMatch(/divide/);
  });
});
