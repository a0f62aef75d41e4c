import { describe, expect, it } from 'vitest';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { rmsnormReference } from './reference/rmsnorm.ts';
import { prepareRmsNorm } from './rmsnorm.ts';

const ctx = withTestGpu();

/** `add`: the rows are added into an output holding random values (a residual stream). */
async function runRmsNorm(gpu: GpuContext, rows: number, dim: number, add = false) {
  const random = seededRandom(rows * 1000 + dim);
  const x = randomFloats(random, rows * dim, 3);
  const w = randomFloats(random, dim, 1.5);
  const residual = add ? randomFloats(random, rows * dim, 2) : undefined;
  const eps = 1e-5;
  const before = gpu.allocator.snapshot().totalBuffers;
  const input = gpu.allocator.createStorage('x', 'scratch', x);
  const weight = gpu.allocator.createStorage('w', 'weights', w);
  const output = gpu.allocator.createStorage('y', 'scratch', residual ?? rows * dim * 4);
  const dispatch = prepareRmsNorm(gpu, 'rmsnorm-test', { input, weight, output, rows, dim, eps, add });
  submitDispatches(gpu, 'rmsnorm-test', [dispatch]);
  const actual = await readFloat32(gpu, output, rows * dim);
  releaseDispatches(gpu, [dispatch]);
  for (const b of [input, weight, output]) gpu.allocator.release(b);
  expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
  return { actual, expected: rmsnormReference(x, w, rows, dim, eps, residual) };
}

describe('rmsnorm kernel', () => {
  // Dims around the workgroup size (256) catch the held values' bounds and the tree reduction; rows wider than the
  // 4,096 values held (256 invocations x 16) take the loops after them.
  it.each([
    [1, 64],
    [3, 255],
    [5, 257],
    [2, 896],
    [1, 2048],
    [2, 4096],
    [2, 5000],
  ])('matches the CPU reference for %i rows x %i', async (rows, dim) => {
    const { actual, expected } = await runRmsNorm(ctx.gpu, rows, dim);
    expect(maxToleranceRatio(actual, expected, 1e-5, 1e-4)).toBeLessThanOrEqual(1);
  });

  it.each([
    [3, 255],
    [2, 1152],
    [2, 5000],
  ])('added into its output (post-norm) matches the CPU reference for %i rows x %i', async (rows, dim) => {
    const { actual, expected } = await runRmsNorm(ctx.gpu, rows, dim, true);
    expect(maxToleranceRatio(actual, expected, 1e-5, 1e-4)).toBeLessThanOrEqual(1);
  });

  it('catches a broken kernel: the added build writing the tail instead of adding it', async () => {
    const broken = mutateShaders(ctx.gpu, {
      label: 'rmsnorm-add',
      edit: (code) => code.replace('y[base + i] = y[base + i] + ', 'y[base + i] = '),
    });
    const { actual, expected } = await runRmsNorm(broken.gpu, 1, 5000, true);
    expect(broken.mutated).toEqual(['rmsnorm-add']);
    expect(maxToleranceRatio(actual, expected, 1e-5, 1e-4)).toBeGreaterThan(1);
  });

  it('catches a broken kernel: an off-by-one in the mean fails the comparison', async () => {
    const broken = mutateShaders(ctx.gpu, {
      label: 'rmsnorm',
      edit: (code) => code.replace('f32(params.dim)', 'f32(params.dim - 1u)'),
    });
    const { actual, expected } = await runRmsNorm(broken.gpu, 2, 96);
    expect(broken.mutated).toEqual(['rmsnorm']);
    expect(maxToleranceRatio(actual, expected, 1e-5, 1e-4)).toBeGreaterThan(1);
  });

  it('catches a broken kernel: a row wider than the held values without its tail in the mean', async () => {
    const broken = mutateShaders(ctx.gpu, {
      label: 'rmsnorm',
      edit: (code) =>
        code.replace(
          'for (var i = lid.x + WG * HELD; i < params.dim; i += WG) {\n    let v',
          'for (var i = lid.x + WG * HELD + WG; i < params.dim; i += WG) {\n    let v',
        ),
    });
    const { actual, expected } = await runRmsNorm(broken.gpu, 1, 5000);
    expect(broken.mutated).toEqual(['rmsnorm']);
    expect(maxToleranceRatio(actual, expected, 1e-5, 1e-4)).toBeGreaterThan(1);
  });
});
