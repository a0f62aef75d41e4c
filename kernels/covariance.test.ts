import { describe, expect, it } from 'vitest';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches, uniformBuffer } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { prepareCovariance, prepareKeyEnergy } from './covariance.ts';
import { covarianceReference, keyEnergyReference } from './reference/covariance.ts';

const ctx = withTestGpu();

async function runCovariance(
  tokens: number,
  heads: number,
  headDim: number,
  matrices: number,
  weighted: boolean,
  gpu: GpuContext = ctx.gpu,
) {
  const random = seededRandom(tokens + heads * 3 + headDim + (weighted ? 7 : 0));
  const x = randomFloats(random, tokens * heads * headDim, 2);
  const w = weighted ? Float32Array.from({ length: tokens * matrices }, () => random() * 3) : undefined;
  const initial = randomFloats(random, matrices * headDim * headDim, 1); // accumulation adds to what is there
  const xb = gpu.allocator.createStorage('x', 'scratch', x);
  const wb = w ? gpu.allocator.createStorage('w', 'scratch', w) : null;
  const cb = gpu.allocator.createStorage('cov', 'scratch', initial);
  const step = uniformBuffer(gpu, 'step', [0, tokens, 0, 0], 'uuuu');
  const d = prepareCovariance(gpu, 'cov', {
    x: xb,
    weights: wb,
    covariance: cb,
    firstMatrix: 0,
    matrices,
    heads,
    headDim,
    step,
  });
  submitDispatches(gpu, 'cov', [d]);
  const actual = await readFloat32(gpu, cb, initial.length);
  releaseDispatches(gpu, [d]);
  for (const b of [xb, wb, cb, step]) if (b) gpu.allocator.release(b);
  const expected = covarianceReference(x, { tokens, heads, headDim, matrices, weights: w });
  for (let i = 0; i < expected.length; i++) expected[i] += initial[i];
  return { actual, expected };
}

describe('calibration moment kernels', () => {
  it.each([
    [5, 4, 8, 2, false],
    [17, 8, 64, 2, true],
    [3, 2, 128, 2, false],
  ] as const)(
    'covariance matches the reference (%i tokens, %i heads, d %i, %i matrices, weighted %s)',
    async (tokens, heads, headDim, matrices, weighted) => {
      const { actual, expected } = await runCovariance(tokens, heads, headDim, matrices, weighted);
      expect(maxToleranceRatio(actual, expected, 1e-3, 1e-4)).toBeLessThanOrEqual(1);
    },
  );

  it('catches a broken kernel (one head of each group skipped)', async () => {
    const broken = mutateShaders(ctx.gpu, {
      label: 'covariance',
      edit: (code) => code.replace('g < params.headsPerMatrix', 'g + 1u < params.headsPerMatrix'),
    });
    const { actual, expected } = await runCovariance(5, 4, 8, 2, false, broken.gpu);
    expect(broken.mutated).toEqual(['covariance']);
    expect(maxToleranceRatio(actual, expected, 1e-3, 1e-4)).toBeGreaterThan(1);
  });

  it('key energy k·S·kᵀ matches the reference', async () => {
    const { gpu } = ctx;
    const random = seededRandom(11);
    const tokens = 6;
    const kvHeads = 2;
    const d = 64;
    const k = randomFloats(random, tokens * kvHeads * d, 1);
    const s = randomFloats(random, kvHeads * d * d, 1);
    const kb = gpu.allocator.createStorage('k', 'scratch', k);
    const sb = gpu.allocator.createStorage('s', 'scratch', s);
    const eb = gpu.allocator.createStorage('e', 'scratch', tokens * kvHeads * 4);
    const step = uniformBuffer(gpu, 'step', [0, tokens, 0, 0], 'uuuu');
    const dispatch = prepareKeyEnergy(gpu, 'energy', {
      k: kb,
      queryMoment: sb,
      firstMatrix: 0,
      energy: eb,
      kvHeads,
      headDim: d,
      maxTokens: tokens,
      step,
    });
    submitDispatches(gpu, 'energy', [dispatch]);
    const actual = await readFloat32(gpu, eb, tokens * kvHeads);
    releaseDispatches(gpu, [dispatch]);
    for (const b of [kb, sb, eb, step]) gpu.allocator.release(b);
    expect(maxToleranceRatio(actual, keyEnergyReference(k, s, tokens, kvHeads, d), 1e-3, 1e-4)).toBeLessThanOrEqual(1);
  });
});
