import { describe, expect, it } from 'vitest';
import { GgmlType } from '../../core/gguf-types.ts';
import { dequantize, f16ToF32 } from '../../kernels/reference/dequantize.ts';
import { seededRandom } from '../../test/random.ts';
import { quantizeQ4_0, quantizeQ8_0 } from './export.ts';

describe('the demo exporter quantizes as llama.cpp does', () => {
  it('Q4_0: d = (value of largest magnitude) / −8, codes trunc(x/d + 8.5) capped at 15; the reader gets them back', () => {
    // One block: the largest magnitude is −0.8, so d = 0.1: −0.8 codes to 0, 0.62 to 14, 0.1 to 9, 0 to 8.
    const block = new Float32Array(32);
    block[0] = -0.8;
    block[1] = 0.62;
    block[16] = 0.1;
    const bytes = quantizeQ4_0(block);
    expect(bytes.length).toBe(18);
    expect(f16ToF32(bytes[0] | (bytes[1] << 8))).toBeCloseTo(0.1, 4);
    expect(bytes[2] & 15).toBe(0); // value 0
    expect(bytes[3] & 15).toBe(14); // value 1: 6.2 + 8.5 = 14.7 → 14
    expect(bytes[2] >> 4).toBe(9); // value 16: 1 + 8.5 = 9.5 → 9
    expect(bytes[4] & 15).toBe(8); // a zero
    // Random blocks: every value read back within one step d of itself (the code is truncated, not rounded).
    const random = seededRandom(43);
    const values = Float32Array.from({ length: 4096 }, () => (random() * 2 - 1) * 0.05);
    const back = dequantize(GgmlType.Q4_0, quantizeQ4_0(values), values.length);
    for (let b = 0; b < values.length / 32; b++) {
      let amax = 0;
      for (let j = 0; j < 32; j++) amax = Math.max(amax, Math.abs(values[b * 32 + j]));
      for (let j = 0; j < 32; j++)
        expect(Math.abs(back[b * 32 + j] - values[b * 32 + j])).toBeLessThanOrEqual(amax / 8 + 1e-6);
    }
    expect(() => quantizeQ4_0(new Float32Array(31))).toThrow(/multiple of 32/);
  });

  it('Q8_0 reads back within half a step', () => {
    const random = seededRandom(8);
    const values = Float32Array.from({ length: 1024 }, () => random() * 2 - 1);
    const back = dequantize(GgmlType.Q8_0, quantizeQ8_0(values), values.length);
    for (let i = 0; i < values.length; i++) expect(Math.abs(back[i] - values[i])).toBeLessThan(1 / 127);
  });
});
