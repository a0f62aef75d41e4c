import { InvalidRequestError } from '../core/errors.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import {
  bindBuffers,
  computePipeline,
  type PreparedDispatch,
  releaseDispatches,
  uniformBuffer,
} from '../core/gpu/dispatch.ts';
import { SAMPLE_SPAN, SAMPLE_WORKGROUP, sampleWgsl } from './sample.wgsl.ts';

/**
 * The values the sampler's uniform holds, already validated (runtime/sampling/params.ts validates requests;
 * its `SamplingParams` has this shape). Chain, as llama.cpp's common sampler:
 * repetition penalty → top-k → top-p → min-p → temperature → draw.
 */
export interface SamplerParams {
  /** 0 = greedy argmax (ties → lowest id); otherwise the draw is from softmax(logits / temperature). */
  temperature: number;
  /** Keep the tokens whose logit is at least the k-th largest (ties kept); 0 = off. */
  topK: number;
  /** Keep the smallest top set whose softmax mass (at temperature 1, over the top-k survivors) reaches p; 1 = off. */
  topP: number;
  /** Keep the tokens with probability >= minP × the top probability; 0 = off. */
  minP: number;
  /** llama.cpp repeat penalty over the history ring; 1 = off. */
  repetitionPenalty: number;
  /** Any safe integer; with `step` it fixes the draw. */
  seed: number;
}

export interface SamplerBinding {
  /** f32 logits [vocab]; read only. */
  logits: GPUBuffer;
  vocab: number;
  /** u32 buffer; the chosen id is written to element 0. */
  output: GPUBuffer;
  /** How many recent ids the repetition penalty looks at (default 64). */
  historyCapacity?: number;
}

export interface Sampler {
  /** Appended to the decode step's dispatches, after the one that writes the logits. */
  readonly dispatches: PreparedDispatch[];
  readonly vocab: number;
  readonly historyCapacity: number;
  /** Writes the parameter uniform for the next submit; `step` (a u32 counter) picks the random number. */
  setParams(params: SamplerParams, step: number): void;
  /**
   * The ids the next draws may take (a grammar's allowed next tokens): bit i % 32 of word i / 32 allows id i, in
   * ceil(vocab / 32) words; null lets every id through. Takes effect with the next `setParams` (whose uniform says
   * whether a mask applies) and stays until the next call.
   */
  setMask(mask: Uint32Array | null): void;
  /** Replaces the history ring with the last `historyCapacity` of `ids` (the prompt), oldest first. */
  resetHistory(ids: readonly number[]): void;
  release(): void;
}

export const DEFAULT_HISTORY_CAPACITY = 64;

/** PCG hash, the same integer arithmetic as `pcg` in sample.wgsl.ts. */
function pcgHash(v: number): number {
  const s = (Math.imul(v >>> 0, 747796405) + 2891336453) >>> 0;
  const w = Math.imul(((s >>> ((s >>> 28) + 4)) ^ s) >>> 0, 277803737) >>> 0;
  return ((w >>> 22) ^ w) >>> 0;
}

function splitSeed(seed: number): [number, number] {
  return [seed >>> 0, Math.floor(seed / 4294967296) >>> 0];
}

/** The uniform number in [0, 1) the GPU draws with for (seed, step): exactly what the kernel computes. */
export function samplingUniform(seed: number, step: number): number {
  const [lo, hi] = splitSeed(seed);
  const h = pcgHash((pcgHash(pcgHash(lo) ^ hi) + (step >>> 0)) >>> 0);
  return (h >>> 8) / 16777216;
}

/** The history buffer contents for `ids`: [count, ring...], where id j (0-based) sits in slot j % capacity. */
export function historyRingWords(ids: readonly number[], capacity: number): Uint32Array {
  const words = new Uint32Array(1 + capacity);
  words[0] = ids.length;
  for (let j = Math.max(0, ids.length - capacity); j < ids.length; j++) words[1 + (j % capacity)] = ids[j];
  return words;
}

const PARAM_KINDS = 'ufufffuuuuuu';

function paramWords(vocab: number, capacity: number, p: SamplerParams, step: number, masked: boolean): number[] {
  const [lo, hi] = splitSeed(p.seed);
  const penalty = p.repetitionPenalty;
  return [vocab, p.temperature, p.topK, p.topP, p.minP, penalty, lo, hi, step >>> 0, capacity, masked ? 1 : 0, 0];
}

/** Words of a token mask over `vocab` ids. */
export function tokenMaskWords(vocab: number): number {
  return Math.ceil(vocab / 32);
}

/** Whether `mask` allows at least one id below `vocab`. */
function allowsAny(mask: Uint32Array, vocab: number): boolean {
  const full = Math.floor(vocab / 32);
  for (let w = 0; w < full; w++) if (mask[w] !== 0) return true;
  const rest = vocab % 32;
  return rest > 0 && (mask[full] & ((2 ** rest - 1) >>> 0)) !== 0;
}

