/**
 * The calibration's precision plan on real models (lavapipe): deterministic for a fixed model and text, a stored plan
 * reproducing the greedy output of the plan computed afresh, and on the demo model the measurement finding the layer
 * that carries the copying, which its shipped plan protects. (The whole search on the demo model, 65 probe forwards,
 * is too slow for CI on lavapipe: `longtab calibrate --plan-only` ran it for the shipped plan.)
 */
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { defaultModelPath } from '../cli/default-model.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { DEFAULT_QUANT_POLICY } from '../eval/fidelity.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { type KvLayerPrecision, planEffectiveBits, uniformPlan } from '../kv/precision-plan.ts';
import { encodeRotations, rotationsFromMetadata } from '../kv/rotation-store.ts';
import { calibrateKvRotations, chooseKvPrecisionPlan, measureProbeLoss, storedRotations } from './calibrate.ts';
import { BASELINE_SIDE, retrievalProbe } from './precision-search.ts';

const ctx = withTestGpu();
const storiesPath = sharedPath(STORIES260K);
const storiesText = sharedPath('corpora/tinystories/TinyStories-valid-30KB-subset.txt');
// The demo model's tuning text for the plan (never trained on; the quality tables report on other texts).
const shakespeare = sharedPath('corpora/tinyshakespeare/input.txt');
/**
 * stories260K's context is 512: a sink and window small enough for its probe to read quantized pages, the window
 * wide enough for the probe's prefill chunks of 64 (half the window).
 */
const storiesPolicy = { ...DEFAULT_QUANT_POLICY, sink: 16, window: 128 };

describe.skipIf(!storiesPath || !storiesText)('the calibration chooses a precision plan (stories260K)', () => {
  it('deterministically, and a stored plan gives the same greedy output as the plan computed afresh', async () => {
    const { gpu } = ctx;
    const engine = new ModelRunner(gpu);
    const kv = { kv: 'int2' as const, sink: 16, window: 128, groupSize: 32, prefillChunk: 64 };
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
    // Rows of 32 values: no plan with 2-bit keys fits the budget, so keys are measured at 1 bit as well.
    expect(first.plan!.scores.every((l) => l.key.some((s) => s.candidate.bits === 1))).toBe(true);
    // Within the default budget at 32K positions, under the sink and window the probe was built for.
    const share = { sink: 16, window: 128, pageTokens: 16 };
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
  it('the probe loss finds the layer that carries the copying, and the shipped plan gives it 4-bit K and V', async () => {
    const { gpu } = ctx;
    const engine = new ModelRunner(gpu);
    await engine.load(await sourceFromPath(demoPath), { kv: 'f16' });
    const { config } = engine;
    const rotations = rotationsFromMetadata(engine.loaded!.file.metadata, config)!;
    // Text the model was never trained on, not the calibration's own (the plan's choice is the calibration's).
    const text = engine.tokenizer.encode(readFileSync(shakespeare!, 'utf8').slice(0, 20000), { addSpecial: true });
    const probe = retrievalProbe(text, DEFAULT_QUANT_POLICY);
    const rotation = { kind: 'calibrated' as const, key: rotations.key, value: rotations.value };
    const loss = (plan: KvLayerPrecision[]) =>
      measureProbeLoss(gpu, config, engine.loaded!.weights, probe, {
        plan,
        groupSize: 128,
        policy: DEFAULT_QUANT_POLICY,
        rotation,
      });
    const raisedTo4 = { bits: 4 as const, clipQuantile: 1 };
    const baseline = await loss(uniformPlan(config.layers, BASELINE_SIDE, BASELINE_SIDE));
    // Layer 5 alone at 4-bit K and V; then every other layer at 4 bits and layer 5 left at the baseline.
    const layer5 = uniformPlan(config.layers, BASELINE_SIDE, BASELINE_SIDE);
    layer5[5] = { key: raisedTo4, value: raisedTo4 };
    const others = uniformPlan(config.layers, raisedTo4, raisedTo4);
    others[5] = { key: BASELINE_SIDE, value: BASELINE_SIDE };
    const saved5 = baseline.copy - (await loss(layer5)).copy;
    const savedOthers = baseline.copy - (await loss(others)).copy;
    engine.unload();
    console.info(
      `demo: copy loss ${baseline.copy.toFixed(3)} nats at 2 bits; layer 5 at 4 bits saves ${saved5.toFixed(3)}, the other seven ${savedOthers.toFixed(3)}`,
    );
    // Layer 5 carries the copying: raising it alone saves a clear share of the copy loss (0.27 nats when this was
    // written), raising all seven others saves next to nothing (−0.03).
    expect(saved5).toBeGreaterThan(0.1);
    expect(saved5).toBeGreaterThan(savedOthers + 0.1);
    // The shipped plan (fitted by this measurement: docs/kv-cache.md) protects it, within the budget.
    const plan = rotations.plan!;
    expect(plan[5].key.bits).toBe(4);
    expect(plan[5].value.bits).toBe(4);
    expect(planEffectiveBits(plan, 128, DEFAULT_QUANT_POLICY, 32768)).toBeLessThanOrEqual(2.5 + 1e-9);
  }, 600_000);
});
