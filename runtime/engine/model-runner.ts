import {
  ContextOverflowError,
  CorruptModelFileError,
  InvalidRequestError,
  ModelNotLoadedError,
} from '../../core/errors.ts';
import type { ByteSource, GgufFile } from '../../core/gguf-types.ts';
import type { MemorySnapshot } from '../../core/gpu/allocator.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { readFloat32 } from '../../core/gpu/readback.ts';
import { type AttentionProducts, prefillAttentionProducts } from '../../kernels/attention.ts';
import { parseGguf } from '../gguf/parse.ts';
import type { TokenConstraint } from '../grammar/constraint.ts';
import { createKvAttention } from '../kv/paged-attention.ts';
import { KvPagePool, type KvPoolOptions, type KvSequence } from '../kv/pool.ts';
import type { KvRotation } from '../kv/rotation.ts';
import {
  findStoredRotations,
  modelDigest,
  type RotationCache,
  type StoredRotations,
  withStoredRotations,
} from '../kv/rotation-store.ts';
import { type ModelConfig, readModelConfig } from '../model/config.ts';
import { int8PrefillReady, type PrefillMatmul, Transformer } from '../model/transformer.ts';
import { loadModelWeights, type ModelWeights, releaseModelWeights, validateTensors } from '../model/weights.ts';
import { GREEDY_SAMPLING, resolveSamplingParams, type SamplingParams } from '../sampling/params.ts';
import { StepRunner } from '../step/step-runner.ts';
import { GgufTokenizer } from '../tokenizer/tokenizer.ts';
import type { FinishReason, KvMode } from './api-types.ts';
import { defaultRotation, LOAD_DEFAULTS, type ParsedLoadOptions, resolveKvMode } from './load-options.ts';
import { kvBinding } from './stored-kv.ts';

export type { FinishReason, KvMode, LoadProgress } from './api-types.ts';

/**
 * What `load` reads: parseLoadOptions' result (LongtabEngine, the CLI and the bench pass it), or, from tests, any part
 * of one (the rest takes LOAD_DEFAULTS). Nothing here is checked again: user input is checked by parseLoadOptions.
 */
export interface LoadOptions extends Partial<ParsedLoadOptions> {
  /** Where calibrated KV rotations are cached (Node: nodeRotationCache(); browser: indexedDbRotationCache()). */
  rotationCache?: RotationCache;
  /**
   * rotation 'calibrated' on a model with no calibrated rotations yet: 'error' (default) throws; 'hadamard' loads
   * with the Hadamard rotation and sets `loaded.kv.calibrationNeeded` (LongtabEngine then calibrates in the
   * background and switches with `switchToCalibratedRotations`).
   */
  missingCalibration?: 'error' | 'hadamard';
  /** The public shape's group (EngineLoadOptions), never read here: such options go through parseLoadOptions. */
  experimental?: never;
}

/**
 * Tokens per prefill submit: 128 (a tab's memory), or 1024 where the prefill runs on the int8 tensor-core matmul: its
 * tiles fill a large GPU only at such sizes (512 measured faster than chunks of 128, 1024 faster than 512, and 2048
 * gained little more: bench/results/2026-12-01-nvidia-h200-session18-qwen3-chunk{1024,2048}.md), and such a GPU has
 * the memory the larger steps take (their GPU MiB column).
 * Not when the KV budget's f16 share could not hold such steps (a 2-bit cache on a small budget):
 * prompts that fit would shrink; then 512 if it holds those.
 */
export function defaultPrefillChunk(tensorCorePrefill: boolean, pool: KvPoolOptions): number {
  if (!tensorCorePrefill) return 128;
  return [1024, 512].find((tokens) => KvPagePool.holdsStep(pool, tokens)) ?? 128;
}

/**
 * The one place load options become pool options (calibrated rotations are found by `load`). It checks nothing a
 * user passed (parseLoadOptions did) but one invariant: boosted layers exist only in the 2-bit cache, and an f16 or
 * 1-bit pool would drop them without a word.
 */
