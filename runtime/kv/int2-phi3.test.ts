/**
 * The int2 cache on a Phi-4-mini-shaped model (issue 43, point 4): RoPE on 96 of each head's 128 dims with LongRoPE's
 * per-pair factors and attention factor. The rotated cache rotates q, k and v after RoPE, before the store, so the
 * unrotated tail of each head and the factor-scaled angles must reach the 2-bit pages as the f16 cache holds them.
 */
import { describe, expect, it } from 'vitest';
import { GgmlType } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { INT2, int2Fixture, int2RotationChecks } from '../../test/int2-architecture.ts';
import { referenceLogProbs } from '../../test/model-reference.ts';
import type { ModelFixtureSpec } from '../../tools/fixtures/model-fixtures.ts';

const ctx = withTestGpu();

/**
 * Phi-4-mini's heads in small: 128 dims (one 2-bit group), 96 rotated, fused qkv and gate/up, tied output, the long
 * LongRoPE set (the context, 4096, exceeds the original 32) with the converter's attention factor.
 */
const SPEC: ModelFixtureSpec = {
  architecture: 'phi3',
  weightType: GgmlType.Q8_0,
  dim: 256,
  layers: 4,
  heads: 2,
  kvHeads: 1,
  headDim: 128,
  ropeDim: 96,
  ffnDim: 512,
  vocab: 300,
  tiedOutput: true,
  ropeFreqBase: 10000,
  llama3RopeFreqs: false,
  contextLength: 4096,
  longRope: { originalContext: 32, attnFactor: 1.19 },
  seed: 4305,
};
const TOKENS = 96;

describe('int2 KV cache on phi3 (partial rotary, LongRoPE)', () => {
  const fixture = int2Fixture(ctx, SPEC, TOKENS, 45);

  // Measured on lavapipe: 1.6e-2, 0.85 and 1.0e-3 (Hadamard); 1.4e-2 and 0.53 (calibrated).
  int2RotationChecks(ctx, fixture, 'phi3', {
    hadamard:
      'with the Hadamard rotation: nothing demoted, the f16 cache up to rounding; demoted, within the 2-bit error, prefill as decode',
    calibrated:
      'with rotations calibrated on the model: nothing demoted, the f16 cache up to rounding; demoted, within the 2-bit error',
  });

  it('without rotation, decoding gives the log-probabilities of the reference model reading dequantized history', async () => {
    const ids = fixture.ids;
    const ours = await fixture.run({ ...INT2, rotation: 'none', groupSize: 128, prefillChunk: 1 });
    const kvQuant = { sink: 16, window: 16, pageTokens: 16, groupSize: 128, bits: 2 } as const;
    const quantized = await referenceLogProbs(fixture.path(), ids, { emulateLlamaCpp: false, kvQuant });
    const shortSet = await referenceLogProbs(fixture.path(), ids, {
      emulateLlamaCpp: false,
      kvQuant,
      longRopeFactors: 'short',
    });
    const allDims = await referenceLogProbs(fixture.path(), ids, {
      emulateLlamaCpp: false,
      kvQuant,
      rotateAllDims: true,
    });
    const exact = await referenceLogProbs(fixture.path(), ids, { emulateLlamaCpp: false });
    const [toQuantized, toShortSet, toAllDims, toExact] = [quantized, shortSet, allDims, exact].map((r) =>
      fixture.meanGap(ours, r),
    );
    console.info(
      `phi3 int2 vs reference: mean |Δ log p| ${toQuantized.toFixed(4)} to the quantized reference, ` +
        `${toShortSet.toFixed(4)} to it with the short LongRoPE set, ${toAllDims.toFixed(4)} with every dim rotated, ` +
        `${toExact.toFixed(4)} to the exact one`,
    );
    // Measured 0.0005; 2.8 with the short set, 2.6 with every dim rotated, 0.96 to the exact reference.
    expect(toQuantized).toBeLessThan(0.02);
    expect(toExact).toBeGreaterThan(5 * toQuantized);
    expect(toShortSet).toBeGreaterThan(5 * toQuantized);
    expect(toAllDims).toBeGreaterThan(5 * toQuantized);
  });
});
