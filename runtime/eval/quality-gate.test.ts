/**
 * The CI quality gate of the 2-bit KV cache (issue 10, point 5), on the shipped demo model and held-out prose: the
 * f16 cache passes, the weak controls (naive INT2: no rotation, no clipping; 1-bit codes) are measurably worse, and
 * calibrated INT2 (the model's embedded rotations and clip quantiles) holds.
 *
 * Perplexity over 256 in-domain tokens says little about a cache: most of what the model predicts there comes from
 * the recent f16 window. The gate therefore also measures attention fidelity (runtime/eval/fidelity.ts: per layer,
 * how far a cache moves each query's attention output and weights), which a bad cache does fail. The long-context
 * perplexity table, where naive INT2 costs far more, is in docs/kv-cache.md. Every tolerance below is the value
 * measured on lavapipe with a stated margin; the numbers and the configuration are in docs/kv-cache.md ("CI quality
 * gate").
 *
 * A small configuration, so it runs in CI on a CPU adapter: one window of 256 tokens with a 16-token sink and a
 * 64-token f16 window (the shipped 64/256 quantizes nothing before token 336), the runtime's group of 128 and
 * prefill chunks of 32 (below the window, so the chunked prefill reads about the history decoding would).
 */
import { readFileSync } from 'node:fs';
import { beforeAll, describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { referenceLogProbs } from '../../test/model-reference.ts';
import { sharedPath } from '../../test/shared.ts';
import { defaultModelPath } from '../cli/default-model.ts';
import { cliLoadOptions, kvOptionsFor } from '../cli/eval.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { rotationsFromMetadata } from '../kv/rotation-store.ts';
import {
  accumulateLayerFidelity,
  type CalibratedKv,
  emptySums,
  type FidelitySummary,
  fidelityVariant,
  type QuantPolicy,
  summarize,
} from './fidelity.ts';
import { captureAttentionInputs } from './fidelity-capture.ts';
import { type PerplexityResult, perplexity, topOneAgreement, type WindowScorer } from './perplexity.ts';

const TOKENS = 256;
const SINK = 16;
const WINDOW = 64;
const PREFILL_CHUNK = 32;
/** The fidelity emulation's view of the same cache: decoding, one query per step (runtime/eval/fidelity.ts). */
const POLICY: QuantPolicy = { sink: SINK, window: WINDOW, pageTokens: 16, stepTokens: 1 };

/** Held out of the demo model's training: the last 5% of each Austen novel (tools/train-demo-model/README.md). */
const TEXT = 'corpora/austen/persuasion.txt';

/** tools/train-demo-model/tokenizer.py split_train_val: the tail after the first line break past 95% of the text. */
function validationSplit(text: string): string {
  const cut = text.indexOf('\n', Math.floor(text.length * 0.95));
  return text.slice(cut + 1);
}

const ctx = withTestGpu();
const textPath = sharedPath(TEXT);

interface GateMeasurements {
  fidelity: FidelitySummary;
  /**
   * Perplexity over the window per cache: the GPU's f16, int2-calibrated (also with layer 5 boosted to 4 bits, the
   * layer this model reads its history with: docs/kv-cache.md) and int1-none, and the f64 reference.
   */
  perplexity: Record<
    'f16' | 'int2' | 'int2-calibrated' | 'int2-calibrated+L5' | 'int1-none' | 'exact',
    PerplexityResult
  >;
  /** The precision plan the GPU's int2 cache was laid out by, and the one embedded in the model. */
  plan: { loaded: unknown; embedded: unknown };
  /** The GPU's int2-calibrated cache and the emulated one: rotation mode and clip quantiles of each. */
  calibratedCache: { rotation: string; clip: { key?: number; value?: number }; embeddedClip?: CalibratedKv['clip'] };
}

describe.skipIf(!textPath)('KV cache quality gate: demo model, 256 held-out tokens of Persuasion', () => {
  const measured = {} as GateMeasurements;

  beforeAll(async () => {
    const { gpu } = ctx;
    const modelPath = defaultModelPath();
    const engine = new ModelRunner(gpu);
    const source = await sourceFromPath(modelPath);
    const load = (mode: string) => {
      const base = kvOptionsFor(mode);
      return engine.load(
        source,
        cliLoadOptions({
          ...base,
          prefillChunk: PREFILL_CHUNK,
          maxSequences: 1,
          experimental: { ...base.experimental, sink: SINK, window: WINDOW },
        }),
      );
    };
    try {
      const config = await load('f16');
      const heldOut = validationSplit(readFileSync(textPath as string, 'utf8'));
      const ids = engine.tokenizer.encode(heldOut, { addSpecial: false }).slice(0, TOKENS);
      expect(ids.length).toBe(TOKENS);
      const score = (scorer: WindowScorer) => perplexity(scorer, ids, TOKENS, config.vocab, { maxWindows: 1 });
      const f16 = await score(engine);

      // Fidelity: one f16 forward's q/k/v, each cache emulated on them. 'f32' keeps K/V unrounded, so its error
      // is what the f16 cache itself costs against exact storage.
      const captured = await captureAttentionInputs(gpu, config, engine.loaded!.weights, ids, { chunk: 128 });
      const calibrated = rotationsFromMetadata(engine.loaded!.file.metadata, config);
      const variants = ['f32', 'int2-none', 'int2-calibrated', 'int2', 'int1-none'].map((mode) =>
        fidelityVariant(mode, config, { calibrated }),
      );
      const sums = captured.map((activations, layer) => {
        const layerSums = variants.map(() => emptySums());
        accumulateLayerFidelity(layer, activations, TOKENS, config, POLICY, variants, layerSums);
        return layerSums;
      });
      measured.fidelity = summarize(variants, sums);
      engine.unload();

      await load('int2-calibrated');
      const { keyFormat, valueFormat } = engine.loaded!.kv.options;
      measured.calibratedCache = {
        rotation: engine.loaded!.kv.rotation.kind,
        clip: { key: keyFormat?.clipQuantile, value: valueFormat?.clipQuantile },
        embeddedClip: calibrated?.clip,
      };
      const int2Calibrated = await score(engine);
      engine.unload();
      await load('int2-calibrated+L5');
      const boosted = await score(engine);
      engine.unload();
      // The default: what kv: 'int2' runs, the calibrated rotations and the plan embedded with them.
      await load('int2');
      measured.plan = { loaded: engine.loaded!.pool.quant?.plan, embedded: calibrated?.plan };
      const int2 = await score(engine);
      engine.unload();
      await load('int1-none');
      const int1 = await score(engine);
      engine.unload();

      // f64 forward over the same weights with K/V unrounded: the perplexity an exact cache would give. Its
      // log-probabilities serve as logits (their log-softmax is themselves).
      const exact = await score({
        teacherForcedLogits: async (window) =>
          Float32Array.from(await referenceLogProbs(modelPath, window, { emulateLlamaCpp: false, exactKv: true })),
      });
      measured.perplexity = {
        f16,
        int2,
        'int2-calibrated': int2Calibrated,
        'int2-calibrated+L5': boosted,
        'int1-none': int1,
        exact,
      };
      console.log(gateReport(measured));
    } finally {
      engine.unload();
      await source.close?.();
    }
  }, 300_000);

  const meanError = (mode: string) => measured.fidelity.mean[mode].relativeError;
  const meanKl = (mode: string) => measured.fidelity.mean[mode].kl;
  const perplexityRatio = (mode: keyof GateMeasurements['perplexity'], to: keyof GateMeasurements['perplexity']) =>
    measured.perplexity[mode].perplexity / measured.perplexity[to].perplexity;
  const agreement = (mode: keyof GateMeasurements['perplexity'], to: keyof GateMeasurements['perplexity']) =>
    topOneAgreement(measured.perplexity[to].argmax, measured.perplexity[mode].argmax);

  it('measures what it claims: much of the history is quantized, int2-calibrated is the fitted scheme', () => {
    // Measured 0.460; below 0.3 the window would mostly test the f16 pages.
    expect(measured.fidelity.quantizedFraction).toBeGreaterThan(0.3);
    // The GPU's int2-calibrated cache uses the model's fitted rotations and clip quantiles, as the emulation does.
    const { rotation, clip, embeddedClip } = measured.calibratedCache;
    expect(rotation).toBe('calibrated');
    expect(embeddedClip).toBeDefined();
    expect(clip).toEqual(embeddedClip);
  });

  it('the f16 cache passes: it matches exact (unrounded) K/V in attention and in perplexity', () => {
    for (const { layer, variants } of measured.fidelity.layers) {
      // Measured ≤ 3.2e-4 relative error per layer (KL 1.0e-7 nats on average): f16's 2^-11 rounding, averaged.
      expect(variants.f32.relativeError, `layer ${layer}`).toBeLessThan(1e-3);
      expect(variants.f32.kl, `layer ${layer}`).toBeLessThan(1e-6);
    }
    // The GPU with its f16 cache against the f64 reference with exact K/V: measured perplexity 114.684 vs 114.682
    // (+0.002%), and all 255 top-1 choices agree.
    expect(Math.abs(perplexityRatio('f16', 'exact') - 1)).toBeLessThan(0.005);
    expect(agreement('f16', 'exact')).toBeGreaterThan(0.98);
  });

  it('the weak controls are measurably worse than calibrated INT2', () => {
    // Naive INT2: measured 3.3× the calibrated mean output error (0.187 vs 0.056) and 5.1× its KL (0.105 vs
    // 0.021 nats); worse in every layer. Its perplexity cost shows at long context (docs/kv-cache.md), not in this
    // 256-token window.
    expect(meanError('int2-none')).toBeGreaterThan(1.5 * meanError('int2-calibrated'));
    expect(meanKl('int2-none')).toBeGreaterThan(2 * meanKl('int2-calibrated'));
    for (const { layer, variants } of measured.fidelity.layers)
      expect(variants['int2-none'].relativeError, `layer ${layer}`).toBeGreaterThan(
        1.2 * variants['int2-calibrated'].relativeError,
      );
    // 1-bit codes: measured 50× the calibrated output error (2.77), perplexity 67× f16's, top-1 agreement 0.416.
    expect(meanError('int1-none')).toBeGreaterThan(10 * meanError('int2-calibrated'));
    expect(perplexityRatio('int1-none', 'f16')).toBeGreaterThan(1.5);
    expect(agreement('int1-none', 'f16')).toBeLessThan(0.8);
  });

  it('calibrated INT2 holds, with and without layer 5 boosted: small attention error, perplexity within 3% of f16, top-1 agreement', () => {
    // Measured: mean output error 0.056, KL 0.021 nats, perplexity −0.73%, top-1 agreement 0.949 (13 of 255 differ).
    expect(meanError('int2-calibrated')).toBeLessThan(0.15);
    expect(meanKl('int2-calibrated')).toBeLessThan(0.04);
    expect(Math.abs(perplexityRatio('int2-calibrated', 'f16') - 1)).toBeLessThan(0.03);
    expect(agreement('int2-calibrated', 'f16')).toBeGreaterThan(0.93);
    // Layer 5 at 4 bits: measured perplexity +0.46%, top-1 agreement 0.965 (9 of 255 differ, against 13 without).
    expect(Math.abs(perplexityRatio('int2-calibrated+L5', 'f16') - 1)).toBeLessThan(0.03);
    expect(agreement('int2-calibrated+L5', 'f16')).toBeGreaterThan(0.95);
  });

  it('the default int2 cache (the embedded precision plan) holds as well, and the GPU lays its pages out by that plan', () => {
    expect(measured.plan.embedded).toBeDefined();
    expect(measured.plan.loaded).toEqual(measured.plan.embedded);
    expect(meanError('int2')).toBeLessThan(0.15);
    expect(meanKl('int2')).toBeLessThan(0.04);
    // The plan spends value bits where the model's output depends on them (1-bit values elsewhere), so the mean
    // output error over all layers is not what it minimises; the attention weights (keys) stay far closer than
    // naive INT2's.
    expect(meanKl('int2-none')).toBeGreaterThan(1.5 * meanKl('int2'));
    expect(Math.abs(perplexityRatio('int2', 'f16') - 1)).toBeLessThan(0.03);
    expect(agreement('int2', 'f16')).toBeGreaterThan(0.93);
  });
});

/** One line per cache, logged so a CI run shows the margins and not only pass or fail. */
function gateReport(m: GateMeasurements): string {
  const f16 = m.perplexity.f16.perplexity;
  const lines = Object.entries(m.perplexity).map(
    ([mode, r]) =>
      `${mode}: perplexity ${r.perplexity.toFixed(3)} (${((r.perplexity / f16 - 1) * 100).toFixed(2)}% vs f16), top-1 agreement with f16 ${topOneAgreement(m.perplexity.f16.argmax, r.argmax).toFixed(4)}`,
  );
  for (const [mode, x] of Object.entries(m.fidelity.mean)) {
    const worstLayer = Math.max(...m.fidelity.layers.map((l) => l.variants[mode].relativeError));
    lines.push(
      `${mode}: attention output error ${x.relativeError.toExponential(3)} (worst layer ${worstLayer.toExponential(3)}), KL ${x.kl.toExponential(3)} nats`,
    );
  }
  lines.push(`quantized share of the attended positions ${m.fidelity.quantizedFraction.toFixed(3)}`);
  return `KV quality gate:\n${lines.join('\n')}`;
}
