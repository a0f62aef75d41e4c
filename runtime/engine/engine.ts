import { encodeDispatches, type PreparedDispatch } from '../../kernels/dispatch.ts';
import { prepareSampler, type Sampler } from '../../kernels/sample.ts';
import { AbortedError, InvalidRequestError, ModelNotLoadedError } from '../errors.ts';
import { parseGguf } from '../gguf/parse.ts';
import type { ByteSource, GgufFile } from '../gguf/types.ts';
import type { MemorySnapshot } from '../gpu/allocator.ts';
import type { GpuContext } from '../gpu/device.ts';
import { readFloat32 } from '../gpu/readback.ts';
import { PagedKvAttention } from '../kv/paged-attention.ts';
import { KvPagePool, type KvSequence } from '../kv/pool.ts';
import { type ModelConfig, readModelConfig } from '../model/config.ts';
import { Transformer } from '../model/transformer.ts';
import { loadModelWeights, type ModelWeights, releaseModelWeights } from '../model/weights.ts';
import { resolveSamplingParams, type SamplingParams } from '../sampling/params.ts';
import { GgufTokenizer } from '../tokenizer/tokenizer.ts';

export type KvMode = 'f16' | 'int2';

export interface LoadOptions {
  kv?: KvMode;
  /** Bytes of GPU memory the KV pool may grow to (default 64 MiB, capped by the model's context length). */
  kvBudgetBytes?: number;
  /** Tokens per prefill submit (default 128). */
  prefillChunk?: number;
  onProgress?: (progress: LoadProgress) => void;
}

export interface LoadProgress {
  phase: 'parse' | 'upload';
  bytesDone: number;
  bytesTotal: number;
}

export interface GenerationUsage {
  promptTokens: number;
  completionTokens: number;
  prefillTokensPerSecond: number;
  decodeTokensPerSecond: number;
  /** Time to first token, from the start of prefill. */
  ttftMs: number;
  /** Mean time per output token after the first. */
  tpotMs: number;
}

export type FinishReason = 'stop' | 'length' | 'abort';

export interface GenerateRequest {
  /** Prompt token ids, BOS included when the model wants one. Must not be empty. */
  promptIds: number[];
  maxTokens: number;
  sampling?: Partial<SamplingParams>;
  /** Called with each generated id as soon as it is read back. Returning false stops generation. */
  onToken?: (id: number) => boolean | undefined;
  /** Stop at the model's end-of-generation tokens (default true). */
  stopAtEog?: boolean;
  signal?: AbortSignal;
}

export interface GenerateResult {
  ids: number[];
  finishReason: FinishReason;
  usage: GenerationUsage;
}

interface LoadedModel {
  file: GgufFile;
  config: ModelConfig;
  tokenizer: GgufTokenizer;
  weights: ModelWeights;
  pool: KvPagePool;
  transformer: Transformer;
  sampler: Sampler;
  /** u32 the sampler writes; copied to `readback` after each step. */
  sampledId: GPUBuffer;
  readback: GPUBuffer;
}

const DEFAULT_KV_BUDGET = 64 * 1024 * 1024;

/**
 * One model on one device: load, generate, unload. Every GPU buffer it creates is released by `unload()` or by
 * a failed `load()`, so the allocator's counts return to where they were.
 */
export class Engine {
  readonly gpu: GpuContext;
  private model: LoadedModel | null = null;
  private busy = false;

  constructor(gpu: GpuContext) {
    this.gpu = gpu;
  }

  get loaded(): LoadedModel | null {
    return this.model;
  }

  get config(): ModelConfig {
    return this.require().config;
  }

  get tokenizer(): GgufTokenizer {
    return this.require().tokenizer;
  }

