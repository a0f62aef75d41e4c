import { describe, expect, it } from 'vitest';
import { fitLabel, type GpuEvidence, kvBytesUsable, modelFit } from './model-fit.ts';

const MiB = 1024 * 1024;
const GiB = 1024 * MiB;
// The WebGPU spec's default limits: 256 MiB per buffer, 128 MiB per storage binding.
const defaults: GpuEvidence = { maxBufferSize: 256 * MiB, maxStorageBufferBindingSize: 128 * MiB, peakBytes: 70 * MiB };

describe('modelFit', () => {
  it('says it does not know when the size or the GPU is unknown', () => {
    expect(modelFit({ modelBytes: null, kvBudgetBytes: 64 * MiB, running: false }, defaults)).toEqual({
      verdict: 'unknown',
      reason: 'its size is not known yet',
    });
    const noGpu = modelFit({ modelBytes: MiB, kvBudgetBytes: 64 * MiB, running: false }, null);
    expect(noGpu.verdict).toBe('unknown');
    expect(fitLabel(noGpu)).toBe(
      "fit unknown: this GPU's limits are known once a model has loaded (WebGPU does not report its memory)",
    );
  });

  it('fits the running model and a model no larger than what the GPU has held', () => {
    expect(modelFit({ modelBytes: GiB, kvBudgetBytes: 64 * MiB, running: true }, defaults)).toEqual({
      verdict: 'fits',
      reason: 'loaded and running with this KV budget',
    });
    const small = modelFit({ modelBytes: 2 * MiB, kvBudgetBytes: 64 * MiB, running: false }, defaults);
    expect(small).toEqual({
      verdict: 'fits',
      reason: 'needs about 66 MiB; this GPU has already held 70 MiB',
    });
    expect(fitLabel(small)).toBe('fits');
  });

  it('may not fit a model larger than anything the GPU has held, and says why', () => {
    const fit = modelFit({ modelBytes: 491_000_000, kvBudgetBytes: 64 * MiB, running: false }, defaults);
    expect(fitLabel(fit)).toBe(
      "may not fit: needs about 532 MiB (weights 468 MiB + KV budget 64 MiB); WebGPU does not report this GPU's memory, and the most it has held here is 70 MiB",
    );
  });

  it("may not fit a KV budget beyond what the GPU's buffer limits let the cache use, even when running", () => {
    expect(kvBytesUsable(defaults)).toBe(512 * MiB);
    const fit = modelFit({ modelBytes: MiB, kvBudgetBytes: 600 * MiB, running: true }, defaults);
    expect(fitLabel(fit)).toBe(
      "may not fit: the KV budget of 600 MiB is more than this GPU's buffer limits let the cache use (512 MiB)",
    );
    expect(modelFit({ modelBytes: MiB, kvBudgetBytes: 512 * MiB, running: true }, defaults).verdict).toBe('fits');
  });
});
