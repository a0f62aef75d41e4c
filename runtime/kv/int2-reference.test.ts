import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { referenceLogProbs } from '../../test/model-reference.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { logProbability } from '../eval/perplexity.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import type { KvPrecisionPlan } from './precision-plan.ts';
import { encodeRotations } from './rotation-store.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const textPath = sharedPath('corpora/tinystories/TinyStories-valid-30KB-subset.txt');

describe.skipIf(!modelPath || !textPath)('int2 KV cache against an f64 reference of the same quantization', () => {
  it('decoding with demoted pages gives the log-probabilities of the reference model reading dequantized history', async () => {
    await compareWithReference();
  });

  it('a precision plan mixing 1-, 2- and 4-bit K and V rows and clips, stored with the rotations, reads back as the reference quantizes it', async () => {
    // Identity "calibrated" rotations carry the plan through the rotation cache, the load and the pool into the
    // demotion and attention kernels; the reference quantizes each layer's K and V as the plan says.
    const plan: KvPrecisionPlan = [
      { key: { bits: 4, clipQuantile: 1 }, value: { bits: 1, clipQuantile: 1 } },
      { key: { bits: 2, clipQuantile: 0.92 }, value: { bits: 4, clipQuantile: 1 } },
      { key: { bits: 1, clipQuantile: 1 }, value: { bits: 2, clipQuantile: 0.96 } },
      { key: { bits: 2, clipQuantile: 1 }, value: { bits: 2, clipQuantile: 1 } },
      { key: { bits: 4, clipQuantile: 1 }, value: { bits: 4, clipQuantile: 1 } },
    ];
    await compareWithReference(plan);
  });

  async function compareWithReference(plan?: KvPrecisionPlan) {
    const { gpu } = ctx;
    const engine = new ModelRunner(gpu);
    // 1-bit codes need groups of at least 32 values (the whole 4 × 8 row here).
    const kv = { sink: 16, window: 32, groupSize: plan ? 32 : 16 };
    const source = await sourceFromPath(modelPath!);
    if (plan) {
      const c = { layers: 5, kvHeads: 4, headDim: 8 };
      const identity = new Float32Array(c.layers * c.kvHeads * c.headDim * c.headDim);
      for (let m = 0; m < c.layers * c.kvHeads; m++)
        for (let i = 0; i < c.headDim; i++) identity[m * c.headDim * c.headDim + i * c.headDim + i] = 1;
      const bytes = encodeRotations({ key: identity, value: identity, tokens: 0, plan });
      await engine.load(source, {
        kv: 'int2',
        rotation: 'calibrated',
        ...kv,
        prefillChunk: 1,
        rotationCache: { get: async () => bytes, set: async () => {} },
      });
      expect(engine.loaded!.pool.quant!.plan).toEqual(plan);
    } else {
      await engine.load(source, { kv: 'int2', rotation: 'none', ...kv, prefillChunk: 1 });
    }
    const ids = engine.tokenizer
      .encode(readFileSync(textPath!, 'utf8').slice(0, 2000), { addSpecial: true })
      .slice(0, 120);
    const vocab = engine.config.vocab;
    const ours = await engine.teacherForcedLogits(ids);
    engine.unload();
    const quantized = await referenceLogProbs(modelPath!, ids, {
      emulateLlamaCpp: false,
      kvQuant: { ...kv, pageTokens: 16, bits: 2, plan },
    });
    const exact = await referenceLogProbs(modelPath!, ids, { emulateLlamaCpp: false });
    let differenceToQuantized = 0;
    let differenceToExact = 0;
    let worst = 0;
    for (let t = 0; t + 1 < ids.length; t++) {
      const target = ids[t + 1];
      const mine = logProbability(ours, t * vocab, vocab, target);
      const d = Math.abs(mine - quantized[t * vocab + target]);
      differenceToQuantized += d;
      differenceToExact += Math.abs(mine - exact[t * vocab + target]);
      worst = Math.max(worst, d);
    }
    const count = ids.length - 1;
    console.info(
      `int2 vs reference: mean |Δ log p| ${(differenceToQuantized / count).toFixed(4)} (max ${worst.toFixed(3)}) to the quantized reference, ${(differenceToExact / count).toFixed(4)} to the exact one`,
    );
    // GPU and CPU may round a value to neighbouring codes at a boundary; on average they must agree closely, and far
    // more closely than the quantization itself moves the model.
    expect(differenceToQuantized / count).toBeLessThan(0.02);
    expect(differenceToExact / count).toBeGreaterThan(5 * (differenceToQuantized / count));
  }
});
