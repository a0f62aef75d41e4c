import { describe, expect, it } from 'vitest';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { prepareAddInPlace, prepareSwiglu } from './elementwise.ts';
import type { GatedActivation } from './elementwise.wgsl.ts';
import { addReference, gegluReference, swigluReference } from './reference/elementwise.ts';

const ctx = withTestGpu();

/** The gated activation over `count` random values (gates of std 6: past ±10 too), and its CPU reference. */
async function runGated(gpu: GpuContext, activation: GatedActivation, count: number) {
  const random = seededRandom(count);
  const gate = randomFloats(random, count, 6);
  // Gates far out: where the exponential overflows.
  if (count > 2) gate.set([-95, 95], 0);
  const up = randomFloats(random, count, 2);
  const buffers = [
    gpu.allocator.createStorage('gate', 'scratch', gate),
    gpu.allocator.createStorage('up', 'scratch', up),
    gpu.allocator.createStorage('out', 'scratch', count * 4),
  ];
  const output = buffers[2];
  const d = prepareSwiglu(gpu, `${activation}-test`, { gate: buffers[0], up: buffers[1], output, count, activation });
  submitDispatches(gpu, `${activation}-test`, [d]);
  const actual = await readFloat32(gpu, output, count);
  releaseDispatches(gpu, [d]);
  for (const b of buffers) gpu.allocator.release(b);
  return { actual, expected: (activation === 'geglu' ? gegluReference : swigluReference)(gate, up) };
}

describe('elementwise kernels', () => {
  it.each([1, 63, 4864 * 3])('swiglu matches the reference over %i values', async (count) => {
    const { actual, expected } = await runGated(ctx.gpu, 'swiglu', count);
    expect(maxToleranceRatio(actual, expected, 1e-6, 1e-5)).toBeLessThanOrEqual(1);
  });

  it.each([1, 63, 4864 * 3])('geglu (gelu tanh form) matches the reference over %i values', async (count) => {
    const { actual, expected } = await runGated(ctx.gpu, 'geglu', count);
    expect(actual.every(Number.isFinite)).toBe(true);
    expect(maxToleranceRatio(actual, expected, 1e-6, 1e-5)).toBeLessThanOrEqual(1);
  });

  it("catches a broken kernel: geglu without the cubic term (gelu's sigmoid form) fails the comparison", async () => {
    const broken = mutateShaders(ctx.gpu, { label: 'geglu', edit: (code) => code.replace('0.044715', '0.0') });
    const { actual, expected } = await runGated(broken.gpu, 'geglu', 1000);
    expect(broken.mutated).toEqual(['geglu']);
    expect(maxToleranceRatio(actual, expected, 1e-6, 1e-5)).toBeGreaterThan(1);
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
