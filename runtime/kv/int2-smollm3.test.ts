/**
 * The int2 cache on a SmolLM3 model (issue 43, point 4): every 4th layer stores its keys without RoPE. The rotated
 * cache rotates q, k and v after RoPE, before the store; in the no-RoPE layers it must rotate the projections as they
 * are, and the history those layers read back (f16 window and 2-bit pages) is that of unrotated positions.
 */
import { describe, expect, it } from 'vitest';
import { GgmlType } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { INT2, int2Fixture, int2RotationChecks } from '../../test/int2-architecture.ts';
import { referenceLogProbs } from '../../test/model-reference.ts';
import type { ModelFixtureSpec } from '../../tools/fixtures/model-fixtures.ts';

const ctx = withTestGpu();

/** SmolLM3-3B's 128-dim heads (one 2-bit group of 128) and tied output in small; layers 3 and 7 without RoPE. */
const SPEC: ModelFixtureSpec = {
  architecture: 'smollm3',
  weightType: GgmlType.Q8_0,
  dim: 256,
  layers: 8,
  heads: 2,
  kvHeads: 1,
  headDim: 128,
  ffnDim: 512,
  vocab: 300,
  tiedOutput: true,
  ropeFreqBase: 5e6,
  llama3RopeFreqs: false,
  seed: 4304,
};
const TOKENS = 96;

describe('int2 KV cache on smollm3 (layers without RoPE)', () => {
  const fixture = int2Fixture(ctx, SPEC, TOKENS, 44);

  // Measured 1.3e-2, 0.63 (Hadamard; the tied output spreads logits over ±15; a no-RoPE layer rotated wrong is off by more than 0.3) and 1.0e-2, 0.40 (calibrated).
  int2RotationChecks(ctx, fixture, 'smollm3', {
    hadamard:
      'with the Hadamard rotation: nothing demoted, the f16 cache up to rounding; demoted, within the 2-bit error, prefill as decode',
    calibrated:
      'with rotations calibrated on the model (its passes run the no-RoPE layers too): nothing demoted, the f16 cache up to rounding; demoted, within the 2-bit error',
  });

  it('without rotation, decoding gives the log-probabilities of the reference model reading dequantized history', async () => {
    const ids = fixture.ids;
    const ours = await fixture.run({ ...INT2, rotation: 'none', groupSize: 128, prefillChunk: 1 });
    const kvQuant = { sink: 16, window: 16, pageTokens: 16, groupSize: 128, bits: 2 } as const;
    const quantized = await referenceLogProbs(fixture.path(), ids, { emulateLlamaCpp: false, kvQuant });
    const allRoped = await referenceLogProbs(fixture.path(), ids, {
      emulateLlamaCpp: false,
      kvQuant,
      ropeEveryLayer: true,
    });
    const exact = await referenceLogProbs(fixture.path(), ids, { emulateLlamaCpp: false });
    const [toQuantized, toAllRoped, toExact] = [quantized, allRoped, exact].map((r) => fixture.meanGap(ours, r));
    console.info(
      `smollm3 int2 vs reference: mean |Δ log p| ${toQuantized.toFixed(4)} to the quantized reference, ` +
        `${toAllRoped.toFixed(4)} to it with RoPE in every layer, ${toExact.toFixed(4)} to the exact one`,
    );
    expect(toQuantized).toBeLessThan(0.02);
    expect(toExact).toBeGreaterThan(5 * toQuantized);
    expect(toAllRoped).toBeGreaterThan(5 * toQuantized);
  });
});
