/**
 * The int2 cache's checks on a generated model of one architecture (runtime/kv/int2-*.test.ts): the model written once
 * per file, teacher-forced logits under load options (optionally after calibrating rotations on the same ids), the
 * Hadamard and calibrated comparisons against the f16 cache, and the mean log-probability gap to a reference.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, expect, it } from 'vitest';
import type { GpuContext } from '../core/gpu/device.ts';
import { calibrateKvRotations, storedRotations } from '../runtime/calibration/calibrate.ts';
import { type LoadOptions, ModelRunner } from '../runtime/engine/model-runner.ts';
import { logProbability } from '../runtime/eval/perplexity.ts';
import { sourceFromPath } from '../runtime/gguf/node-source.ts';
import { type ModelFixtureSpec, writeModelFixture } from '../tools/fixtures/model-fixtures.ts';
import { maxAbsDiff, meanAbsDiff } from './logit-diff.ts';
import { seededRandom } from './random.ts';

/** The 2-bit cache the checks run: sink and window of one 16-token page each. */
export const INT2: LoadOptions = { kv: 'int2', sink: 16, window: 16, kvBudgetBytes: 4 << 20 };

export interface Int2Fixture {
  readonly ids: number[];
  /** The GGUF file (after beforeAll). */
  path(): string;
  /** Teacher-forced logits under `options`; with `calibrate`, after switching to rotations fitted on `ids`. */
  run(options: LoadOptions, calibrate?: boolean): Promise<{ logits: Float32Array; demotions: number; vocab: number }>;
  /** Mean |Δ log p| of the next tokens between `ours` (logits of `run`) and a reference's log-probabilities. */
  meanGap(ours: { logits: Float32Array; vocab: number }, reference: Float64Array): number;
}

/** Writes `spec` in beforeAll (removed in afterAll) and draws `tokens` ids from `seed`; call inside a describe. */
export function int2Fixture(
  ctx: { readonly gpu: GpuContext },
  spec: ModelFixtureSpec,
  tokens: number,
  seed: number,
): Int2Fixture {
  let dir = '';
  let path = '';
  const random = seededRandom(seed);
  const ids = [1, ...Array.from({ length: tokens - 1 }, () => Math.floor(random() * spec.vocab))];
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), `longtab-${spec.architecture}-int2-`));
    path = await writeModelFixture(spec, dir);
  });
  afterAll(async () => {
    if (dir) await rm(dir, { recursive: true });
  });
  return {
    ids,
    path: () => path,
    async run(options, calibrate = false) {
      const engine = new ModelRunner(ctx.gpu);
      const source = await sourceFromPath(path);
      try {
        await engine.load(source, options);
        if (calibrate) {
          const fitted = await calibrateKvRotations(ctx.gpu, engine.config, engine.loaded!.weights, ids, {
            chunk: 16,
          });
          await engine.switchToCalibratedRotations(storedRotations(fitted));
          expect(engine.loaded!.kv.rotation.kind).toBe('calibrated');
        }
        const logits = await engine.teacherForcedLogits(ids);
        expect(engine.pool.audit()).toEqual([]);
        return { logits, demotions: engine.pool.demotions, vocab: engine.config.vocab };
      } finally {
        engine.unload();
        await source.close?.();
      }
    },
    meanGap(ours, reference) {
      let sum = 0;
      for (let t = 0; t + 1 < ids.length; t++) {
        const target = ids[t + 1];
        sum += Math.abs(
          logProbability(ours.logits, t * ours.vocab, ours.vocab, target) - reference[t * ours.vocab + target],
        );
      }
      return sum / (ids.length - 1);
    },
  };
}

/**
 * The two rotation checks against the f16 cache: with nothing demoted the rotated cache equals it up to the rotation's
 * rounding (< 0.03 max |Δ logit|); demoted, the 2-bit error is at least 20× that and under 1.5 mean |Δ logit|; with
 * the Hadamard rotation, page-sized prefill chunks agree with token-by-token decode to 1/20 of the 2-bit error. No GPU
 * buffer is left behind. `name` labels the logs; `titles` the two tests.
 */
export function int2RotationChecks(
  ctx: { readonly gpu: GpuContext },
  fixture: Int2Fixture,
  name: string,
  titles: { hadamard: string; calibrated: string },
): void {
  const { run, ids } = fixture;
  it(titles.hadamard, async () => {
    const baseline = ctx.gpu.allocator.snapshot().totalBuffers;
    const f16 = await run({ kv: 'f16', kvBudgetBytes: 4 << 20, prefillChunk: 16 });
    const rotatedF16 = await run({ ...INT2, window: 4096, rotation: 'hadamard', prefillChunk: 16 });
    const rotatedF16ByToken = await run({ ...INT2, window: 4096, rotation: 'hadamard', prefillChunk: 1 });
    const byPage = await run({ ...INT2, rotation: 'hadamard', prefillChunk: 16 });
    const byToken = await run({ ...INT2, rotation: 'hadamard', prefillChunk: 1 });
    expect(rotatedF16.demotions).toBe(0);
    expect(byToken.demotions).toBeGreaterThan(0);
    const rotation = Math.max(
      maxAbsDiff(rotatedF16.logits, f16.logits),
      maxAbsDiff(rotatedF16ByToken.logits, f16.logits),
    );
    const quantization = meanAbsDiff(byToken.logits, f16.logits);
    const order = meanAbsDiff(byPage.logits, byToken.logits);
    console.log(
      `${name} int2 (Hadamard) over ${ids.length} tokens: rotation alone max |Δ logit| ${rotation.toExponential(2)}, ` +
        `2-bit mean |Δ logit| ${quantization.toExponential(2)}, page chunks vs token by token ${order.toExponential(2)}`,
    );
    expect(rotation).toBeLessThan(0.03);
    expect(quantization).toBeGreaterThan(20 * rotation);
    expect(quantization).toBeLessThan(1.5);
    expect(order).toBeLessThan(quantization / 20);
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline);
  });

  it(titles.calibrated, async () => {
    const baseline = ctx.gpu.allocator.snapshot().totalBuffers;
    const f16 = await run({ kv: 'f16', kvBudgetBytes: 4 << 20, prefillChunk: 16 });
    const rotatedF16 = await run({ ...INT2, window: 4096, rotation: 'hadamard', prefillChunk: 16 }, true);
    const quantized = await run({ ...INT2, rotation: 'hadamard', prefillChunk: 1 }, true);
    expect(rotatedF16.demotions).toBe(0);
    expect(quantized.demotions).toBeGreaterThan(0);
    const rotation = maxAbsDiff(rotatedF16.logits, f16.logits);
    const quantization = meanAbsDiff(quantized.logits, f16.logits);
    console.log(
      `${name} int2 (calibrated) over ${ids.length} tokens: rotation alone max |Δ logit| ${rotation.toExponential(2)}, ` +
        `2-bit mean |Δ logit| ${quantization.toExponential(2)}`,
    );
    expect(rotation).toBeLessThan(0.03);
    expect(quantization).toBeGreaterThan(20 * rotation);
    expect(quantization).toBeLessThan(1.5);
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline);
  });
}
