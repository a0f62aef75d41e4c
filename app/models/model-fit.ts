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
  /** The forward pass's activations where the model's shape is known (a preset's: scratchBytesEstimate), else 0. */
  scratchBytes?: number;
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

/** What the engine's forward pass sizes its scratch by: the GGUF header's numbers (runtime/model/config.ts). */
export interface ModelShape {
  dim: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  ffnDim: number;
  vocab: number;
}

/**
 * Positions per prefill chunk on a GPU without tensor-core prefill, most browsers' (defaultPrefillChunk in
 * runtime/engine/model-runner.ts); where it has one the chunk is 512–1024 and scratch grows with it.
 */
export const PAGE_PREFILL_CHUNK = 128;

/**
 * The activations runtime/model/transformer.ts allocates for one prefill chunk (x, its norm, q/k/v, the attention
 * output, gate/up/hidden, all f32), its last hidden row and logits, and the sampler's vocab-sized work buffer. A lower
 * bound: attention split partials and int8 prefill buffers come on top (on lavapipe, Qwen2.5-0.5B's 10 MB of these
 * against 14 MB measured in bench/journal.md; more on GPUs whose attention splits over many workgroups).
 */
export function scratchBytesEstimate(shape: ModelShape, chunkTokens = PAGE_PREFILL_CHUNK): number {
  const { dim, heads, kvHeads, headDim, ffnDim, vocab } = shape;
  const perToken = 1 + 2 * dim + 2 * heads * headDim + 2 * kvHeads * headDim + 3 * ffnDim;
  return 4 * (chunkTokens * perToken + dim + 2 * vocab);
}

/**
 * GPU memory a model takes at most: its weights (about the file's size; Q4_0/Q5_0/Q8_0/IQ4_NL blocks are padded to
 * whole words on upload, up to 11% more), the KV cache's budget (the pool's pages grow up to it as conversations
 * lengthen, never past it), and scratch.
 */
export interface GpuMemoryEstimate {
  weights: number;
  kv: number;
  scratch: number;
  total: number;
}

export function gpuMemoryEstimate(weightsBytes: number, kvBudgetBytes: number, scratchBytes = 0): GpuMemoryEstimate {
  return {
    weights: weightsBytes,
    kv: kvBudgetBytes,
    scratch: scratchBytes,
    total: weightsBytes + kvBudgetBytes + scratchBytes,
  };
}

/** "weights 468 MiB + KV budget 64 MiB" (+ scratch where it is known). */
export function gpuMemoryParts(memory: GpuMemoryEstimate): string {
  const scratch = memory.scratch > 0 ? ` + scratch ${formatBytes(memory.scratch)}` : '';
  return `weights ${formatBytes(memory.weights)} + KV budget ${formatBytes(memory.kv)}${scratch}`;
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
  const memory = gpuMemoryEstimate(modelBytes, kvBudgetBytes, question.scratchBytes);
  const needed = memory.total;
  if (needed <= gpu.peakBytes) {
    return {
      verdict: 'fits',
      reason: `needs about ${formatBytes(needed)}; this GPU has already held ${formatBytes(gpu.peakBytes)}`,
    };
  }
  return {
    verdict: 'may-not-fit',
    reason:
      `needs about ${formatBytes(needed)} (${gpuMemoryParts(memory)}); ` +
      `WebGPU does not report this GPU's memory, and the most it has held here is ${formatBytes(gpu.peakBytes)}`,
  };
}

export function fitLabel(fit: ModelFit): string {
  if (fit.verdict === 'fits') return 'fits';
  if (fit.verdict === 'may-not-fit') return `may not fit: ${fit.reason}`;
  return `fit unknown: ${fit.reason}`;
}
