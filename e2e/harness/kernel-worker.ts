/**
 * Dedicated module worker for the kernel harness: acquires the GPU the way the engine worker will, runs every
 * check in `kernelChecks` against its CPU reference and posts one `KernelReport` back.
 */
import { acquireGpu, type GpuContext } from '../../core/gpu/device.ts';
import { maxToleranceRatio } from '../../test/random.ts';
import { type KernelCheck, kernelChecks } from './kernel-checks.ts';
import type { KernelCheckOutcome, KernelReport, KernelRunRequest } from './kernel-report.ts';

function describeError(error: unknown): string {
  if (error instanceof Error) return `${error.name}: ${error.message}${error.stack ? `\n${error.stack}` : ''}`;
  return String(error);
}

async function runCheck(gpu: GpuContext, check: KernelCheck): Promise<KernelCheckOutcome> {
  const buffersBefore = gpu.allocator.snapshot().totalBuffers;
  const errorsBefore = gpu.errors.length;
  const started = performance.now();
  const outcome: KernelCheckOutcome = {
    name: check.name,
    expect: check.expect,
    maxToleranceRatio: Number.NaN,
    atol: check.atol,
    rtol: check.rtol,
    elements: 0,
    leakedBuffers: 0,
    uncapturedErrors: [],
    ms: 0,
  };
  try {
    const { actual, expected } = await check.run(gpu);
    outcome.elements = actual.length;
    outcome.maxToleranceRatio = maxToleranceRatio(actual, expected, check.atol, check.rtol);
  } catch (error) {
    outcome.error = describeError(error);
  }
  // Uncaptured errors arrive asynchronously: let the queue drain before attributing them to this check.
  await gpu.device.queue.onSubmittedWorkDone();
  outcome.ms = Math.round(performance.now() - started);
  outcome.leakedBuffers = gpu.allocator.snapshot().totalBuffers - buffersBefore;
  outcome.uncapturedErrors = gpu.errors.slice(errorsBefore).map((e) => e.message);
  return outcome;
}

async function runAll(request: KernelRunRequest): Promise<KernelReport> {
  const gpu = await acquireGpu({ gpu: navigator.gpu });
  try {
    const selected = kernelChecks.filter((c) => !request.only || c.name.includes(request.only));
    const checks: KernelCheckOutcome[] = [];
    for (const check of selected) checks.push(await runCheck(gpu, check));
    await gpu.device.queue.onSubmittedWorkDone();
    return {
      ok: true,
      userAgent: navigator.userAgent,
      adapter: gpu.adapter,
      limits: gpu.limits,
      features: gpu.features,
      checks,
      uncapturedErrors: gpu.errors.map((e) => e.message),
      allocator: gpu.allocator.snapshot(),
    };
  } finally {
    gpu.destroy();
  }
}

addEventListener('message', (event: MessageEvent<KernelRunRequest>) => {
  runAll(event.data).then(
    (report) => postMessage(report),
    (error) =>
      postMessage({ ok: false, userAgent: navigator.userAgent, error: describeError(error) } satisfies KernelReport),
  );
});
