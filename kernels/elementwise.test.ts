import { describe, expect, it } from 'vitest';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { prepareAddInPlace, prepareSwiglu } from './elementwise.ts';
import { addReference, swigluReference } from './reference/elementwise.ts';

const ctx = withTestGpu();

describe('elementwise kernels', () => {
  it.each([1, 63, 4864 * 3])('swiglu matches the reference over %i values', async (count) => {
    const { gpu } = ctx;
    const random = seededRandom(count);
    const gate = randomFloats(random, count, 6);
    const up = randomFloats(random, count, 2);
    const buffers = [
      gpu.allocator.createStorage('gate', 'scratch', gate),
      gpu.allocator.createStorage('up', 'scratch', up),
      gpu.allocator.createStorage('out', 'scratch', count * 4),
    ];
    const d = prepareSwiglu(gpu, 'swiglu-test', { gate: buffers[0], up: buffers[1], output: buffers[2], count });
    submitDispatches(gpu, 'swiglu-test', [d]);
    const actual = await readFloat32(gpu, buffers[2], count);
    releaseDispatches(gpu, [d]);
    for (const b of buffers) gpu.allocator.release(b);
    expect(maxToleranceRatio(actual, swigluReference(gate, up), 1e-6, 1e-5)).toBeLessThanOrEqual(1);
  });

  it.each([5, 1000])('add in place matches the reference over %i values', async (count) => {
    const { gpu } = ctx;
    const random = seededRandom(count + 1);
    const x = randomFloats(random, count, 3);
    const y = randomFloats(random, count, 3);
    const xb = gpu.allocator.createStorage('x', 'scratch', x);
    const yb = gpu.allocator.createStorage('y', 'scratch', y);
    const d = prepareAddInPlace(gpu, 'add-test', { x: xb, y: yb, count });
    submitDispatches(gpu, 'add-test', [d]);
    const actual = await readFloat32(gpu, xb, count);
    releaseDispatches(gpu, [d]);
    gpu.allocator.release(xb);
    gpu.allocator.release(yb);
    expect(maxToleranceRatio(actual, addReference(x, y), 1e-6, 1e-6)).toBeLessThanOrEqual(1);
  });
});
