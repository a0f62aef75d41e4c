import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../test/gpu.ts';
import {
  MIXED_HD64_GQA,
  MIXED_HD128_K2_V4,
  MIXED_ONE_BIT_KEYS,
  MIXED_TWO_SPLIT_PREFILL,
  type MixedCase,
  runMixed,
} from '../test/mixed-attention-harness.ts';

const ctx = withTestGpu();

/** One layer of head size 64 with wide rows (kvHeads × 64 values) in groups of `group`, pages of 8. */
function wideRows(heads: number, kvHeads: number, group: number): MixedCase {
  return {
    layers: 1,
    heads,
    kvHeads,
    headDim: 64,
    pool: { pageTokens: 8, sink: 8, window: 8, keyFormat: { groupSize: group }, valueFormat: { groupSize: group } },
    chunks: [24, 1, 1, 9, 1],
  };
}

/**
 * Two layers of hd 8, 1:1, pages of 4; -14: a rollback into a quant page, which the next write promotes (and a later
 * step demotes again).
 */
const HD8_ROLLBACK: MixedCase = {
  layers: 2,
  heads: 4,
  kvHeads: 4,
  headDim: 8,
  pool: { pageTokens: 4, sink: 4, window: 8, keyFormat: { groupSize: 32 }, valueFormat: { groupSize: 32 } },
  chunks: [10, 3, 1, 1, 1, 1, 1, 6, 1, 1, 1, 1, -14, 1, 1, 6, 1, 1],
};

