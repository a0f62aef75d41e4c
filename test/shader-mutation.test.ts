import { describe, expect, it } from 'vitest';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { prepareAddInPlace } from '../kernels/elementwise.ts';
import { withTestGpu } from './gpu.ts';
import { randomFloats, seededRandom } from './random.ts';
import { withShaderHooks } from './shader-hooks.ts';
import { mutateShaders } from './shader-mutation.ts';

const ctx = withTestGpu();

/** x + y on random data through the 'add' kernel prepared on `gpu`, with the expected sum. */
async function add(gpu: GpuContext): Promise<{ actual: Float32Array; x: Float32Array; y: Float32Array }> {
  const random = seededRandom(3);
  const x = randomFloats(random, 300, 2);
  const y = randomFloats(random, 300, 2);
  const xb = gpu.allocator.createStorage('x', 'scratch', x);
  const yb = gpu.allocator.createStorage('y', 'scratch', y);
  const dispatch = prepareAddInPlace(gpu, 'add-test', { x: xb, y: yb, count: x.length });
  submitDispatches(gpu, 'add-test', [dispatch]);
  const actual = await readFloat32(gpu, xb, x.length);
  releaseDispatches(gpu, [dispatch]);
  for (const b of [xb, yb]) gpu.allocator.release(b);
  return { actual, x, y };
}

const subtract = { label: 'add', edit: (code: string) => code.replace('x[i] + y[i]', 'x[i] - y[i]') };

describe('shader mutations', () => {
  it('compile the edited code for the labels they name, and only on their view', async () => {
    const mutant = mutateShaders(ctx.gpu, subtract);
    const broken = await add(mutant.gpu);
    expect(mutant.mutated).toEqual(['add']);
    expect(Array.from(broken.actual)).toEqual(Array.from(broken.x, (v, i) => Math.fround(v - broken.y[i])));
    // The real device's pipeline cache never sees the edit: the kernel as built, before and after.
    const real = await add(ctx.gpu);
    expect(Array.from(real.actual)).toEqual(Array.from(real.x, (v, i) => Math.fround(v + real.y[i])));
  });

  it('leave other labels alone', async () => {
    const mutant = mutateShaders(ctx.gpu, { ...subtract, label: /^rmsnorm$/ });
    const { actual, x, y } = await add(mutant.gpu);
    expect(mutant.mutated).toEqual([]);
    expect(Array.from(actual)).toEqual(Array.from(x, (v, i) => Math.fround(v + y[i])));
  });

  it('throw where the edit no longer changes the kernel', async () => {
    const stale = mutateShaders(ctx.gpu, { label: 'add', edit: (code) => code.replace('no such text', '') });
    await expect(add(stale.gpu)).rejects.toThrow(/did not change its code/);
  });

  it('share the hooks that record what compiles', async () => {
    const made: string[] = [];
    const view = withShaderHooks(ctx.gpu, { pipeline: (_, m) => made.push(`${m.label}:${m.entryPoint}`) });
    await add(view);
    await add(view); // cached on the view: compiled once
    expect(made).toEqual(['add:main']);
  });
});