export function kvPoolOptions(config: ModelConfig, options: Partial<ParsedLoadOptions>): KvPoolOptions {
  const kv = resolveKvMode(options, config);
  const codeBits = options.codeBits ?? LOAD_DEFAULTS.codeBits;
  // Which layers exist is the pool's check (its message names them).
  const boostLayers = options.boostLayers ?? [];
  if (boostLayers.length > 0 && (kv !== 'int2' || codeBits !== 2)) {
    throw new InvalidRequestError(
      `kvPoolOptions: boostLayers need kv 'int2' with 2-bit codes, not kv '${kv}' with ${codeBits}-bit codes.`,
      { field: 'boostLayers' },
    );
  }
  // --- KV pool owner's block (int2 mode; runtime/kv/pool.ts documents the options) ---
  const quant =
    kv === 'int2'
      ? {
          kv: 'quant' as const,
          sink: options.sink ?? LOAD_DEFAULTS.sink,
          window: options.window ?? LOAD_DEFAULTS.window,
          keyFormat: { bits: codeBits, groupSize: options.groupSize },
          valueFormat: { bits: codeBits, groupSize: options.groupSize },
          ...(boostLayers.length > 0 ? { boostLayers } : {}),
        }
      : {};
  // --- end of the KV pool owner's block ---
  return {
    ...quant,
    layers: config.layers,
    kvHeads: config.kvHeads,
    headDim: config.headDim,
    budgetBytes: options.kvBudgetBytes ?? LOAD_DEFAULTS.kvBudgetBytes,
    maxSequences: options.maxSequences ?? LOAD_DEFAULTS.maxSequences,
    maxSequenceTokens: options.maxContextTokens ?? config.contextLength,
  };
}

export interface GenerationUsage {
  promptTokens: number;
  completionTokens: number;
  /** Prompt tokens whose KV was already in the sequence (prefix reuse); only the rest was prefilled. */
  cachedTokens: number;
  /** Prompt tokens this request ran through the model. */
  prefilledTokens: number;
  prefillTokensPerSecond: number;
  decodeTokensPerSecond: number;
  /** Time to first token, from the start of prefill. */
  ttftMs: number;
  /** Mean time per output token after the first. */
  tpotMs: number;
}

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
  /**
   * The response format's constraint: before each draw its mask of allowed ids goes to the sampler, after it the id
   * drawn advances it. Each draw then waits for the id before it (the mask depends on it); the forward does not.
   */
  constraint?: TokenConstraint;
}

/** Generation into a sequence the caller owns (a conversation), reusing the KV it already holds. */
export interface SequenceGenerateRequest extends GenerateRequest {
  /**
   * Leading prompt ids whose K/V the sequence already holds. The sequence is truncated to it (at most
   * promptIds.length - 1, so the last prompt token is always run to get logits) and the rest is prefilled.
   */
  reuseTokens?: number;
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
  /** The KV state (pool, forward pass over it, step runner) is replaced as a whole by `switchToCalibratedRotations`. */
  pool: KvPagePool;
  transformer: Transformer;
  runner: StepRunner;
  kv: {
    /** The cache's mode: the kv option, or what an omitted one resolved to for this model (resolveKvMode). */
    mode: KvMode;
    /** What the pool was made with. */
    options: KvPoolOptions;
    /** What the cache stores K/V rotated by ('calibrated': fitted rotations are in use). */
    rotation: KvRotation;
    /** The model's digest (cache key of its rotations) when rotation 'calibrated' was asked for, else null. */
    digest: string | null;
    /** 'calibrated' was asked for but none exist yet: the pool uses Hadamard until rotations are fitted. */
    calibrationNeeded: boolean;
    /** Whether calibrated rotations bring their precision plan (load option experimental.precisionPlan). */
    precisionPlan: 'calibrated' | 'uniform';
    /** What stored KV must match to be read into this pool (runtime/engine/stored-kv.ts kvBinding). */
    binding: string;
    /** The model's digest (rotation-store modelDigest), whatever the rotation. */
    identity: string;
  };
}

/**
 * One model on one device: load, generate, unload. Every GPU buffer it creates is released by `unload()` or by
 * a failed `load()`, so the allocator's counts return to where they were.
 */
