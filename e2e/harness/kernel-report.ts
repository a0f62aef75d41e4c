/** What the kernel worker sends back to the harness page (and the page exposes to the Playwright spec). */
import type { MemorySnapshot } from '../../core/gpu/allocator.ts';
import type { AdapterSummary, GpuFeatures } from '../../core/gpu/device.ts';
import type { GpuLimits } from '../../core/gpu/limits.ts';

/** `match`: the kernel must agree with its CPU reference. `mismatch`: a deliberately broken kernel the check must catch. */
export type KernelExpectation = 'match' | 'mismatch';

export interface KernelCheckOutcome {
  name: string;
  expect: KernelExpectation;
  /** Largest |gpu - cpu| / (atol + rtol·|cpu|); <= 1 is within tolerance. */
  maxToleranceRatio: number;
  atol: number;
  rtol: number;
  elements: number;
  /** Buffers still live after the check minus before it: must be 0. */
  leakedBuffers: number;
  /** Uncaptured WebGPU errors raised while the check ran. */
  uncapturedErrors: string[];
  /** Set when the check threw instead of producing a comparison. */
  error?: string;
  ms: number;
}

export interface KernelRunRequest {
  /** Runs only the checks whose name contains this text (from the page's `?only=` parameter). */
  only?: string;
}

export type KernelReport =
  | {
      ok: true;
      userAgent: string;
      adapter: AdapterSummary;
      limits: GpuLimits;
      features: GpuFeatures;
      checks: KernelCheckOutcome[];
      /** Every uncaptured WebGPU error of the run, including any raised after the last check. */
      uncapturedErrors: string[];
      /** The allocator after all checks, before the device is destroyed: every count must be back to 0. */
      allocator: MemorySnapshot;
    }
  | { ok: false; userAgent: string; error: string };