function packParams(words: number[], view: DataView): void {
  words.forEach((w, i) => {
    if (PARAM_KINDS[i] === 'f') view.setFloat32(i * 4, w, true);
    else view.setUint32(i * 4, w, true);
  });
}

const GREEDY: SamplerParams = { temperature: 0, topK: 0, topP: 1, minP: 0, repetitionPenalty: 1, seed: 0 };

/**
 * Prepares the sampling dispatches (22 small passes, see sample.wgsl.ts) for one logits buffer. Nothing is
 * allocated or read back per token: `setParams` rewrites a uniform, the history ring lives on the GPU and the
 * draw appends to it.
 */
export function prepareSampler(gpu: GpuContext, label: string, b: SamplerBinding): Sampler {
  const vocab = b.vocab;
  const capacity = b.historyCapacity ?? DEFAULT_HISTORY_CAPACITY;
  if (!Number.isInteger(vocab) || vocab < 1 || vocab > 0x7fffffff) {
    throw new InvalidRequestError(`Sampler '${label}': vocab must be a positive integer, got ${vocab}.`);
  }
  if (!Number.isInteger(capacity) || capacity < 1 || capacity > 65536) {
    throw new InvalidRequestError(
      `Sampler '${label}': historyCapacity must be an integer in [1, 65536], got ${capacity}.`,
    );
  }
  const groups = Math.ceil(vocab / SAMPLE_SPAN);
  const scratchWords = 3 * groups + 768 * groups;

  const work = gpu.allocator.createStorage(`${label}.work`, 'scratch', vocab * 4);
  const scratch = gpu.allocator.createStorage(`${label}.scratch`, 'scratch', scratchWords * 4);
  const state = gpu.allocator.createStorage(`${label}.state`, 'scratch', 32);
  const history = gpu.allocator.createStorage(`${label}.history`, 'scratch', historyRingWords([], capacity));
  const params = uniformBuffer(gpu, `${label}.params`, paramWords(vocab, capacity, GREEDY, 0, false), PARAM_KINDS);
  const mask = gpu.allocator.createStorage(`${label}.mask`, 'scratch', tokenMaskWords(vocab) * 4);
  const owned: GPUBuffer[] = [work, scratch, state, history, params, mask];
  let masked = false;

  const dispatches: PreparedDispatch[] = [];
  const add = (name: keyof typeof sampleWgsl, buffers: GPUBuffer[], workgroups: number, extra: GPUBuffer[] = []) => {
    const pipeline = computePipeline(gpu, `sample.${name}`, sampleWgsl[name]);
    const dispatchLabel = `${label}.${name}`;
    dispatches.push({
      label: dispatchLabel,
      pipeline,
      bindGroup: bindBuffers(gpu, dispatchLabel, pipeline, buffers),
      workgroups: [workgroups, 1, 1],
      owned: extra,
    });
  };

  // The sampler's buffers ride on the first dispatch so that releaseDispatches(sampler.dispatches) frees them too.
  add('copy', [b.logits, work, params, mask], Math.ceil(vocab / SAMPLE_WORKGROUP), owned);
  add('penalty', [b.logits, work, history, params], 1);
  add('partialMax', [work, scratch, params], groups);
  add('reduceMax', [scratch, state, b.output, history, params], 1);
  for (const [mode, modeName] of [
    [0, 'topK'],
    [1, 'topP'],
  ] as const) {
    for (let digit = 0; digit < 4; digit++) {
      const stage = uniformBuffer(gpu, `${label}.${modeName}${digit}`, [mode, digit, 0, 0], 'uuuu');
      add('histogram', [work, scratch, state, params, stage], groups, [stage]);
      add('select', [scratch, state, params, stage], 1);
    }
  }
  add('partialSum', [work, scratch, state, params], groups);
  add('draw', [work, scratch, state, b.output, history, params], 1);

  const paramView = new DataView(new ArrayBuffer(PARAM_KINDS.length * 4));
  return {
    dispatches,
    vocab,
    historyCapacity: capacity,
    setParams(p: SamplerParams, step: number): void {
      packParams(paramWords(vocab, capacity, p, step, masked), paramView);
      gpu.device.queue.writeBuffer(params, 0, paramView.buffer);
    },
    setMask(words: Uint32Array | null): void {
      if (words !== null) {
        if (words.length !== tokenMaskWords(vocab)) {
          throw new InvalidRequestError(
            `Sampler '${label}': a token mask over ${vocab} ids has ${tokenMaskWords(vocab)} words, got ${words.length}.`,
          );
        }
        if (!allowsAny(words, vocab)) {
          throw new InvalidRequestError(`Sampler '${label}': the token mask allows no token, so nothing can be drawn.`);
        }
        gpu.device.queue.writeBuffer(mask, 0, words.buffer, words.byteOffset, words.byteLength);
      }
      masked = words !== null;
    },
    resetHistory(ids: readonly number[]): void {
      const words = historyRingWords(ids, capacity);
      gpu.device.queue.writeBuffer(history, 0, words.buffer, words.byteOffset, words.byteLength);
    },
    release(): void {
      releaseDispatches(gpu, dispatches);
    },
  };
}
