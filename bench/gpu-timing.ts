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