export class ModelRunner {
  readonly gpu: GpuContext;
  private model: LoadedModel | null = null;
  private busy = false;
  /** The loaded model's prefill matmul choice (LoadOptions.prefillMatmul), kept for rebuilds of its KV state. */
  private prefillMatmul: PrefillMatmul = 'auto';
  /** The loaded model's prefill attention products: what LoadOptions.prefillAttention asked for where it compiles, else f32. */
  private prefillProducts: AttentionProducts = 'f32';

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
    const prefillMatmul = options.prefillMatmul ?? LOAD_DEFAULTS.prefillMatmul;
    const prefillAttention = options.prefillAttention ?? LOAD_DEFAULTS.prefillAttention;
    this.unload();
    this.prefillMatmul = prefillMatmul;
    const gpu = this.gpu;
    const progress = options.onProgress ?? (() => {});
    progress({ phase: 'parse', bytesDone: 0, bytesTotal: source.size });
    const file = await parseGguf(source);
    // Everything the file holds is read or refused from its header, before any tensor byte is read.
    const config = readModelConfig(file);
    validateTensors(file, config);
    let poolOptions: KvPoolOptions = kvPoolOptions(config, options);
    const mode = resolveKvMode(options, config);
    // An omitted rotation in int2 is 'calibrated' where rotations are stored and Hadamard (calibrating in the
    // background when the caller says so) where not; an explicit 'calibrated' fails without them.
    const requested = options.rotation ?? defaultRotation(mode);
    const implicit = options.rotation === undefined;
    let rotation: KvRotation = { kind: requested === 'hadamard' ? 'hadamard' : 'none' };
    let digest: string | null = null;
    let calibrationNeeded = false;
    const precisionPlan = options.precisionPlan ?? 'calibrated';
    if (requested === 'calibrated') {
      const found = await findStoredRotations(file, source, config, options.rotationCache);
      digest = found.digest;
      if (found.rotations) {
        ({ pool: poolOptions, rotation } = withStoredRotations(poolOptions, found.rotations, precisionPlan));
      } else if (options.missingCalibration === 'hadamard') {
        rotation = { kind: 'hadamard' };
        calibrationNeeded = true;
      } else if (implicit) {
        rotation = { kind: 'hadamard' };
      } else {
        throw new InvalidRequestError(
          "Load option rotation = 'calibrated': this model has no calibrated KV rotations yet. Run `longtab calibrate --model FILE` once (it caches them), or load with rotation 'hadamard'.",
          { option: 'rotation' },
        );
      }
    }
    const tokenizer = GgufTokenizer.fromMetadata(file.metadata);
    // Every token id the tokenizer makes indexes a row of the embedding, and every row the sampler draws must decode:
    // a mismatch would fail mid-generation, blaming the prompt, instead of here, naming the file.
    if (tokenizer.vocabSize !== config.vocab) {
      throw new CorruptModelFileError(
        `${source.name}: its tokenizer has ${tokenizer.vocabSize} tokens (tokenizer.ggml.tokens) but its token embedding has ${config.vocab} rows (token_embd.weight); each token needs exactly one row. The file is damaged or was written by a broken converter: download or convert it again.`,
        { tokens: tokenizer.vocabSize, embeddingRows: config.vocab },
      );
    }
    // The model's identity for stored KV, read while the source is open (sampled bytes, not the whole file).
    const identity = digest ?? (await modelDigest(file, source));
    progress({ phase: 'parse', bytesDone: source.size, bytesTotal: source.size });
    // The longest sequence the pool admits is llama.cpp's n_ctx_seq for phi3's choice of LongRoPE factors.
    const weights = await loadModelWeights(
      gpu,
      file,
      source,
      config,
      (p) => {
        // A lost device fails the load now rather than after reading and uploading the rest of the file.
        if (gpu.isLost) gpu.throwIfErrors();
        progress({ phase: 'upload', bytesDone: p.bytesDone, bytesTotal: p.bytesTotal });
      },
      poolOptions.maxSequenceTokens,
    );
    const created: Array<{ release(): void }> = [{ release: () => releaseModelWeights(gpu, weights) }];
    try {
      const int8 = await int8PrefillReady(gpu, weights, prefillMatmul);
      if (!int8) this.prefillMatmul = 'f32';
      this.prefillProducts = await prefillAttentionProducts(gpu, config.headDim, prefillAttention);
      const tensorCores = int8 && prefillMatmul === 'auto';
      const prefillChunk = options.prefillChunk ?? defaultPrefillChunk(tensorCores, poolOptions);
      poolOptions = { ...poolOptions, maxStepTokens: prefillChunk };
      const kv = this.createKvState(config, weights, poolOptions, rotation, prefillChunk);
      created.push(kv);
      const binding = await kvBinding(identity, kv.state.pool, rotation);
      const model: LoadedModel = {
        file,
        config,
        tokenizer,
        weights,
        ...kv.state,
        kv: { mode, options: poolOptions, rotation, digest, calibrationNeeded, precisionPlan, binding, identity },
      };
      // Calibrate: one warm-up token through the whole pipeline (first submits compile lazily on some drivers).
      progress({ phase: 'calibrate', bytesDone: 0, bytesTotal: 1 });
      await this.warmUp(model);
      progress({ phase: 'calibrate', bytesDone: 1, bytesTotal: 1 });
      this.model = model;
      return config;
    } catch (error) {
      for (const c of created.reverse()) c.release();
      throw error;
    }
  }

  /** The pool, the forward pass over it and the step runner, for `poolOptions`; `release()` undoes a failed build. */
  private createKvState(
    config: ModelConfig,
    weights: ModelWeights,
    poolOptions: KvPoolOptions,
    rotation: KvRotation,
    prefillChunk: number,
  ): { state: Pick<LoadedModel, 'pool' | 'transformer' | 'runner'>; release(): void } {
    const gpu = this.gpu;
    const created: Array<() => void> = [];
    const release = () => {
      for (const c of created.reverse()) c();
    };
    try {
      const pool = new KvPagePool(gpu, poolOptions);
      created.push(() => pool.destroy());
      const transformer = new Transformer(
        gpu,
        config,
        weights,
        // KV pool owner: rotation wrapping lives there
        createKvAttention(gpu, pool, { heads: config.heads, prefillProducts: this.prefillProducts, rotation }),
        prefillChunk,
        { prefillMatmul: this.prefillMatmul },
      );
      created.push(() => transformer.release());
      const runner = new StepRunner(gpu, { pool, transformer, sampling: { label: 'generation' } });
      created.push(() => runner.release());
      return { state: { pool, transformer, runner }, release };
    } catch (error) {
      release();
      throw error;
    }
  }

  private async warmUp(model: LoadedModel): Promise<void> {
    const warmup = model.pool.createSequence();
    try {
      model.pool.reserve(warmup, 1);
      await model.runner.submit({
        seq: warmup,
        position: 0,
        ids: [model.tokenizer.bosId ?? 0],
        sample: { params: GREEDY_SAMPLING, step: 0 },
      });
    } finally {
      model.pool.free(warmup);
    }
    await this.gpu.device.queue.onSubmittedWorkDone();
    this.gpu.throwIfErrors();
  }

  /**
   * Switches the KV cache to calibrated rotations (and their clip quantiles): a new pool, forward pass and runner
   * replace the old ones, which are released. Every sequence of the old pool is gone: their pages were written with
   * the old rotation, so callers drop them first (LongtabEngine re-prefills those conversations on their next turn).
   * Not while a request runs.
   */
  async switchToCalibratedRotations(rotations: StoredRotations): Promise<void> {
    const m = this.require();
    await this.exclusive(async () => {
      const { pool: options, rotation } = withStoredRotations(m.kv.options, rotations, m.kv.precisionPlan);
      const next = this.createKvState(m.config, m.weights, options, rotation, m.transformer.maxTokens);
      try {
        await this.warmUp({ ...m, ...next.state });
      } catch (error) {
        next.release();
        throw error;
      }
      const binding = await kvBinding(m.kv.identity, next.state.pool, rotation);
      const old = { pool: m.pool, transformer: m.transformer, runner: m.runner };
      Object.assign(m, next.state);
      m.kv = { ...m.kv, options, rotation, calibrationNeeded: false, binding };
      old.runner.release();
      old.transformer.release();
      old.pool.destroy();
    });
  }

  unload(): void {
    const m = this.model;
    if (!m) return;
    this.model = null;
    m.runner.release();
    m.transformer.release();
    m.pool.destroy();
    releaseModelWeights(this.gpu, m.weights);
  }

  memory(): MemorySnapshot {
    return this.gpu.allocator.snapshot();
  }

  /** The loaded model's KV pool: sequences for conversations are created, forked and freed through it. */
  get pool(): KvPagePool {
    return this.require().pool;
  }

  /** Greedy or sampled generation from a prompt in a fresh KV sequence (freed afterwards). */
  async generate(request: GenerateRequest): Promise<GenerateResult> {
    const m = this.require();
    const seq = m.pool.createSequence();
    try {
      return await this.generateInSequence(seq, request);
    } finally {
      m.pool.free(seq);
    }
  }

  /**
   * Generation into `seq`, which keeps its K/V afterwards: positions [0, seq.length) hold the prompt followed by
   * the generated ids except the last (never fed back), fewer after an abort: whatever the last completed submit wrote.
   */
  async generateInSequence(seq: KvSequence, request: SequenceGenerateRequest): Promise<GenerateResult> {
    const m = this.require();
    this.validatePrompt(m, request.promptIds);
    if (!Number.isInteger(request.maxTokens) || request.maxTokens < 0) {
      throw new InvalidRequestError(`max_tokens must be an integer >= 0, got ${request.maxTokens}.`);
    }
    const params = resolveSamplingParams(request.sampling ?? {});
    return this.exclusive(() => this.run(m, seq, request, params));
  }

  /** Prefills `ids` into `seq` after its first `reuseTokens` positions (no sampling): shared prefixes. */
  async prefillSequence(seq: KvSequence, ids: number[], reuseTokens = 0): Promise<void> {
    const m = this.require();
    this.validatePrompt(m, ids);
    await this.exclusive(async () => {
      const from = this.rewind(m, seq, ids, reuseTokens, ids.length);
      m.pool.reserve(seq, ids.length);
      const chunk = m.transformer.maxTokens;
      for (let position = from; position < ids.length; position += chunk) {
        m.runner.submit({ seq, position, ids: ids.slice(position, position + chunk) });
      }
      await this.gpu.device.queue.onSubmittedWorkDone();
      this.gpu.throwIfErrors();
    });
  }

  private async exclusive<T>(work: () => Promise<T>): Promise<T> {
    if (this.busy)
      throw new InvalidRequestError('The engine is already generating; wait for the current request or abort it.');
    this.busy = true;
    try {
      return await work();
    } finally {
      this.busy = false;
    }
  }

  /** Truncates `seq` to the reusable prefix (at most `limit`) and returns the first position to prefill. */
  private rewind(m: LoadedModel, seq: KvSequence, ids: number[], reuseTokens: number, limit: number): number {
    if (!Number.isInteger(reuseTokens) || reuseTokens < 0) {
      throw new InvalidRequestError(`reuseTokens must be an integer >= 0, got ${reuseTokens}.`);
    }
    const reuse = Math.min(reuseTokens, seq.length, limit, ids.length);
    m.pool.truncate(seq, reuse);
    return reuse;
  }

  private async run(
    m: LoadedModel,
    seq: KvSequence,
    request: SequenceGenerateRequest,
    params: SamplingParams,
  ): Promise<GenerateResult> {
    const prompt = request.promptIds;
    const start = performance.now();
    const reused = this.rewind(m, seq, prompt, request.reuseTokens ?? 0, prompt.length - 1);
    try {
      m.pool.reserve(seq, prompt.length + request.maxTokens);
    } catch (error) {
      // Room for the prompt but not for every requested token: decode until the pool is full ('length').
      if (!(error instanceof ContextOverflowError)) throw error;
      m.pool.reserve(seq, prompt.length + 1);
    }
    m.runner.resetSamplerHistory(prompt);
    const chunk = m.transformer.maxTokens;
    let step = 0;
    const usage = (generated: number, firstTokenAt: number, end: number): GenerationUsage => {
      const decodeTokens = Math.max(generated - 1, 0);
      return {
        promptTokens: prompt.length,
        completionTokens: generated,
        cachedTokens: reused,
        prefilledTokens: prompt.length - reused,
        prefillTokensPerSecond: (prompt.length - reused) / Math.max((firstTokenAt - start) / 1000, 1e-9),
        decodeTokensPerSecond: decodeTokens > 0 ? decodeTokens / ((end - firstTokenAt) / 1000) : 0,
        ttftMs: firstTokenAt - start,
        tpotMs: decodeTokens > 0 ? (end - firstTokenAt) / decodeTokens : 0,
      };
    };
    const constraint = request.constraint;
    let pending: Promise<number> | null = null;
    for (let position = reused; position < prompt.length; position += chunk) {
      if (request.signal?.aborted) {
        const now = performance.now();
        return { ids: [], finishReason: 'abort', usage: usage(0, now, now) };
      }
      const ids = prompt.slice(position, position + chunk);
      const last = position + ids.length === prompt.length;
      const mask = last && constraint ? await constraint.nextMask() : undefined;
      pending = m.runner.submit({ seq, position, ids, sample: last ? { params, step: step++, mask } : undefined });
    }
    // Decode keeps one step queued ahead of the host: the step that feeds token k (its id copied on the GPU from the
    // sampler's output) is submitted before token k is read back, so the GPU never idles through the readback, the
    // encoding of the next step and the handling of token k. Under a response format the draw of each step waits for
    // the mask the host computes from the id before it, so only the forward goes ahead (StepRunner.submitDraw draws
    // once the host has accepted token k and built the mask): the GPU runs the forward while the host reads the id
    // and computes the mask. When token k ends the reply, the step queued for it was one too many: its K/V
    // (position k) is truncated away, and seq holds what it held without the look-ahead.
    let firstTokenAt = performance.now();
    const generated: number[] = [];
    let finishReason: FinishReason = 'length';
    // The step queued ahead: its position, and (plain decode) the promise of the id it draws; null when none is.
    let ahead: { position: number; id: Promise<number> | null } | null = null;
    try {
      while (pending) {
        const position = prompt.length + generated.length;
        if (generated.length + 1 < request.maxTokens && !request.signal?.aborted) {
          try {
            if (constraint) {
              m.runner.submit({ seq, position, ids: null, logits: 'last' });
              ahead = { position, id: null };
            } else {
              ahead = { position, id: m.runner.submit({ seq, position, ids: null, sample: { params, step: step++ } }) };
            }
          } catch (error) {
            // The pool is full (other sequences hold the rest): the reply ends after the pending token, as at the
            // context limit.
            if (!(error instanceof ContextOverflowError)) throw error;
          }
        }
        const next = await pending;
        pending = null;
        if (generated.length === 0) firstTokenAt = performance.now();
        if (request.maxTokens === 0) break;
        constraint?.accept(next);
        generated.push(next);
        const end = this.replyEnd(m, request, generated);
        if (constraint?.terminated) {
          // The format ended (its stop token drawn).
          finishReason = 'stop';
          break;
        }
        if (end) {
          finishReason = end;
          break;
        }
        if (!ahead) break;
        pending = constraint
          ? m.runner.submitDraw({ params, step: step++, mask: await constraint.nextMask() })
          : ahead.id;
        ahead = null;
      }
    } finally {
      if (ahead) {
        // Wait for a look-ahead draw so its readback buffer is unmapped and its pages are no longer written.
        await ahead.id?.catch(() => undefined);
        m.pool.truncate(seq, ahead.position);
      }
    }
    return { ids: generated, finishReason, usage: usage(generated.length, firstTokenAt, performance.now()) };
  }

  /**
   * Why the reply ends with its last id (`generated` holds it), or null to go on; calls `onToken` with it. The
   * checks of both decode loops, in order: the caller stops it, an end-of-generation id, max_tokens, an abort.
   */
  private replyEnd(m: LoadedModel, request: SequenceGenerateRequest, generated: number[]): FinishReason | null {
    const id = generated[generated.length - 1];
    if (request.onToken?.(id) === false) return 'stop';
    if ((request.stopAtEog ?? true) && m.tokenizer.isEndOfGeneration(id)) return 'stop';
    if (generated.length === request.maxTokens) return 'length';
    if (request.signal?.aborted) return 'abort';
    return null;
  }

  /**
   * Teacher forcing: the logits after each prefix of `ids` ([ids.length × vocab], row t follows ids[0..t]).
   * For evaluation and oracle tests; reads back every row (with `rows`, every prefill chunk holding a row it
   * accepts; the other chunks' rows stay zero), so it is not a generation path.
   */
  async teacherForcedLogits(ids: number[], rows?: (row: number) => boolean): Promise<Float32Array> {
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
        // A chunk with no row the caller needs still fills the cache, but computes no logits and is not waited on.
        const needed = !rows || part.some((_, i) => rows(position + i));
        m.runner.submit({ label: 'teacher-forced', seq, position, ids: part, logits: needed ? 'all' : 'none' });
        if (needed)
          out.set(await readFloat32(this.gpu, m.transformer.allLogitsBuffer(), part.length * vocab), position * vocab);
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

  private require(): LoadedModel {
    if (!this.model) throw new ModelNotLoadedError();
    return this.model;
  }
}
