/**
 * Whether a model fits this GPU, as the model picker says it. WebGPU tells a page the adapter's per-buffer limits but
 * not how much memory the GPU has, so a model only "fits" on evidence: it is running now with this KV budget, or it
 * needs no more than the engine has already held on this device. The engine splits weights and KV pages into buffers
 * within the limits, so the limits bound one thing only: the KV cache's buffer slots cap the budget it can use.
 */
import { MAX_KV_SLABS } from '../../workers/index.ts';
import { formatBytes } from '../storage/models.ts';

/** What the engine has shown about this device (its stats once a model has loaded). */
export interface GpuEvidence {
  maxBufferSize: number;
  maxStorageBufferBindingSize: number;
  /** The most GPU memory the engine has held at once on this device (its allocator's peak). */
  peakBytes: number;
}

export interface FitQuestion {
  /** The model file's size (the weights take about as much GPU memory); null when not known yet. */
  modelBytes: number | null;
  kvBudgetBytes: number;
  /** The model is loaded now with this KV budget. */
  running: boolean;
}

export type ModelFit =
  | { verdict: 'fits'; reason: string }
  | { verdict: 'may-not-fit'; reason: string }
  | { verdict: 'unknown'; reason: string };

/** The most KV memory the engine can use on this GPU: its slab slots, each one buffer binding at most. */
export function kvBytesUsable(gpu: GpuEvidence): number {
  return MAX_KV_SLABS * Math.min(gpu.maxBufferSize, gpu.maxStorageBufferBindingSize);
}

export function modelFit(question: FitQuestion, gpu: GpuEvidence | null): ModelFit {
  const { modelBytes, kvBudgetBytes } = question;
  if (modelBytes === null) return { verdict: 'unknown', reason: 'its size is not known yet' };
  if (gpu === null) {
    return {
      verdict: 'unknown',
      reason: "this GPU's limits are known once a model has loaded (WebGPU does not report its memory)",
    };
  }
  const kvUsable = kvBytesUsable(gpu);
  if (kvBudgetBytes > kvUsable) {
    return {
      verdict: 'may-not-fit',
      reason: `the KV budget of ${formatBytes(kvBudgetBytes)} is more than this GPU's buffer limits let the cache use (${formatBytes(kvUsable)})`,
    };
  }
  if (question.running) return { verdict: 'fits', reason: 'loaded and running with this KV budget' };
  const needed = modelBytes + kvBudgetBytes;
  if (needed <= gpu.peakBytes) {
    return {
      verdict: 'fits',
      reason: `needs about ${formatBytes(needed)}; this GPU has already held ${formatBytes(gpu.peakBytes)}`,
    };
  }
  return {
    verdict: 'may-not-fit',
    reason:
      `needs about ${formatBytes(needed)} (weights ${formatBytes(modelBytes)} + KV budget ${formatBytes(kvBudgetBytes)}); ` +
      `WebGPU does not report this GPU's memory, and the most it has held here is ${formatBytes(gpu.peakBytes)}`,
  };
}

export function fitLabel(fit: ModelFit): string {
  if (fit.verdict === 'fits') return 'fits';
  if (fit.verdict === 'may-not-fit') return `may not fit: ${fit.reason}`;
  return `fit unknown: ${fit.reason}`;
}
