import { describe, expect, it } from 'vitest';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches, uniformBuffer } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { rmsnormReference } from './reference/rmsnorm.ts';
import { ropeReference } from './reference/rope.ts';
import {
  NO_ROPE_SCALING,
  prepareRope,
  type RopeLayout,
  type RopeScaling,
  ropeFrequencyDivisors,
  ropeMagnitude,
} from './rope.ts';

const ctx = withTestGpu();

async function runRope(
  layout: RopeLayout,
  tokens: number,
  heads: number,
  headDim: number,
  ropeDim: number,
  position: number,
  withFactors: boolean,
  gpu: GpuContext = ctx.gpu,
  headNorm = false,
  scaling: RopeScaling = NO_ROPE_SCALING,
) {
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
  const base = 10000;
  // The kernel sees the scaling only as per-pair divisors and a magnitude; the reference computes it as ggml does.
  const divisors = ropeFrequencyDivisors(ropeDim, base, scaling, factors);
  const factorBuffer = gpu.allocator.createStorage('factors', 'weights', divisors);
  const step = uniformBuffer(gpu, 'step', [position, tokens, 0, 0], 'uuuu');
  // Qwen3's per-head norm weights: distinct for q and k, away from 1.
  const eps = 1e-6;
  const qWeight = Float32Array.from({ length: headDim }, () => 0.25 + 2 * random());
  const kWeight = Float32Array.from({ length: headDim }, () => 0.25 + 2 * random());
  const norms = headNorm
    ? [
        gpu.allocator.createStorage('q_norm', 'weights', qWeight),
        gpu.allocator.createStorage('k_norm', 'weights', kWeight),
      ]
    : [];
  const dispatch = prepareRope(gpu, 'rope-test', {
    q: qBuffer,
    k: kBuffer,
    freqFactors: factorBuffer,
    step,
    tokens,
    heads,
    kvHeads,
    headDim,
    ropeDim,
    base,
    layout,
    magnitude: ropeMagnitude(scaling),
    headNorm: headNorm ? { q: norms[0], k: norms[1], eps } : undefined,
  });
  submitDispatches(gpu, 'rope-test', [dispatch]);
  const actual = [...(await readFloat32(gpu, qBuffer, q.length)), ...(await readFloat32(gpu, kBuffer, k.length))];
  releaseDispatches(gpu, [dispatch]);
  for (const b of [qBuffer, kBuffer, factorBuffer, step, ...norms]) gpu.allocator.release(b);
  const options = { tokens, headDim, ropeDim, base, layout, position, freqFactors: factors, scaling };
  const qIn = headNorm ? rmsnormReference(q, qWeight, tokens * heads, headDim, eps) : q;
  const kIn = headNorm ? rmsnormReference(k, kWeight, tokens * kvHeads, headDim, eps) : k;
  const expected = [
    ...ropeReference(qIn, { ...options, heads }),
    ...ropeReference(kIn, { ...options, heads: kvHeads }),
  ];
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

  it.each([
    ['neox', 1, 32, 128, 128, 4000], // a Qwen3-4B decode step
    ['neox', 5, 4, 64, 64, 17],
    ['neox', 3, 2, 64, 32, 5], // partial rotary dims: the rest normalized only
    ['normal', 2, 3, 256, 256, 90], // the largest head the workgroup holds
    ['neox', 2048, 32, 8, 8, 0], // 98,304 heads: more workgroups than one grid dimension holds
  ] as const)(
    'with per-head RMSNorm first (Qwen3), %s layout matches norm then RoPE (%i tokens, %i q heads, head_dim %i, rope_dim %i, pos %i)',
    async (layout, tokens, heads, headDim, ropeDim, position) => {
      const { actual, expected } = await runRope(
        layout,
        tokens,
        heads,
        headDim,
        ropeDim,
        position,
        false,
        undefined,
        true,
      );
      expect(maxToleranceRatio(actual, expected, 2e-3, 1e-3)).toBeLessThanOrEqual(1);
    },
  );

  const linear = (factor: number): RopeScaling => ({ ...NO_ROPE_SCALING, type: 'linear', factor });
  const yarn = (factor: number, originalContext: number, attnFactor = 1): RopeScaling => ({
    ...NO_ROPE_SCALING,
    type: 'yarn',
    factor,
    originalContext,
    attnFactor,
  });

  // Original contexts are short so YaRN's ramp (pairs that turn 32 down to 1 times over it) falls inside the head.
  it.each([
    ['normal', 4, 2, 64, 64, 300, false, false, linear(4)],
    ['neox', 3, 2, 64, 64, 300, false, false, { ...linear(2), attnFactor: 0.8 }],
    ['neox', 5, 4, 64, 64, 1000, false, false, yarn(8, 256)],
    ['normal', 4, 2, 64, 64, 700, true, false, yarn(4, 512, 1.1)], // with Llama 3 factors
    ['neox', 3, 2, 64, 32, 50, false, false, yarn(0.5, 128)], // factor below 1: no magnitude correction
    ['neox', 1, 32, 128, 128, 4000, false, true, yarn(4, 4096, 0.9)], // a scaled Qwen3-4B decode step
    ['neox', 2, 2, 64, 64, 90, false, true, linear(8)],
  ] as const)(
    'with RoPE scaling, %s layout matches the reference (%i tokens, %i q heads, head_dim %i, rope_dim %i, pos %i, factors %s, head norm %s, %o)',
    async (layout, tokens, heads, headDim, ropeDim, position, withFactors, headNorm, scaling) => {
      const { actual, expected } = await runRope(
        layout,
        tokens,
        heads,
        headDim,
        ropeDim,
        position,
        withFactors,
        undefined,
        headNorm,
        scaling,
      );
      expect(maxToleranceRatio(actual, expected, 2e-3, 1e-3)).toBeLessThanOrEqual(1);
    },
  );

  it('ropeFrequencyDivisors: linear divides every angle by the factor, YaRN only the slow pairs', () => {
    expect([...ropeFrequencyDivisors(8, 10000, linear(4))]).toEqual([4, 4, 4, 4]);
    // base 10000, 64 dims, original context 256: the ramp runs over pairs 0..13.
    const d = ropeFrequencyDivisors(64, 10000, yarn(8, 256));
    expect(d[0]).toBe(1);
    expect(d[13]).toBe(8);
    expect(d[31]).toBe(8);
    expect(d[6]).toBeGreaterThan(1);
    expect(d[6]).toBeLessThan(8);
    expect(ropeMagnitude(yarn(4, 256, 2))).toBeCloseTo(2 * (1 + 0.1 * Math.log(4)), 12);
    expect(ropeMagnitude(linear(4))).toBe(1);
  });

  /** A view of the test device whose `label` pipeline compiles from `code.replace(from, to)`. */
  const broken = (label: string, from: string, to: string) =>
    mutateShaders(ctx.gpu, { label, edit: (code) => code.replace(from, to) });

  it("catches a broken head-norm kernel (k's norm weights read in reverse)", async () => {
    const mutant = broken('rope-head-norm', 'w = kNorm[i];', 'w = kNorm[d - 1u - i];');
    const { actual, expected } = await runRope('neox', 2, 4, 64, 64, 9, false, mutant.gpu, true);
    expect(mutant.mutated).toEqual(['rope-head-norm']);
    expect(maxToleranceRatio(actual, expected, 2e-3, 1e-3)).toBeGreaterThan(1);
  });

  it('catches a broken head-norm kernel (dims past ropeDim left unnormalized)', async () => {
    const mutant = broken('rope-head-norm', '{ q[base + i] = row[i]; } else { k[base + i] = row[i]; }', '{}');
    const { actual, expected } = await runRope('neox', 2, 2, 64, 32, 5, false, mutant.gpu, true);
    expect(mutant.mutated).toEqual(['rope-head-norm']);
    expect(maxToleranceRatio(actual, expected, 2e-3, 1e-3)).toBeGreaterThan(1);
  });

  it('catches a broken kernel (pairs swapped to the other layout)', async () => {
    const mutant = broken('rope', 'if (params.neox == 1u)', 'if (params.neox == 0u)');
    const { actual, expected } = await runRope('normal', 2, 2, 64, 64, 9, false, mutant.gpu);
    expect(mutant.mutated).toEqual(['rope']);
    expect(maxToleranceRatio(actual, expected, 2e-3, 1e-3)).toBeGreaterThan(1);
  });

  it('catches a broken kernel (the magnitude of YaRN left out)', async () => {
    const mutant = broken(
      'rope',
      'cos(theta) * params.magnitude, sin(theta) * params.magnitude',
      'cos(theta), sin(theta)',
    );
    const scaling = yarn(4, 256);
    const { actual, expected } = await runRope('neox', 2, 2, 64, 64, 9, false, mutant.gpu, false, scaling);
    expect(mutant.mutated).toEqual(['rope']);
    expect(maxToleranceRatio(actual, expected, 2e-3, 1e-3)).toBeGreaterThan(1);
  });

  it("catches a broken kernel (k rotated with q's head count)", async () => {
    const mutant = broken('rope', 'select(params.kvHeads, params.heads, inQ)', 'params.heads');
    const { actual, expected } = await runRope('normal', 3, 4, 64, 64, 9, false, mutant.gpu);
    expect(mutant.mutated).toEqual(['rope']);
    expect(maxToleranceRatio(actual, expected, 2e-3, 1e-3)).toBeGreaterThan(1);
  });
});
