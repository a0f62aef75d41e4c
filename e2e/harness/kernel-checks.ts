/**
 * Kernel checks run in a browser worker (Chromium's WebGPU), the same comparisons the vitest suite runs on Dawn.
 * To cover a new kernel in the browser, add entries to `kernelChecks`: each prepares its dispatch on seeded random
 * data, reads the result back and returns it with the CPU reference. Release every buffer you create: the harness
 * fails a check that leaves buffers behind.
 */

import type { GpuContext } from '../../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../../core/gpu/dispatch.ts';
import { readFloat32 } from '../../core/gpu/readback.ts';
import { rmsnormReference } from '../../kernels/reference/rmsnorm.ts';
import { prepareRmsNorm } from '../../kernels/rmsnorm.ts';
import { randomFloats, seededRandom } from '../../test/random.ts';
import { mutateShaders } from '../../test/shader-mutation.ts';
import type { KernelExpectation } from './kernel-report.ts';

export interface KernelComparison {
  actual: Float32Array;
  expected: Float32Array;
}

export interface KernelCheck {
  name: string;
  expect: KernelExpectation;
  atol: number;
  rtol: number;
  run(gpu: GpuContext): Promise<KernelComparison>;
}

async function runRmsNorm(gpu: GpuContext, rows: number, dim: number): Promise<KernelComparison> {
  const random = seededRandom(rows * 1000 + dim);
  const x = randomFloats(random, rows * dim, 3);
  const w = randomFloats(random, dim, 1.5);
  const eps = 1e-5;
  const input = gpu.allocator.createStorage('x', 'scratch', x);
  const weight = gpu.allocator.createStorage('w', 'weights', w);
  const output = gpu.allocator.createStorage('y', 'scratch', rows * dim * 4);
  const dispatch = prepareRmsNorm(gpu, 'rmsnorm-e2e', { input, weight, output, rows, dim, eps });
  try {
    submitDispatches(gpu, 'rmsnorm-e2e', [dispatch]);
    const actual = await readFloat32(gpu, output, rows * dim);
    return { actual, expected: rmsnormReference(x, w, rows, dim, eps) };
  } finally {
    releaseDispatches(gpu, [dispatch]);
    for (const b of [input, weight, output]) gpu.allocator.release(b);
  }
}

/** Same tolerance and mutation as kernels/rmsnorm.test.ts (mutateShaders throws if the edit no longer applies). */
async function runBrokenRmsNorm(gpu: GpuContext, rows: number, dim: number): Promise<KernelComparison> {
  const broken = mutateShaders(gpu, {
    label: 'rmsnorm',
    edit: (code) => code.replace('f32(params.dim)', 'f32(params.dim - 1u)'),
  });
  const result = await runRmsNorm(broken.gpu, rows, dim);
  if (broken.mutated.length !== 1) throw new Error(`the broken rmsnorm compiled ${broken.mutated.length} times`);
  return result;
}

export const kernelChecks: readonly KernelCheck[] = [
  // Dims around the workgroup size (256) cover both the strided loop and the tree reduction.
  ...(
    [
      [1, 64],
      [3, 255],
      [5, 257],
      [1, 2048],
    ] as const
  ).map(
    ([rows, dim]): KernelCheck => ({
      name: `rmsnorm ${rows}x${dim}`,
      expect: 'match',
      atol: 1e-5,
      rtol: 1e-4,
      run: (gpu) => runRmsNorm(gpu, rows, dim),
    }),
  ),
  {
    name: 'rmsnorm broken (mean over dim-1) 2x96',
    expect: 'mismatch',
    atol: 1e-5,
    rtol: 1e-4,
    run: (gpu) => runBrokenRmsNorm(gpu, 2, 96),
  },
];
