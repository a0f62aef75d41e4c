import { describe, expect, it } from 'vitest';
import { readFloat32 } from '../runtime/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { releaseDispatches, submitDispatches, uniformBuffer } from './dispatch.ts';
import { ropeReference } from './reference/rope.ts';
import { prepareRope, type RopeLayout } from './rope.ts';
import { ropeWgsl } from './rope.wgsl.ts';

const ctx = withTestGpu();

async function runRope(
  layout: RopeLayout,
  tokens: number,
  heads: number,
  headDim: number,
  ropeDim: number,
  position: number,
  withFactors: boolean,
  source = ropeWgsl,
) {
  const { gpu } = ctx;
  const random = seededRandom(tokens * 31 + heads * 7 + headDim + position);
  // k has fewer heads than q (GQA), as in every model that uses it.
  const kvHeads = Math.max(1, heads >> 1);
  const q = randomFloats(random, tokens * heads * headDim, 2);
  const k = randomFloats(random, tokens * kvHeads * headDim, 2);
  const factors = withFactors
    ? Float32Array.from({ length: ropeDim / 2 }, () => 1 + random() * 8)
    : new Float32Array(ropeDim / 2).fill(1);
  const qBuffer = gpu.allocator.createStorage('q', 'scratch', q);
  const kBuffer = gpu.allocator.createStorage('k', 'scratch', k);
  const factorBuffer = gpu.allocator.createStorage('factors', 'weights', factors);
  const step = uniformBuffer(gpu, 'step', [position, tokens, 0, 0], 'uuuu');
  const base = 10000;
  const dispatch = prepareRope(
    gpu,
    'rope-test',
    { q: qBuffer, k: kBuffer, freqFactors: factorBuffer, step, tokens, heads, kvHeads, headDim, ropeDim, base, layout },
    source,
  );
  submitDispatches(gpu, 'rope-test', [dispatch]);
  const actual = [...(await readFloat32(gpu, qBuffer, q.length)), ...(await readFloat32(gpu, kBuffer, k.length))];
  releaseDispatches(gpu, [dispatch]);
  for (const b of [qBuffer, kBuffer, factorBuffer, step]) gpu.allocator.release(b);
  const options = { tokens, headDim, ropeDim, base, layout, position, freqFactors: factors };
  const expected = [...ropeReference(q, { ...options, heads }), ...ropeReference(k, { ...options, heads: kvHeads })];
  return { actual, expected };
}

describe('rope kernel', () => {
  it.each([
    ['normal', 1, 8, 8, 8, 0, false],
    ['normal', 5, 4, 64, 64, 17, false],
    ['neox', 3, 2, 128, 128, 1000, false],
    ['neox', 2, 3, 64, 32, 5, false], // partial rotary dims
    ['normal', 4, 2, 64, 64, 300, true], // Llama 3 frequency factors
  ] as const)(
    '%s layout matches the reference on q and k (%i tokens, %i q heads, head_dim %i, rope_dim %i, pos %i)',
    async (layout, tokens, heads, headDim, ropeDim, position, withFactors) => {
      const { actual, expected } = await runRope(layout, tokens, heads, headDim, ropeDim, position, withFactors);
      // f32 angle at positions up to ~1000: absolute error of a few 1e-4 is the f32 trig limit.
      expect(maxToleranceRatio(actual, expected, 2e-3, 1e-3)).toBeLessThanOrEqual(1);
    },
  );

  it('catches a broken kernel (pairs swapped to the other layout)', async () => {
    const broken = ropeWgsl.replace('if (params.neox == 1u)', 'if (params.neox == 0u)');
    expect(broken).not.toBe(ropeWgsl);
    const { actual, expected } = await runRope('normal', 2, 2, 64, 64, 9, false, broken);
    expect(maxToleranceRatio(actual, expected, 2e-3, 1e-3)).toBeGreaterThan(1);
  });

  it("catches a broken kernel (k rotated with q's head count)", async () => {
    const broken = ropeWgsl.replace('select(params.kvHeads, params.heads, inQ)', 'params.heads');
    expect(broken).not.toBe(ropeWgsl);
    const { actual, expected } = await runRope('normal', 3, 4, 64, 64, 9, false, broken);
    expect(maxToleranceRatio(actual, expected, 2e-3, 1e-3)).toBeGreaterThan(1);
  });
});