describe('attention over mixed f16 / quant pages', () => {
  it.each<[string, MixedCase]>([
    ['hd 8, 1:1, group 32 = the whole row (4 heads), pages of 4', HD8_ROLLBACK],
    ['hd 64, 4:1, group 128 spans both heads, pages of 8', MIXED_HD64_GQA],
    ['hd 128, 4:1, K 2-bit group 64 clipped 0.96, V 4-bit clipped 0.9, no sink', MIXED_HD128_K2_V4],
    ['hd 64, 1:1, 1-bit keys, sink not a whole page (rounded up)', MIXED_ONE_BIT_KEYS],
    // Two V code words a head: the decode kernel stages them a word at a time, not as a vec4.
    [
      'hd 64, 4:1, 1-bit values in groups of 64',
      { ...MIXED_HD64_GQA, pool: { ...MIXED_HD64_GQA.pool, valueFormat: { bits: 1, groupSize: 64 } } },
    ],
    [
      'hd 8, 1:1, layer 1 boosted to 4 bits: a rollback promotes rows of both formats',
      { ...HD8_ROLLBACK, pool: { ...HD8_ROLLBACK.pool, boostLayers: [1] } },
    ],
    [
      'hd 64, 4:1, group 64, layer 0 boosted (4-bit, unclipped), layer 1 2-bit clipped 0.96 / 0.94',
      {
        ...MIXED_HD64_GQA,
        pool: {
          ...MIXED_HD64_GQA.pool,
          keyFormat: { groupSize: 64, clipQuantile: 0.96 },
          valueFormat: { groupSize: 64, clipQuantile: 0.94 },
          boostLayers: [0],
        },
      },
    ],
    ['hd 64, 2:1, a prefill chunk over 320 keys (2 splits)', MIXED_TWO_SPLIT_PREFILL],
    // Falcon3's heads: the split kernel's quant tiles hold 8 keys of 256 f32 values, the merge takes its wide build.
    [
      'hd 256, 2:1, K groups of 128 (half a head), V groups of 256, pages of 8',
      {
        layers: 1,
        heads: 4,
        kvHeads: 2,
        headDim: 256,
        pool: { pageTokens: 8, sink: 8, window: 16, keyFormat: { groupSize: 128 }, valueFormat: { groupSize: 256 } },
        chunks: [40, 1, 1, 17, 1, 1],
      },
    ],
    // Rows wider than the demotion's 256 invocations, which rank up to 4 values each in one pass: 832 values.
    ['hd 64, 1:1, 13 KV heads: rows of 832, groups of 64', wideRows(13, 13, 64)],
    // SmolLM2-360M's rows: 5 KV heads of 64, 3:1, in the default group of the whole row (320 values).
    ['hd 64, 3:1, 5 KV heads: rows of 320 in one group', wideRows(15, 5, 320)],
    // 4:1 GQA on one KV head of 64: the default groups of 128 span two positions (a stored row holds both).
    ['hd 64, 4:1, one KV head: groups of 128 over two positions', wideRows(4, 1, 128)],
    [
      'hd 8, 2:1, 4 KV heads (rows of 32): groups of 128 over four positions, 1-bit values, a rollback',
      {
        layers: 2,
        heads: 8,
        kvHeads: 4,
        headDim: 8,
        pool: {
          pageTokens: 8,
          sink: 8,
          window: 8,
          keyFormat: { groupSize: 128 },
          valueFormat: { groupSize: 128, bits: 1 },
        },
        chunks: [20, 1, 1, 1, 9, 1, -13, 1, 1, 8, 1, 9, 1],
      },
    ],
    // Long enough for decode to use several splits of >= 64 keys, each over f16 and quant pages.
    [
      'hd 8, 2:1, stories260K-like, several decode splits',
      {
        layers: 2,
        heads: 8,
        kvHeads: 4,
        headDim: 8,
        pool: { pageTokens: 16, sink: 16, window: 32, keyFormat: { groupSize: 32 }, valueFormat: { groupSize: 32 } },
        chunks: [100, 1, 1, 1, 40, 1, 1, 1, 1],
      },
    ],
  ])('%s', async (_, c) => {
    // The int8 prefill attention's conversion pass reads the same pages (head sizes 64 and 128, with subgroups).
    const checkKeysInt8 = (c.headDim === 64 || c.headDim === 128) && ctx.gpu.features.subgroups;
    const r = await runMixed(ctx.gpu, c, 4242, { checkKeysInt8 });
    if (checkKeysInt8) {
      expect(r.keysInt8.codes).toBeGreaterThan(0);
      expect(r.keysInt8.wrong).toBe(0);
      expect(r.keysInt8.offByOne).toBeLessThanOrEqual(r.keysInt8.codes / 1000);
      expect(r.keysInt8.worstScale).toBeLessThan(1e-6);
    }
    expect(r.demotions).toBeGreaterThan(1);
    if (c.chunks.some((n) => n < 0)) expect(r.promotions).toBeGreaterThan(0);
    expect(r.quantPositions).toBeGreaterThanOrEqual(2 * (c.pool.pageTokens ?? 16));
    // Rows the demotion kernel wrote equal quantizeRow bit for bit (codes and f16 parameters).
    expect(r.values).toBeGreaterThan(0);
    expect(r.mismatchedParams).toBe(0);
    expect(r.mismatchedCodes).toBe(0);
    expect(r.worst).toBeLessThanOrEqual(1);
  });

  // The decode kernel's phase C reads each quant key's V words where phase A staged them: reading the pass's first
  // key's instead (codes, then scales) must fail the comparison, at head size 64 (passes of 256 keys) and 128 (128).
  it.each<[string, MixedCase, (code: string) => string]>([
    [
      'codes of the wrong key, hd 64',
      MIXED_HD64_GQA,
      (c) => c.replace('vStage[jk * V_WH + (part * DIMS) / V_PER]', 'vStage[(part * DIMS) / V_PER]'),
    ],
    [
      'scales of the wrong key, hd 128',
      MIXED_HD128_K2_V4,
      (c) => c.replace('vStageLoHi[jk * V_GH + (part * DIMS) / V_GE]', 'vStageLoHi[(part * DIMS) / V_GE]'),
    ],
  ])('catches a broken decode kernel: %s', async (_, c, edit) => {
    const r = await runMixed(ctx.gpu, c, 4242, { mutation: { label: /^attention-decode-/, edit } });
    expect(r.worst).toBeGreaterThan(1);
  });

  // Values with ties and zeros of both signs (runMixed's `ties`): the demotion's min/max scans must pick the first
  // minimum and the last maximum, as quantizeRow's stable ranks do, and its rank loop (clip quantiles below 1) the
  // same ranks.
  it.each<[string, MixedCase]>([
    ['hd 64, 4:1, 2-bit groups of 128 spanning both heads', MIXED_HD64_GQA],
    ['hd 64, 1:1, 1-bit keys', MIXED_ONE_BIT_KEYS],
    ['hd 128, 4:1, clipped (the rank loop), V 4-bit', MIXED_HD128_K2_V4],
    [
      'hd 128, 1:1, rows of 2048 in 256 4-bit groups of 8',
      {
        layers: 1,
        heads: 16,
        kvHeads: 16,
        headDim: 128,
        pool: {
          pageTokens: 4,
          sink: 4,
          window: 4,
          keyFormat: { bits: 4, groupSize: 8 },
          valueFormat: { bits: 4, groupSize: 8 },
        },
        chunks: [12, 1, 1, 5, 1],
      },
    ],
  ])('ties and signed zeros: %s', async (_, c) => {
    const r = await runMixed(ctx.gpu, c, 77, { ties: true });
    expect(r.demotions).toBeGreaterThan(1);
    expect(r.values).toBeGreaterThan(0);
    expect(r.mismatchedParams).toBe(0);
    expect(r.mismatchedCodes).toBe(0);
    expect(r.worst).toBeLessThanOrEqual(1);
  });
});
