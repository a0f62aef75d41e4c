import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { multiply, transpose } from '../kv/rotation.ts';
import { calibrateKvRotations } from './calibrate.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);

function spread(diagonal: number[]): number {
  return Math.max(...diagonal) / (diagonal.reduce((a, b) => a + b, 0) / diagonal.length);
}

describe.skipIf(!modelPath)('KV calibration on stories260K activations', () => {
  it('fits orthogonal rotations that equalize the measured query and value energy across channels', async () => {
    const { gpu } = ctx;
    const engine = new ModelRunner(gpu);
    await engine.load(await sourceFromPath(modelPath!), { kv: 'f16' });
    const before = gpu.allocator.snapshot().totalBuffers;
    const generated = await engine.generate({
      promptIds: [1],
      maxTokens: 200,
      stopAtEog: false,
      sampling: { temperature: 0.9, seed: 4 },
    });
    const tokens = [1, ...generated.ids];
    const { config } = engine;
    const weights = engine.loaded!.weights;
    const result = await calibrateKvRotations(gpu, config, weights, tokens, { chunk: 64 });
    expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
    const d = config.headDim;
    let improved = 0;
    const matrices = config.layers * config.kvHeads;
    for (let m = 0; m < matrices; m++) {
      for (const [rotations, moment] of [
        [result.key, result.moments.query],
        [result.value, result.moments.value],
      ] as const) {
        const r = Float64Array.from(rotations.subarray(m * d * d, (m + 1) * d * d));
        const s = Float64Array.from(moment.subarray(m * d * d, (m + 1) * d * d));
        const identity = multiply(r, transpose(r, d), d);
        for (let i = 0; i < d; i++)
          for (let j = 0; j < d; j++) expect(Math.abs(identity[i * d + j] - (i === j ? 1 : 0))).toBeLessThan(1e-5);
        // Moments are real second moments: symmetric with a positive diagonal.
        for (let i = 0; i < d; i++) expect(s[i * d + i]).toBeGreaterThan(0);
        const rotated = multiply(multiply(transpose(r, d), s, d), r, d);
        const diagBefore = Array.from({ length: d }, (_, i) => s[i * d + i]);
        const diagAfter = Array.from({ length: d }, (_, i) => rotated[i * d + i]);
        if (spread(diagAfter) < spread(diagBefore)) improved++;
        expect(spread(diagAfter)).toBeLessThan(spread(diagBefore) * 1.05 + 0.05);
      }
    }
    expect(improved).toBeGreaterThan(matrices); // most of the 2 × layers × kvHeads matrices get flatter
    engine.unload();
  });
});
