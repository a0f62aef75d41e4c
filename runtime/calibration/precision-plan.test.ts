/**
 * The calibration's precision plan on real models (lavapipe): deterministic for a fixed model and text, the copying
 * layer of the demo model protected, and a stored plan reproducing the greedy output of the plan computed afresh.
 */
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { defaultModelPath } from '../cli/default-model.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { DEFAULT_QUANT_POLICY } from '../eval/fidelity.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { planEffectiveBits } from '../kv/precision-plan.ts';
import { encodeRotations, rotationsFromMetadata } from '../kv/rotation-store.ts';
import { calibrateKvRotations, chooseKvPrecisionPlan, storedRotations } from './calibrate.ts';

const ctx = withTestGpu();
const storiesPath = sharedPath(STORIES260K);
const storiesText = sharedPath('corpora/tinystories/TinyStories-valid-30KB-subset.txt');
// The demo model's tuning text for the plan (never trained on; the quality tables report on other texts).
const shakespeare = sharedPath('corpora/tinyshakespeare/input.txt');
/** stories260K's context is 512: a sink and window small enough for its probe to read quantized pages. */
const storiesPolicy = { ...DEFAULT_QUANT_POLICY, sink: 16, window: 32 };

describe.skipIf(!storiesPath || !storiesText)('the calibration chooses a precision plan (stories260K)', () => {
  it('deterministically, and a stored plan gives the same greedy output as the plan computed afresh', async () => {
    const { gpu } = ctx;
    const engine = new ModelRunner(gpu);
    const kv = { kv: 'int2' as const, sink: 16, window: 32, groupSize: 32, prefillChunk: 16 };
    await engine.load(await sourceFromPath(storiesPath!), { ...kv, rotation: 'hadamard' });
    const { config } = engine;
    const weights = engine.loaded!.weights;
    const text = engine.tokenizer.encode(readFileSync(storiesText!, 'utf8'), { addSpecial: true }).slice(0, 512);
    const options = { clip: { groupSize: 32 }, planPolicy: storiesPolicy };
    const first = await calibrateKvRotations(gpu, config, weights, text, options);
    expect(first.plan).toBeDefined();
    const again = await chooseKvPrecisionPlan(gpu, config, weights, text, first, 32, { policy: storiesPolicy });
    expect(again!.plan).toEqual(first.plan!.plan);
    expect(again!.scores).toEqual(first.plan!.scores);
    // Within the default budget at 32K positions, under the sink and window the probe was built for.
    const share = { sink: 16, window: 32, pageTokens: 16 };
    expect(planEffectiveBits(first.plan!.plan, 32, share, 32768)).toBeLessThanOrEqual(2.5 + 1e-9);
    console.info(`stories260K plan: ${JSON.stringify(first.plan!.plan)}`);

    // Afresh: the fitted result switched in directly. Stored: encoded, cached, loaded by a new load.
    const prompt = text.slice(0, 100);
    const greedy = async () => (await engine.generate({ promptIds: prompt, maxTokens: 24, stopAtEog: false })).ids;
    await engine.switchToCalibratedRotations(storedRotations(first));
    expect(engine.loaded!.pool.quant!.plan).toEqual(first.plan!.plan);
    const afresh = await greedy();
    const bytes = encodeRotations(storedRotations(first));
    await engine.load(await sourceFromPath(storiesPath!), {
      ...kv,
      rotation: 'calibrated',
      rotationCache: { get: async () => bytes, set: async () => {} },
    });
    expect(engine.loaded!.pool.quant!.plan).toEqual(first.plan!.plan);
    expect(await greedy()).toEqual(afresh);
    engine.unload();
  }, 600_000);
});

const demoPath = defaultModelPath();
describe.skipIf(!shakespeare)('the demo model: its copying layer is protected', () => {
  it('the plan gives layer 5 (the layer that carries the copying) 4-bit keys, within 2.5 bits at 32K', async () => {
    const { gpu } = ctx;
    const engine = new ModelRunner(gpu);
    await engine.load(await sourceFromPath(demoPath), { kv: 'f16' });
    const { config } = engine;
    const rotations = rotationsFromMetadata(engine.loaded!.file.metadata, config)!;
    const text = engine.tokenizer.encode(readFileSync(shakespeare!, 'utf8').slice(0, 20000), { addSpecial: true });
    const choice = await chooseKvPrecisionPlan(gpu, config, engine.loaded!.weights, text, rotations, 128);
    engine.unload();
    expect(choice).not.toBeNull();
    const { plan, bitsPerElement, scores } = choice!;
    console.info(`demo plan (${bitsPerElement.toFixed(3)} bits at 32K): ${JSON.stringify(plan)}`);
    for (const [l, s] of scores.entries()) {
      console.info(
        `layer ${l} K ${s.key.map((x) => x.error.toFixed(3)).join(' ')} | V ${s.value.map((x) => x.error.toFixed(3)).join(' ')}`,
      );
    }
    expect(bitsPerElement).toBeLessThanOrEqual(2.5 + 1e-9);
    expect(plan[5].key.bits).toBe(4);
    // Layer 5's 2-bit keys lose more than any other layer's: the protection is the measurement's, not a rule.
    const twoBitKeyError = scores.map((s) =>
      Math.min(...s.key.filter((x) => x.candidate.bits === 2).map((x) => x.error)),
    );
    expect(twoBitKeyError.indexOf(Math.max(...twoBitKeyError))).toBe(5);
  }, 600_000);
});