  async load(source: ByteSource, options: LoadOptions = {}): Promise<ModelConfig> {
    if (options.kv === 'int2') {
      throw new InvalidRequestError("The int2 KV cache is not available yet in this build; load with { kv: 'f16' }.");
    }
    this.unload();
    const gpu = this.gpu;
    options.onProgress?.({ phase: 'parse', bytesDone: 0, bytesTotal: source.size });
    const file = await parseGguf(source);
    const config = readModelConfig(file);
    const tokenizer = GgufTokenizer.fromMetadata(file.metadata);
    const weights = await loadModelWeights(gpu, file, source, config, (p) =>
      options.onProgress?.({ phase: 'upload', bytesDone: p.bytesDone, bytesTotal: p.bytesTotal }),
    );
    const created: Array<{ release(): void }> = [{ release: () => releaseModelWeights(gpu, weights) }];
    try {
      const pool = new KvPagePool(gpu, {
        layers: config.layers,
        kvHeads: config.kvHeads,
        headDim: config.headDim,
        budgetBytes: options.kvBudgetBytes ?? DEFAULT_KV_BUDGET,
        maxSequenceTokens: config.contextLength,
      });
      created.push({ release: () => pool.destroy() });
      const prefillChunk = options.prefillChunk ?? 128;
      const transformer = new Transformer(
        gpu,
        config,
        weights,
        new PagedKvAttention(gpu, pool, config.heads),
        prefillChunk,
      );
      created.push({ release: () => transformer.release() });
      const sampledId = gpu.allocator.createStorage('sampledId', 'scratch', 16);
      created.push({ release: () => gpu.allocator.release(sampledId) });
      const readback = gpu.allocator.createBuffer({
        label: 'sampledId.readback',
        category: 'staging',
        size: 16,
        usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
      });
      created.push({ release: () => gpu.allocator.release(readback) });
      const sampler = prepareSampler(gpu, 'sampler', {
        logits: transformer.buffers.logits,
        vocab: config.vocab,
        output: sampledId,
      });
      created.push({ release: () => sampler.release() });
      await gpu.device.queue.onSubmittedWorkDone();
      gpu.throwIfErrors();
      this.model = { file, config, tokenizer, weights, pool, transformer, sampler, sampledId, readback };
      return config;
    } catch (error) {
      for (const c of created.reverse()) c.release();
      throw error;
    }
  }

  unload(): void {
    const m = this.model;
    if (!m) return;
    this.model = null;
    m.sampler.release();
    m.transformer.release();
    m.pool.destroy();
    this.gpu.allocator.release(m.sampledId);
    this.gpu.allocator.release(m.readback);
    releaseModelWeights(this.gpu, m.weights);
  }

  memory(): MemorySnapshot {
    return this.gpu.allocator.snapshot();
  }

  /** Greedy or sampled generation from a prompt in a fresh KV sequence. */
  async generate(request: GenerateRequest): Promise<GenerateResult> {
    const m = this.require();
    if (this.busy)
      throw new InvalidRequestError('The engine is already generating; wait for the current request or abort it.');
    this.validatePrompt(m, request.promptIds);
    if (!Number.isInteger(request.maxTokens) || request.maxTokens < 0) {
      throw new InvalidRequestError(`max_tokens must be an integer >= 0, got ${request.maxTokens}.`);
    }
    const params = resolveSamplingParams(request.sampling ?? {});
    this.busy = true;
    const seq = m.pool.createSequence();
    try {
      return await this.run(m, seq, request, params);
    } finally {
      m.pool.free(seq);
      this.busy = false;
    }
  }

  private async run(
    m: LoadedModel,
    seq: KvSequence,
    request: GenerateRequest,
    params: SamplingParams,
  ): Promise<GenerateResult> {
    const prompt = request.promptIds;
    const start = performance.now();
    m.pool.reserve(seq, prompt.length + request.maxTokens);
    m.sampler.resetHistory(prompt);
    const chunk = m.transformer.maxTokens;
    let step = 0;
    let next = -1;
    for (let position = 0; position < prompt.length; position += chunk) {
      const ids = prompt.slice(position, position + chunk);
      const last = position + ids.length === prompt.length;
      this.throwIfAborted(request.signal);
      next = await this.step(m, seq, ids, position, last ? { params, step: step++ } : null);
    }
    const firstTokenAt = performance.now();
    const generated: number[] = [];
    let finishReason: FinishReason = 'length';
    let position = prompt.length;
    while (generated.length < request.maxTokens) {
      generated.push(next);
      if (request.onToken?.(next) === false) {
        finishReason = 'stop';
        break;
      }
      if ((request.stopAtEog ?? true) && m.tokenizer.isEndOfGeneration(next)) {
        finishReason = 'stop';
        break;
      }
      if (generated.length === request.maxTokens) break;
      if (request.signal?.aborted) {
        finishReason = 'abort';
        break;
      }
      next = await this.step(m, seq, [next], position, { params, step: step++ });
      position += 1;
    }
    const end = performance.now();
    const decodeTokens = Math.max(generated.length - 1, 0);
    return {
      ids: generated,
      finishReason,
      usage: {
        promptTokens: prompt.length,
        completionTokens: generated.length,
        prefillTokensPerSecond: prompt.length / Math.max((firstTokenAt - start) / 1000, 1e-9),
        decodeTokensPerSecond: decodeTokens > 0 ? decodeTokens / ((end - firstTokenAt) / 1000) : 0,
        ttftMs: firstTokenAt - start,
        tpotMs: decodeTokens > 0 ? (end - firstTokenAt) / decodeTokens : 0,
      },
    };
  }

