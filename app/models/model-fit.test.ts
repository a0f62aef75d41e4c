import { describe, expect, it } from 'vitest';
import {
  fitLabel,
  type GpuEvidence,
  gpuMemoryEstimate,
  gpuMemoryParts,
  kvBytesUsable,
  modelFit,
  scratchBytesEstimate,
} from './model-fit.ts';

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

describe('GPU memory estimate', () => {
  // Qwen2.5-0.5B's header: 896 wide, 14 heads and 2 KV heads of 64, feed-forward 4864, vocabulary 151936.
  const qwen25 = { dim: 896, heads: 14, kvHeads: 2, headDim: 64, ffnDim: 4864, vocab: 151936 };

  it("counts transformer.ts's activations for one 128-token chunk, buffer by buffer", () => {
    const chunk = 128;
    const f32 = [
      chunk, // tokenIds
      chunk * 896, // x
      chunk * 896, // xNorm
      chunk * 14 * 64, // q
      chunk * 2 * 64, // k
      chunk * 2 * 64, // v
      chunk * 14 * 64, // attention
      chunk * 4864, // gate
      chunk * 4864, // up
      chunk * 4864, // hidden
      896, // lastHidden
      151936, // logits
      151936, // the sampler's work
    ];
    const bytes = 4 * f32.reduce((a, b) => a + b, 0);
    expect(bytes).toBe(10_656_768);
    expect(scratchBytesEstimate(qwen25)).toBe(bytes);
    // Measured on lavapipe at this chunk: 14 MB of scratch (bench/journal.md); the estimate is the part it can name.
    expect(scratchBytesEstimate(qwen25)).toBeLessThan(14_000_000);
    expect(scratchBytesEstimate(qwen25, 1024)).toBeGreaterThan(7 * scratchBytesEstimate(qwen25));
  });

  it('adds weights, the KV budget and scratch, and the fit check says the same sum', () => {
    const memory = gpuMemoryEstimate(491_000_000, 64 * MiB, scratchBytesEstimate(qwen25));
    expect(memory.total).toBe(491_000_000 + 64 * MiB + 10_656_768);
    expect(gpuMemoryParts(memory)).toBe('weights 468 MiB + KV budget 64 MiB + scratch 10 MiB');
    const fit = modelFit(
      { modelBytes: 491_000_000, kvBudgetBytes: 64 * MiB, scratchBytes: memory.scratch, running: false },
      defaults,
    );
    expect(fitLabel(fit)).toBe(
      "may not fit: needs about 542 MiB (weights 468 MiB + KV budget 64 MiB + scratch 10 MiB); WebGPU does not report this GPU's memory, and the most it has held here is 70 MiB",
    );
  });
});
