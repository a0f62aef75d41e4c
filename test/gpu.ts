/**
 * Vitest harness for WebGPU on Dawn: one device per test file, and any uncaptured WebGPU error fails the test
 * it happened in.
 */
import { afterAll, afterEach, beforeAll, expect } from 'vitest';
import { acquireGpu, type GpuContext, type GpuFeatures } from '../core/gpu/device.ts';
import type { GpuLimits } from '../core/gpu/limits.ts';
import { nodeGpu } from '../core/gpu/node.ts';

export function withTestGpu(): { readonly gpu: GpuContext } {
  const holder = {} as { gpu: GpuContext };
  beforeAll(async () => {
    holder.gpu = await acquireGpu({ gpu: await nodeGpu() });
  });
  afterEach(async () => {
    if (!holder.gpu) return;
    await holder.gpu.device.queue.onSubmittedWorkDone();
    const messages = holder.gpu.errors.map((e) => e.message);
    holder.gpu.errors.length = 0;
    expect(messages, 'uncaptured WebGPU errors').toEqual([]);
  });
  afterAll(() => {
    holder.gpu?.destroy();
  });
  return holder;
}

/** The same device, reporting tighter limits: how tests reach the paths a smaller adapter takes. */
export function withLimits(gpu: GpuContext, limits: Partial<GpuLimits>): GpuContext {
  return reporting(gpu, { limits: { ...gpu.limits, ...limits } });
}

/** The same device, reporting fewer features: how tests reach the kernels built for adapters without them. */
export function withFeatures(gpu: GpuContext, features: Partial<GpuFeatures>): GpuContext {
  return reporting(gpu, { features: { ...gpu.features, ...features } });
}

/** A view of `gpu` (same device, allocator and errors) with some of its reported properties replaced. */
function reporting(gpu: GpuContext, replaced: Partial<Pick<GpuContext, 'limits' | 'features'>>): GpuContext {
  return Object.assign(Object.create(gpu) as GpuContext, replaced);
}