  /**
   * One submit: forward over `ids` at `position`; with `sample`, also the logits, the sampler, and the 4-byte
   * readback of the chosen id (the only readback of a decode step).
   */
  private async step(
    m: LoadedModel,
    seq: KvSequence,
    ids: number[],
    position: number,
    sample: { params: SamplingParams; step: number } | null,
  ): Promise<number> {
    const { device } = this.gpu;
    m.pool.writeStep(seq, position, ids.length);
    m.transformer.writeStep(ids, position);
    if (sample) m.sampler.setParams(sample.params, sample.step);
    const encoder = device.createCommandEncoder({ label: sample ? 'decode' : 'prefill' });
    m.transformer.encode(encoder, ids.length, sample ? 'last' : 'none');
    if (sample) {
      const pass = encoder.beginComputePass({ label: 'sample' });
      encodeDispatches(pass, m.sampler.dispatches as PreparedDispatch[]);
      pass.end();
      encoder.copyBufferToBuffer(m.sampledId, 0, m.readback, 0, 4);
    }
    device.queue.submit([encoder.finish()]);
    if (!sample) return -1;
    await m.readback.mapAsync(GPUMapMode.READ, 0, 4);
    const id = new Uint32Array(m.readback.getMappedRange(0, 4))[0];
    m.readback.unmap();
    this.gpu.throwIfErrors();
    return id;
  }

  /**
   * Teacher forcing: the logits after each prefix of `ids` ([ids.length × vocab], row t follows ids[0..t]).
   * For evaluation and oracle tests; reads back every row, so it is not a generation path.
   */
  async teacherForcedLogits(ids: number[]): Promise<Float32Array> {
    const m = this.require();
    this.validatePrompt(m, ids);
    if (this.busy) throw new InvalidRequestError('The engine is busy with another request.');
    this.busy = true;
    const seq = m.pool.createSequence();
    const vocab = m.config.vocab;
    const out = new Float32Array(ids.length * vocab);
    try {
      m.pool.reserve(seq, ids.length);
      const chunk = m.transformer.maxTokens;
      for (let position = 0; position < ids.length; position += chunk) {
        const part = ids.slice(position, position + chunk);
        m.pool.writeStep(seq, position, part.length);
        m.transformer.writeStep(part, position);
        const encoder = this.gpu.device.createCommandEncoder({ label: 'teacher-forced' });
        m.transformer.encode(encoder, part.length, 'all');
        this.gpu.device.queue.submit([encoder.finish()]);
        const rows = await readFloat32(this.gpu, m.transformer.allLogitsBuffer(), part.length * vocab);
        out.set(rows, position * vocab);
        this.gpu.throwIfErrors();
      }
      return out;
    } finally {
      m.pool.free(seq);
      this.busy = false;
    }
  }

  private validatePrompt(m: LoadedModel, ids: number[]): void {
    if (ids.length === 0) throw new InvalidRequestError('The prompt is empty: pass at least one token (e.g. BOS).');
    for (const id of ids) {
      if (!Number.isInteger(id) || id < 0 || id >= m.config.vocab) {
        throw new InvalidRequestError(`Prompt token id ${id} is outside the vocabulary (0..${m.config.vocab - 1}).`);
      }
    }
  }

  private throwIfAborted(signal?: AbortSignal): void {
    if (signal?.aborted) throw new AbortedError();
  }

  private require(): LoadedModel {
    if (!this.model) throw new ModelNotLoadedError();
    return this.model;
  }
}
