import type { GpuContext } from '../core/gpu/device.ts';
import { encodeDispatches, type PreparedDispatch } from '../core/gpu/dispatch.ts';

/** Least time a timing keeps the GPU busy before it measures. */
const WARM_UP_MS = 200;

/**
 * Runs `run` again and again for at least WARM_UP_MS: an idle GPU drops its clocks and takes a while to raise them.
 * After a CPU reference check (GPU idle for a fraction of a second), one short warm-up run left the next kernel timed
 * 2.5-4x slower than the same build timed after other GPU work (H200, session 13).
 */
export async function warmUp(run: () => Promise<unknown>): Promise<void> {
  for (const start = performance.now(); performance.now() - start < WARM_UP_MS; ) await run();
}

/**
 * GPU timestamps (ns) of work `record` encodes with `count` timestamp queries of `querySet`, read back after one
 * submit. Needs the device's `timestamp-query` feature.
 */
export async function gpuTimestamps(
  gpu: GpuContext,
  count: number,
  record: (encoder: GPUCommandEncoder, querySet: GPUQuerySet) => void,
): Promise<BigUint64Array> {
  const { device, allocator } = gpu;
  const querySet = device.createQuerySet({ label: 'bench.timestamps', type: 'timestamp', count });
  const resolved = allocator.createBuffer({
    label: 'bench.timestamps',
    category: 'scratch',
    size: count * 8,
    usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
  });
  const readback = allocator.createBuffer({
    label: 'bench.timestamps.readback',
    category: 'staging',
    size: count * 8,
    usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
  });
  try {
    const encoder = device.createCommandEncoder({ label: 'bench.timestamps' });
    record(encoder, querySet);
    encoder.resolveQuerySet(querySet, 0, count, resolved, 0);
    encoder.copyBufferToBuffer(resolved, 0, readback, 0, count * 8);
    device.queue.submit([encoder.finish()]);
    await readback.mapAsync(GPUMapMode.READ);
    const ticks = new BigUint64Array(readback.getMappedRange().slice(0));
    readback.unmap();
    return ticks;
  } finally {
    querySet.destroy();
    allocator.release(resolved);
    allocator.release(readback);
  }
}

/** Records `groups` (each one compute pass) with begin/end timestamps; returns each pass's GPU time in ms. */
export async function timePasses(gpu: GpuContext, groups: readonly (readonly PreparedDispatch[])[]): Promise<number[]> {
  const ticks = await gpuTimestamps(gpu, groups.length * 2, (encoder, querySet) => {
    groups.forEach((dispatches, i) => {
      const pass = encoder.beginComputePass({
        label: 'bench.timed',
        timestampWrites: { querySet, beginningOfPassWriteIndex: 2 * i, endOfPassWriteIndex: 2 * i + 1 },
      });
      encodeDispatches(pass, dispatches);
      pass.end();
    });
  });
  return groups.map((_, i) => Number(ticks[2 * i + 1] - ticks[2 * i]) / 1e6);
}

/**
 * Median GPU milliseconds of each of `dispatches`, each in a compute pass of its own with timestamp writes, the
 * sequence recorded `reps` times into one submit (after a warm-up). A pass's start and drain count in its dispatch.
 */
export async function timeEachDispatch(
  gpu: GpuContext,
  dispatches: readonly PreparedDispatch[],
  reps: number,
): Promise<number[]> {
  // A query set holds at most 4096 timestamps.
  const rounds = Math.max(1, Math.min(reps, Math.floor(4096 / (2 * dispatches.length))));
  const groups = Array.from({ length: rounds }, () => dispatches.map((d) => [d])).flat();
  await warmUp(() => timePasses(gpu, groups));
  const ms = await timePasses(gpu, groups);
  return dispatches.map((_, i) => {
    const own = ms.filter((_, j) => j % dispatches.length === i).sort((a, b) => a - b);
    return own[Math.floor(own.length / 2)];
  });
}

/**
 * Milliseconds per run of `dispatches`, same-machine style: the dispatches recorded n and 5n times into one compute
 * pass and submitted, (fastest of three 5n runs − fastest of three n runs) / 4n, which cancels the submit's round trip.
 */
export async function timeDispatches(gpu: GpuContext, dispatches: PreparedDispatch[], reps: number): Promise<number> {
  const run = async (n: number) => {
    const encoder = gpu.device.createCommandEncoder();
    const pass = encoder.beginComputePass();
    for (let i = 0; i < n; i++) encodeDispatches(pass, dispatches);
    pass.end();
    const t0 = performance.now();
    gpu.device.queue.submit([encoder.finish()]);
    await gpu.device.queue.onSubmittedWorkDone();
    return performance.now() - t0;
  };
  await warmUp(() => run(reps));
  // The fastest of three of each length: a difference of single runs went negative when one run stalled.
  let short = Number.POSITIVE_INFINITY;
  let long = Number.POSITIVE_INFINITY;
  for (let k = 0; k < 3; k++) {
    short = Math.min(short, await run(reps));
    long = Math.min(long, await run(5 * reps));
  }
  return (long - short) / (4 * reps);
}
