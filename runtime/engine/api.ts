/**
 * LongtabEngine: the OpenAI-shaped API over one model runner (`ModelRunner`: one model on one device). The same class runs
 * in-process (Node, tests) and inside the engine worker (workers/engine.worker.ts), which wraps it for comlink.
 *
 * Requests queue and run one at a time. Each chat request renders the conversation with the model's chat template,
 * reuses whatever prefix of its tokens the conversation's KV sequence already holds (conversations.ts) and prefills
 * only the rest.
 */

import { AbortedError, ContextOverflowError, InvalidRequestError, ModelNotLoadedError } from '../../core/errors.ts';
import type { ByteSource } from '../../core/gguf-types.ts';
import { acquireGpu, type GpuContext } from '../../core/gpu/device.ts';
import type { RemoteTimeouts } from '../../core/remote-file.ts';
import { abortableSource, sourceFromBlob, sourceFromUrl } from '../gguf/sources.ts';
import { ResponseFormatCompiler, type TokenConstraint } from '../grammar/constraint.ts';
import type { RotationCache, StoredRotations } from '../kv/rotation-store.ts';
import { resolveSamplingParams } from '../sampling/params.ts';
import {
  type ChatMessage,
  chatTemplateFromMetadata,
  encodeConversation,
  probeChatTemplate,
} from '../tokenizer/chat-template.ts';
import { StopStringMatcher } from '../tokenizer/stop-strings.ts';
import type {
  ChatCompletion,
  ChatCompletionChunk,
  ChatCompletionRequest,
  ChatToolCall,
  ChatToolCallDelta,
  Completion,
  CompletionRequest,
  CompletionStream,
  CompletionUsage,
  EngineLoadOptions,
  EngineStats,
  KvRotationState,
  LongtabEngineApi,
  ModelInfo,
  ModelSource,
  ResponseFormat,
  SpecialTokensInContent,
  StoredKvUsage,
} from './api-types.ts';
import { BackgroundCalibration, defaultCalibrationTokens } from './background-calibration.ts';
import { type CachedSequence, ConversationCache, commonPrefixLength } from './conversations.ts';
import type { KvFileStore } from './kv-file-store.ts';
import { f16TokensInBudget, planStats } from './kv-stats.ts';
import { type ParsedLoadOptions, parseLoadOptions } from './load-options.ts';
import { type FinishReason, type GenerateResult, type LoadProgress, ModelRunner } from './model-runner.ts';
import { storedRecordName } from './stored-kv.ts';
import { forcedCallFrame, forcedCallSchema, ToolCallReader, type ToolFormat, toolFormatOf } from './tool-calls.ts';
import {
  type ValidatedChatRequest,
  type ValidatedSampling,
  validateChatRequest,
  validateCompletionRequest,
  validateId,
} from './validate.ts';

export * from './api-types.ts';

const DEFAULT_MAX_TOKENS = 256;
/**
 * Live stats during a reply: once its prompt is in (the first token), then at most this often, so context and KV
 * used move as tokens arrive without a snapshot per token on a fast GPU (and always after each request).
 */
const STATS_EVERY_MS = 100;

export interface LongtabEngineOptions {
  /**
   * The device, or how to get it (default: `acquireGpu()` on navigator.gpu, when the first model loads). A context
   * passed in stays the caller's; one the engine acquired is destroyed by `destroy()`.
   */
  gpu?: GpuContext | (() => Promise<GpuContext>);
  /** Opens a file path (Node only: `sourceFromPath`); without it, strings must be URLs. */
  openPath?: (path: string) => Promise<ByteSource>;
  /** Where calibrated KV rotations are cached (`rotation: 'calibrated'`). */
  rotationCache?: RotationCache;
  /**
   * Where conversations' KV goes below host memory and persists (`persist`): the worker's is OPFS
   * (opfsKvFileStore), Node's a directory (nodeKvFileStore). Without one, evicted conversations past the host budget
   * are re-prefilled and `persist` is refused.
   */
  kvStore?: KvFileStore;
}

/** A pull-based stream: the producer pushes, `for await` pulls; `return()` (break) aborts the request. */
class ChunkStream<T> implements CompletionStream<T> {
  private readonly items: T[] = [];
  private waiting: ((result: IteratorResult<T>) => void) | null = null;
  private failWaiting: ((error: unknown) => void) | null = null;
  private done = false;
  private error: unknown = null;
  private readonly onAbort: () => void;

  constructor(onAbort: () => void) {
    this.onAbort = onAbort;
  }

  push(item: T): void {
    if (this.done) return;
    if (this.waiting) {
      const resolve = this.waiting;
      this.waiting = this.failWaiting = null;
      resolve({ value: item, done: false });
    } else this.items.push(item);
  }

  end(error?: unknown): void {
    if (this.done) return;
    this.done = true;
    if (error !== undefined) this.error = error;
    if (this.waiting) {
      const resolve = this.waiting;
      const reject = this.failWaiting!;
      this.waiting = this.failWaiting = null;
      if (error !== undefined) reject(error);
      else resolve({ value: undefined, done: true });
    }
  }

  abort(): void {
    this.onAbort();
  }

  next(): Promise<IteratorResult<T>> {
    const item = this.items.shift();
    if (item !== undefined) return Promise.resolve({ value: item, done: false });
    if (this.done) {
      if (this.error !== null) {
        const error = this.error;
        this.error = null;
        return Promise.reject(error);
      }
      return Promise.resolve({ value: undefined, done: true });
    }
    return new Promise((resolve, reject) => {
      this.waiting = resolve;
      this.failWaiting = reject;
    });
  }

  [Symbol.asyncIterator](): AsyncIterator<T> {
    return {
      next: () => this.next(),
      return: async () => {
        if (!this.done) this.onAbort();
        return { value: undefined, done: true };
      },
    };
  }
}

/** Whether `text` is one JSON value, whole. */
function isWholeJson(text: string): boolean {
  try {
    JSON.parse(text);
    return true;
  } catch {
    return false;
  }
}

function newId(prefix: string): string {
  const random =
    typeof crypto !== 'undefined' && 'randomUUID' in crypto
      ? crypto.randomUUID().replaceAll('-', '')
      : Math.random().toString(16).slice(2) + Date.now().toString(16);
  return `${prefix}-${random.slice(0, 24)}`;
}

/** What one request produced, before it is shaped as a ChatCompletion or a Completion. */
interface RunOutcome {
  /** The reply's text (a chat reply with tools: its content, the calls taken out). */
  text: string;
  /** A chat reply's calls of the request's tools (none without tools). */
  toolCalls: ChatToolCall[];
  finishReason: FinishReason;
  usage: CompletionUsage;
}

/** What a chat reply lets out as it is read: content, and calls of the request's tools. */
interface ChatDelta {
  content?: string;
  tool_calls?: ChatToolCallDelta[];
}

/** A chat request's tools as its reply meets them: their format, and the frame of a forced call. */
interface ToolPlan {
  format: ToolFormat;
  /** A forced call ('required' or a named function): the reply is decoded under `format`, the call's schema. */
  forced: { frame: { prefix: string; suffix: string }; format: ResponseFormat } | null;
}

interface GenerationRun {
  maxTokens: number;
  request: ValidatedSampling;
  /** The format the reply is decoded under: the request's, or a forced tool call's. */
  format: ResponseFormat;
  /** How `format` compiles (ResponseFormatCompiler.constraint): where its errors point, its JSON's layout. */
  formatOptions?: { field?: string; oneLine?: boolean };
  signal: AbortSignal;
  onText: (text: string) => void;
  /** System-prompt tokens prefilled for this request before it ran (reported as prefilled, not cached). */
  systemPrefilled: number;
  /** The reply starts a text (chat, or raw text from BOS): drop SentencePiece's leading space. */
  startsText: boolean;
}

interface PreparedPrompt {
  ids: number[];
  systemIds: number[] | null;
  droppedMessages: number;
}

export class LongtabEngine implements LongtabEngineApi {
  private readonly options: LongtabEngineOptions;
  private gpuContext: GpuContext | null = null;
  private modelRunner: ModelRunner | null = null;
  private cache: ConversationCache | null = null;
  /** The load option `persist`: whether conversations keep their KV in the store unless a request says otherwise. */
  private persistDefault = false;
  private modelInfo: ModelInfo | null = null;
  private template = '';
  /** The queue: each request chains on the previous one. */
  private tail: Promise<unknown> = Promise.resolve();
  private waiting = 0;
  private running = false;
  /** Bumped by abort(): requests submitted before it end with finish_reason 'abort'. */
  private abortEpoch = 0;
  private current: AbortController | null = null;
  private readonly listeners = new Set<(stats: EngineStats) => void>();
  /** Background calibration of the KV rotations (load with rotation 'calibrated' and none fitted yet). */
  private calibration: BackgroundCalibration | null = null;
  /** The loaded model's response-format compiler, made on the first constrained request. */
  private formats: Promise<ResponseFormatCompiler> | null = null;
  /** When the queue last became empty (null while a request runs or waits), and who waits for that. */
  private idleAt: number | null = 0;
  private idleWaiters: Array<() => void> = [];

  readonly chat: LongtabEngineApi['chat'];
  readonly completions: LongtabEngineApi['completions'];

  constructor(options: LongtabEngineOptions = {}) {
    this.options = options;
    this.chat = {
      completions: { create: ((request: ChatCompletionRequest) => this.createChat(request)) as never },
    };
    this.completions = { create: ((request: CompletionRequest) => this.createCompletion(request)) as never };
  }

  /** The model runner below the API (tests use its tokenizer and pool); null before the first load. */
  get runner(): ModelRunner | null {
    return this.modelRunner;
  }

  async load(source: ModelSource, options: EngineLoadOptions = {}): Promise<ModelInfo> {
    // Checked before the queue: a bad option fails the call and leaves the loaded model as it was.
    const parsed = parseLoadOptions(options);
    if (parsed.persist && !this.options.kvStore) {
      throw new InvalidRequestError(
        'Load option persist: this engine has no KV store to keep conversations in (createEngine() in a browser worker has OPFS; Node engines a directory).',
        { option: 'persist' },
      );
    }
    const onProgress = parsed.onProgress ?? (() => {});
    const epoch = this.abortEpoch;
    return this.enqueue(async () => {
      // abort() or unload() while the load waited in the queue: it never starts, and the loaded model stays.
      if (epoch !== this.abortEpoch) throw new AbortedError('Loading the model was aborted before it started.');
      await this.stopCalibration();
      await this.cache?.releaseStore();
      this.unloadNow();
      // abort(), unload() and destroy() end the load through this controller, at its next read or request.
      const controller = new AbortController();
      this.current = controller;
      try {
        return await this.loadNow(source, parsed, onProgress, controller.signal);
      } finally {
        this.current = null;
      }
    });
  }

  private async loadNow(
    source: ModelSource,
    parsed: ParsedLoadOptions,
    onProgress: (p: LoadProgress) => void,
    signal: AbortSignal,
  ): Promise<ModelInfo> {
    const gpu = await this.gpu();
    const runner = (this.modelRunner ??= new ModelRunner(gpu));
    const bytes = abortableSource(await this.openSource(source, onProgress, parsed, signal), signal);
    try {
      await runner.load(bytes, {
        ...parsed,
        onProgress,
        rotationCache: this.options.rotationCache,
        missingCalibration: parsed.calibrate === 'off' ? 'error' : 'hadamard',
      });
    } finally {
      await bytes.close?.();
    }
    if (signal.aborted) {
      runner.unload();
      throw new AbortedError('Loading the model was aborted.');
    }
    const loaded = runner.loaded!;
    const template = chatTemplateFromMetadata(loaded.file.metadata);
    try {
      // A template that cannot render a short conversation within its limits refuses the model now, not at the
      // first request.
      probeChatTemplate(template);
    } catch (error) {
      runner.unload();
      throw error;
    }
    this.cache = new ConversationCache(runner, {
      hostBudgetBytes: parsed.hostKvBudgetBytes,
      store: this.options.kvStore ?? null,
    });
    this.persistDefault = parsed.persist;
    this.template = template;
    const meta = loaded.file.metadata['tokenizer.chat_template'];
    this.modelInfo = {
      name: loaded.config.name,
      architecture: loaded.config.architecture,
      layers: loaded.config.layers,
      vocab: loaded.config.vocab,
      contextLength: loaded.config.contextLength,
      contextCapacity: this.capacity(),
      kv: loaded.kv.mode,
      hasChatTemplate: typeof meta === 'string' && meta.trim().length > 0,
    };
    if (loaded.kv.calibrationNeeded && loaded.kv.digest) {
      this.startCalibration(
        runner,
        loaded.kv.digest,
        parsed.calibrationTokens ?? defaultCalibrationTokens(loaded.config),
      );
    }
    this.notify();
    return this.modelInfo;
  }

  async unload(): Promise<void> {
    this.abortNow();
    await this.enqueue(async () => {
      await this.stopCalibration();
      await this.cache?.releaseStore();
      this.unloadNow();
    });
    this.notify();
  }

  async abort(): Promise<void> {
    this.abortNow();
  }

  async deleteConversation(conversationId: string): Promise<void> {
    const id = validateId('conversation_id', conversationId);
    await this.enqueue(async () => {
      if (this.cache) await this.cache.delete(id);
      else await this.options.kvStore?.remove(await storedRecordName(id));
    });
    this.notify();
  }

  async storedKv(): Promise<StoredKvUsage | null> {
    const store = this.options.kvStore;
    if (!store) return null;
    const records = await store.records();
    return { records: records.length, bytes: records.reduce((sum, r) => sum + r.bytes, 0), where: store.where };
  }

  async clearStoredKv(): Promise<void> {
    const store = this.options.kvStore;
    if (!store) return;
    await this.enqueue(async () => {
      for (const record of await store.records()) await store.remove(record.name);
      this.cache?.forgetStored();
    });
    this.notify();
  }

  async stats(): Promise<EngineStats> {
    return this.snapshot();
  }

  async subscribeStats(listener: (stats: EngineStats) => void): Promise<() => void> {
    if (typeof listener !== 'function') throw new InvalidRequestError('subscribeStats needs a function.');
    this.listeners.add(listener);
    this.emit(listener, this.snapshot());
    return () => {
      this.listeners.delete(listener);
    };
  }

  /** Gives the device back (in-process use; the worker's device ends with the worker). */
  destroy(): void {
    this.abortNow();
    // Stops at its next step; GPU memory it still holds is released then (no submit follows a stop).
    this.calibration?.stop().catch(() => {});
    this.calibration = null;
    this.unloadNow();
    this.listeners.clear();
    if (this.gpuContext && typeof this.options.gpu !== 'object') this.gpuContext.destroy();
    this.gpuContext = null;
    this.modelRunner = null;
  }

  // ---------------------------------------------------------------------------------------------------------------

  private async createChat(
    request: ChatCompletionRequest,
  ): Promise<ChatCompletion | CompletionStream<ChatCompletionChunk>> {
    const r = validateChatRequest(request);
    const id = newId('chatcmpl');
    const created = Math.floor(Date.now() / 1000);
    const chunk = (
      delta: ChatCompletionChunk['choices'][0]['delta'],
      finish: FinishReason | null,
      usage?: CompletionUsage,
    ): ChatCompletionChunk => ({
      id,
      object: 'chat.completion.chunk',
      created,
      model: this.modelInfo?.name ?? '',
      choices: [{ index: 0, delta, finish_reason: finish, logprobs: null }],
      ...(usage ? { usage } : {}),
    });
    if (r.stream) {
      return this.streamed(
        (controller, push) => this.runChat(r, controller, (delta) => push(chunk(delta, null))),
        (stream) => stream.push(chunk({ role: 'assistant', content: '' }, null)),
        (outcome) => chunk({}, outcome.finishReason, outcome.usage),
      );
    }
    const outcome = await this.submit((controller) => this.runChat(r, controller, () => {}));
    const calls = outcome.toolCalls;
    return {
      id,
      object: 'chat.completion',
      created,
      model: this.modelInfo?.name ?? '',
      choices: [
        {
          index: 0,
          message: {
            role: 'assistant',
            content: calls.length > 0 && outcome.text.length === 0 ? null : outcome.text,
            ...(calls.length > 0 ? { tool_calls: calls } : {}),
          },
          finish_reason: outcome.finishReason,
          logprobs: null,
        },
      ],
      usage: outcome.usage,
    };
  }

  private async createCompletion(request: CompletionRequest): Promise<Completion | CompletionStream<Completion>> {
    const r = validateCompletionRequest(request);
    const id = newId('cmpl');
    const created = Math.floor(Date.now() / 1000);
    const completion = (text: string, finish: FinishReason | null, usage?: CompletionUsage): Completion => ({
      id,
      object: 'text_completion',
      created,
      model: this.modelInfo?.name ?? '',
      choices: [{ index: 0, text, finish_reason: finish, logprobs: null }],
      ...(usage ? { usage } : {}),
    });
    if (r.stream) {
      return this.streamed(
        (controller, push) => this.runText(r, controller, (text) => push(completion(text, null))),
        () => {},
        (outcome) => completion('', outcome.finishReason, outcome.usage),
      );
    }
    const outcome = await this.submit((controller) => this.runText(r, controller, () => {}));
    return completion(outcome.text, outcome.finishReason, outcome.usage);
  }

  /** Starts a queued request whose reply arrives as chunks (`run` pushes them); the stream is returned at once. */
  private streamed<T>(
    run: (controller: AbortController, push: (chunk: T) => void) => Promise<RunOutcome>,
    start: (stream: ChunkStream<T>) => void,
    finish: (outcome: RunOutcome) => T,
  ): CompletionStream<T> {
    let controller: AbortController | null = null;
    let abortedEarly = false;
    const stream = new ChunkStream<T>(() => {
      abortedEarly = true;
      controller?.abort();
    });
    start(stream);
    this.submit((c) => {
      controller = c;
      if (abortedEarly) c.abort();
      return run(c, (chunk) => stream.push(chunk));
    }).then(
      (outcome) => {
        stream.push(finish(outcome));
        stream.end();
      },
      (error) => stream.end(error),
    );
    return stream;
  }

  /** Queues `run` with its own AbortController, which engine.abort() also triggers. */
  private submit(run: (controller: AbortController) => Promise<RunOutcome>): Promise<RunOutcome> {
    const epoch = this.abortEpoch;
    return this.enqueue(async () => {
      const controller = new AbortController();
      if (epoch !== this.abortEpoch) controller.abort();
      this.current = controller;
      try {
        return await run(controller);
      } finally {
        this.current = null;
      }
    });
  }

  private enqueue<T>(work: () => Promise<T>): Promise<T> {
    this.waiting++;
    this.idleAt = null;
    const result = this.tail.then(async () => {
      this.waiting--;
      this.running = true;
      try {
        return await work();
      } finally {
        this.running = false;
        if (this.waiting === 0) this.becameIdle();
      }
    });
    this.tail = result.catch(() => {});
    return result;
  }

  private abortNow(): void {
    this.abortEpoch++;
    this.current?.abort();
  }

  private async runChat(
    r: ValidatedChatRequest,
    controller: AbortController,
    onDelta: (delta: ChatDelta) => void,
  ): Promise<RunOutcome> {
    const runner = this.requireRunner();
    const cache = this.cache!;
    const maxTokens = r.maxTokens ?? DEFAULT_MAX_TOKENS;
    const tools = this.toolPlan(r);
    const prompt = this.prepareChat(r, tools);
    // Aborted while it waited in the queue: nothing ran, nothing changed.
    if (controller.signal.aborted) return this.aborted(prompt.ids.length, prompt.droppedMessages);
    const entry = r.conversationId ? cache.conversation(r.conversationId) : cache.temporary();
    if (r.conversationId) await this.choosePersist(cache, entry, r.persist);
    // With tools, the reply's text goes through the reader, which takes the calls out of it.
    const reader = tools && new ToolCallReader(tools.format, r.tools, () => newId('call'));
    const content: string[] = [];
    const calls: ChatToolCall[] = [];
    const deliver = (reading: { content: string; calls: ChatToolCall[] }) => {
      if (reading.content.length > 0) {
        content.push(reading.content);
        onDelta({ content: reading.content });
      }
      for (const call of reading.calls) {
        onDelta({ tool_calls: [{ index: calls.length, ...call }] });
        calls.push(call);
      }
    };
    // A forced call is read once it is whole: its JSON is the reply, framed as the template writes calls.
    const frame = tools?.forced?.frame;
    const feed = reader && !frame ? (text: string) => deliver(reader.push(text)) : () => {};
    try {
      const systemPrefilled = await cache.attach(entry, prompt.systemIds);
      const outcome = await this.generate(runner, entry, prompt, {
        maxTokens,
        request: r,
        format: tools?.forced?.format ?? r.responseFormat,
        // A forced call is written on one line, as the chat templates write calls.
        ...(tools?.forced ? { formatOptions: { field: 'tools', oneLine: true } } : {}),
        signal: controller.signal,
        onText: reader ? feed : (text) => onDelta({ content: text }),
        systemPrefilled,
        startsText: true,
      });
      if (entry.persist) this.persistAfter(cache, entry);
      if (!reader) return outcome;
      if (frame) {
        // The call is whole when its JSON is (the grammar's end); cut short (max_tokens, a stop string, abort) the
        // reply is its text as written, without the frame.
        if (isWholeJson(outcome.text)) deliver(reader.push(frame.prefix + outcome.text + frame.suffix));
        else deliver({ content: outcome.text, calls: [] });
      }
      deliver(reader.flush());
      return {
        ...outcome,
        text: content.join(''),
        toolCalls: calls,
        // A reply cut short says so even where calls before the cut were read.
        finishReason: calls.length > 0 && outcome.finishReason === 'stop' ? 'tool_calls' : outcome.finishReason,
      };
    } catch (error) {
      // Whatever the sequence holds after a failure is not trusted: the next turn re-prefills.
      cache.evict(entry);
      throw error;
    } finally {
      if (entry.kind === 'temporary') cache.release(entry);
      this.notify();
    }
  }

  /**
   * A conversation's persist setting for this request: the request's, else the load option's. Persisting needs a KV
   * store; a request that stops it removes the stored copy.
   */
  private async choosePersist(cache: ConversationCache, entry: CachedSequence, requested: boolean | undefined) {
    const persist = requested ?? (entry.persist || this.persistDefault);
    if (persist && !cache.store) {
      throw new InvalidRequestError(
        'persist: this engine has no KV store to keep conversations in (createEngine() in a browser worker has OPFS; Node engines a directory).',
        { field: 'persist' },
      );
    }
    if (!persist) await cache.stopPersisting(entry);
    entry.persist = persist;
  }

  /**
   * Queues the write of a persisting conversation's changed pages to the KV store, after the request that changed
   * them (its reply is not held up by it) and before the next one.
   */
  private persistAfter(cache: ConversationCache, entry: CachedSequence): void {
    this.enqueue(async () => {
      // A load or unload since then: that cache and its pool are gone.
      if (this.cache !== cache || !this.modelRunner?.loaded) return;
      await cache.persistTurn(entry);
      this.notify();
    }).catch(() => {});
  }

  private async runText(
    r: ValidatedSampling & { prompt: string },
    controller: AbortController,
    onText: (text: string) => void,
  ): Promise<RunOutcome> {
    const runner = this.requireRunner();
    const cache = this.cache!;
    const maxTokens = r.maxTokens ?? DEFAULT_MAX_TOKENS;
    const least = Math.ceil(r.prompt.length / runner.tokenizer.maxTokenChars);
    if (least > this.capacity()) this.refuseAtLeast(least);
    const ids = runner.tokenizer.encode(r.prompt, { addSpecial: true });
    if (ids.length === 0) throw new InvalidRequestError('The prompt is empty and this model has no BOS token.');
    this.checkFits(ids.length);
    if (controller.signal.aborted) return this.aborted(ids.length, 0);
    const entry = cache.temporary();
    try {
      await cache.attach(entry, null);
      const prompt = { ids, systemIds: null, droppedMessages: 0 };
      return await this.generate(runner, entry, prompt, {
        maxTokens,
        request: r,
        format: r.responseFormat,
        signal: controller.signal,
        onText,
        systemPrefilled: 0,
        startsText: r.prompt.length === 0,
      });
    } finally {
      cache.release(entry);
      this.notify();
    }
  }

  /** Runs one prepared prompt in `entry`'s sequence, reusing the prefix it holds, and records what it holds after. */
  private async generate(
    runner: ModelRunner,
    entry: CachedSequence,
    prompt: PreparedPrompt,
    run: GenerationRun,
  ): Promise<RunOutcome> {
    // The format compiles first: an invalid schema or grammar fails the request before the cache is touched.
    const constraint = await this.constraintOf(runner, run.format, run.formatOptions);
    try {
      return await this.generateWith(runner, entry, prompt, run, constraint);
    } finally {
      constraint?.dispose();
    }
  }

  /** The constraint of a request's format (null for text), from the loaded model's compiler. */
  private async constraintOf(
    runner: ModelRunner,
    format: ResponseFormat,
    options: { field?: string; oneLine?: boolean } = {},
  ): Promise<TokenConstraint | null> {
    if (format.type === 'text') return null;
    const pending = (this.formats ??= ResponseFormatCompiler.create(
      runner.tokenizer.grammarVocabulary(runner.config.vocab),
    ));
    pending.catch(() => {
      if (this.formats === pending) this.formats = null;
    });
    return (await pending).constraint(format, options);
  }

  private async generateWith(
    runner: ModelRunner,
    entry: CachedSequence,
    prompt: PreparedPrompt,
    run: GenerationRun,
    constraint: TokenConstraint | null,
  ): Promise<RunOutcome> {
    const { request: r, onText, systemPrefilled, startsText } = run;
    const requestedMaxTokens = run.maxTokens;
    const cache = this.cache!;
    const ids = prompt.ids;
    const maxTokens = Math.max(0, Math.min(requestedMaxTokens, this.capacity() - ids.length + 1));
    const reuse = Math.min(commonPrefixLength(entry.ids, ids), ids.length - 1);
    cache.rewriting(entry, reuse);
    await cache.makeRoom([entry], entry.seq, reuse, ids.length + maxTokens);
    const decoder = runner.tokenizer.createStreamDecoder({ skipSpecial: true });
    const stops = new StopStringMatcher(r.stop);
    let text = '';
    let statsAt: number | null = null;
    const emit = (piece: string) => {
      if (piece.length === 0) return;
      text += piece;
      onText(piece);
    };
    const result: GenerateResult = await runner.generateInSequence(entry.seq!, {
      promptIds: ids,
      reuseTokens: reuse,
      maxTokens,
      sampling: resolveSamplingParams(r.sampling),
      signal: run.signal,
      ...(constraint ? { constraint } : {}),
      onToken: (id) => {
        let piece = decoder.push(id);
        // SentencePiece's dummy-prefix space on the first word of a text is not part of the reply (as in decode()).
        if (
          startsText &&
          text.length === 0 &&
          piece.startsWith(' ') &&
          runner.tokenizer.decode([id]) === piece.slice(1)
        )
          piece = piece.slice(1);
        const out = stops.push(piece);
        emit(out.text);
        const now = performance.now();
        if (statsAt === null || now - statsAt >= STATS_EVERY_MS) {
          statsAt = now;
          this.notify();
        }
        return out.stop !== undefined ? false : undefined;
      },
    });
    if (!stops.isStopped) emit(stops.push(decoder.flush()).text + stops.flush());
    cache.record(entry, [...ids, ...result.ids]);
    const u = result.usage;
    const cached = Math.max(0, u.cachedTokens - systemPrefilled);
    return {
      text,
      toolCalls: [],
      finishReason: result.finishReason,
      usage: {
        prompt_tokens: u.promptTokens,
        completion_tokens: u.completionTokens,
        total_tokens: u.promptTokens + u.completionTokens,
        prompt_tokens_details: { cached_tokens: cached },
        longtab: {
          prefill_tokens: u.promptTokens - cached,
          prefill_tokens_per_second: u.prefillTokensPerSecond,
          decode_tokens_per_second: u.decodeTokensPerSecond,
          ttft_ms: u.ttftMs,
          tpot_ms: u.tpotMs,
          dropped_messages: prompt.droppedMessages,
          kv_from: entry.kind === 'conversation' ? entry.resumed.from : 'none',
          ...(entry.resumed.note ? { kv_note: entry.resumed.note } : {}),
        },
      },
    };
  }

  private aborted(promptTokens: number, droppedMessages: number): RunOutcome {
    return {
      text: '',
      toolCalls: [],
      finishReason: 'abort',
      usage: {
        prompt_tokens: promptTokens,
        completion_tokens: 0,
        total_tokens: promptTokens,
        prompt_tokens_details: { cached_tokens: 0 },
        longtab: {
          prefill_tokens: 0,
          prefill_tokens_per_second: 0,
          decode_tokens_per_second: 0,
          ttft_ms: 0,
          tpot_ms: 0,
          dropped_messages: droppedMessages,
          kv_from: 'none',
        },
      },
    };
  }

  /**
   * Renders and tokenizes the conversation. When it does not fit one sequence: ContextOverflowError, or with
   * 'drop_oldest_turns' the oldest non-system messages go first (the last message always stays). Costs stay linear in
   * the conversation: what cannot fit by its user messages' length alone is refused (or dropped) before anything is
   * tokenized, and the number of turns to drop is found by bisection, a few renders rather than one per dropped turn.
   */
  private prepareChat(r: ValidatedChatRequest, tools: ToolPlan | null): PreparedPrompt {
    const capacity = this.capacity();
    const variables = r.tools.length > 0 ? { tools: r.tools } : undefined;
    const replyPrefix = tools?.forced?.frame.prefix;
    const all = r.messages;
    // Dropping k turns removes the first k non-system messages; the last message always stays.
    const droppable = all.flatMap((m, i) => (m.role !== 'system' && i < all.length - 1 ? [i] : []));
    const withoutOldest = (k: number) => {
      const dropped = new Set(droppable.slice(0, k));
      return all.filter((_, i) => !dropped.has(i));
    };
    const encode = (messages: ChatMessage[]) =>
      this.encodeChat(messages, r.specialTokensInContent, { addGenerationPrompt: true, variables, replyPrefix });
    const prepared = (messages: ChatMessage[], ids: number[], dropped: number): PreparedPrompt => {
      const system = messages[0]?.role === 'system' && messages.length > 1 ? [messages[0]] : null;
      return {
        ids,
        systemIds: system ? this.systemPrefix(system, ids, r.specialTokensInContent, variables) : null,
        droppedMessages: dropped,
      };
    };

    // Lower bounds of each message's tokens from its length (user messages: templates write them whole).
    const perToken = this.requireRunner().tokenizer.maxTokenChars;
    const least = all.map((m) => (m.role === 'user' ? Math.ceil(m.content.length / perToken) : 0));
    let bound = least.reduce((sum, n) => sum + n, 0);
    const overflow = r.overflow === 'error' ? 0 : droppable.length;
    let first = 0;
    while (bound > capacity && first < overflow) bound -= least[droppable[first++]!]!;
    if (bound > capacity) this.refuseAtLeast(bound);

    // Dropping turns stops one token short of the capacity: ModelRunner.run reserves the prompt plus one position, so a
    // prompt of exactly `capacity` tokens would fail there.
    const fits = (ids: number[], k: number) => ids.length < capacity || (ids.length === capacity && k === overflow);
    let messages = withoutOldest(first);
    let ids = encode(messages);
    if (r.overflow === 'error' || fits(ids, first)) {
      this.checkFits(ids.length);
      return prepared(messages, ids, first);
    }
    const lastMessages = withoutOldest(overflow);
    const lastIds = encode(lastMessages);
    if (!fits(lastIds, overflow)) this.checkFits(lastIds.length);
    // fits(first) is false and fits(overflow) true: bisect for the fewest turns to drop (more turns, fewer tokens).
    let lo = first;
    let hi = overflow;
    messages = lastMessages;
    ids = lastIds;
    while (hi - lo > 1) {
      const mid = (lo + hi) >>> 1;
      const midMessages = withoutOldest(mid);
      const midIds = encode(midMessages);
      if (fits(midIds, mid)) {
        hi = mid;
        messages = midMessages;
        ids = midIds;
      } else {
        lo = mid;
      }
    }
    return prepared(messages, ids, hi);
  }

  /** A prompt whose length alone shows it cannot fit: refused before it is rendered or tokenized. */
  private refuseAtLeast(tokens: number): never {
    const capacity = this.capacity();
    throw new ContextOverflowError(tokens, capacity, this.requireRunner().pool.limitAt(capacity), { atLeast: true });
  }

  private encodeChat(
    messages: ChatMessage[],
    specialTokensInContent: SpecialTokensInContent,
    options: { addGenerationPrompt: boolean; variables?: Record<string, unknown>; replyPrefix?: string },
  ): number[] {
    const tokenizer = this.requireRunner().tokenizer;
    return encodeConversation(tokenizer, this.template, messages, { ...options, specialTokensInContent });
  }

  /**
   * The system message rendered alone, for conversations to share its KV: where it is the prefix of the whole
   * conversation's ids. A template may not render it alone (Llama 3.1's puts the tools into the first user message,
   * and refuses a conversation without one), or render it otherwise: then nothing is shared (null).
   */
  private systemPrefix(
    system: ChatMessage[],
    ids: readonly number[],
    specialTokensInContent: SpecialTokensInContent,
    variables: Record<string, unknown> | undefined,
  ): number[] | null {
    let prefix: number[];
    try {
      prefix = this.encodeChat(system, specialTokensInContent, { addGenerationPrompt: false, variables });
    } catch (error) {
      if (error instanceof InvalidRequestError) return null;
      throw error;
    }
    return commonPrefixLength(prefix, ids) === prefix.length ? prefix : null;
  }

  /**
   * A request's tools as the loaded model's template writes calls (null where the reply is text: no tools, or
   * tool_choice 'none'). A template with no tool format cannot call tools: InvalidRequestError.
   */
  private toolPlan(r: ValidatedChatRequest): ToolPlan | null {
    if (r.tools.length === 0 || r.toolChoice === 'none') return null;
    const format = toolFormatOf(this.template);
    if (!format) {
      throw new InvalidRequestError(
        "This model's chat template has no tool-call format, so it cannot call tools: use a model whose template has one (Qwen2.5, Qwen3, Llama 3.1 and later, SmolLM3), or describe the functions in the messages yourself.",
        { field: 'tools' },
      );
    }
    const choice = r.toolChoice;
    if (choice === 'auto') return { format, forced: null };
    const schema = forcedCallSchema(format, r.tools, choice);
    return {
      format,
      forced: {
        frame: forcedCallFrame(format),
        format: { type: 'json_schema', json_schema: { name: 'tool_call', schema, strict: true } },
      },
    };
  }

  private checkFits(promptTokens: number): void {
    const capacity = this.capacity();
    if (promptTokens > capacity) {
      throw new ContextOverflowError(promptTokens, capacity, this.requireRunner().pool.limitAt(capacity));
    }
  }

  /** Tokens one sequence can hold. */
  private capacity(): number {
    const pool = this.requireRunner().pool;
    return pool.maxPagesPerSequence * pool.pageTokens;
  }

  private async openSource(
    source: ModelSource,
    onProgress: (p: LoadProgress) => void,
    timeouts: RemoteTimeouts,
    signal: AbortSignal,
  ): Promise<ByteSource> {
    if (typeof Blob !== 'undefined' && source instanceof Blob) return sourceFromBlob(source);
    if (typeof source !== 'string' && !(source instanceof URL)) {
      throw new InvalidRequestError('load(source): pass an http(s) URL, a File or a Blob (or, in Node, a file path).');
    }
    const text = source.toString();
    const url = this.parseUrl(text);
    if (!url) {
      if (!this.options.openPath) {
        throw new InvalidRequestError(`'${text}' is not an http(s) URL; file paths can only be loaded in Node.`);
      }
      return this.options.openPath(text);
    }
    if (url.protocol !== 'http:' && url.protocol !== 'https:') {
      throw new InvalidRequestError(`Models load over http(s) only; '${url.protocol}' URLs are not accepted.`, {
        protocol: url.protocol,
      });
    }
    onProgress({ phase: 'download', bytesDone: 0, bytesTotal: 0 });
    const bytes = await sourceFromUrl(url.href, {
      signal,
      headersTimeoutMs: timeouts.headersTimeoutMs,
      chunkTimeoutMs: timeouts.chunkTimeoutMs,
    });
    onProgress({ phase: 'download', bytesDone: 0, bytesTotal: bytes.size });
    return bytes;
  }

  /** Absolute URLs anywhere; relative ones only where there is a location to resolve them (page, worker). */
  private parseUrl(text: string): URL | null {
    if (/^[a-zA-Z][a-zA-Z0-9+.-]*:\/\//.test(text) || /^(blob|data|javascript|file):/i.test(text)) {
      try {
        return new URL(text);
      } catch {
        throw new InvalidRequestError(`'${text}' is not a valid URL.`);
      }
    }
    const base = (globalThis as { location?: { href: string } }).location?.href;
    if (base && !this.options.openPath) return new URL(text, base);
    return null;
  }

  private async gpu(): Promise<GpuContext> {
    if (this.gpuContext) return this.gpuContext;
    const option = this.options.gpu;
    this.gpuContext =
      option === undefined ? await acquireGpu() : typeof option === 'function' ? await option() : option;
    return this.gpuContext;
  }

  private becameIdle(): void {
    this.idleAt = performance.now();
    const waiters = this.idleWaiters;
    this.idleWaiters = [];
    for (const wake of waiters) wake();
  }

  /**
   * Calibrates the KV rotations in the background (runtime/engine/background-calibration.ts): between requests,
   * then switches at a safe point in the queue. Conversations cached until then lose their KV (written with the
   * Hadamard rotation) and are re-prefilled on their next turn; a request already queued runs before the switch.
   */
  private startCalibration(runner: ModelRunner, digest: string, tokens: number): void {
    const loaded = runner.loaded;
    const calibration: BackgroundCalibration = new BackgroundCalibration({
      runner,
      digest,
      tokens,
      cache: this.options.rotationCache,
      idleSince: () => this.idleAt,
      whenIdle: () => new Promise<void>((resolve) => this.idleWaiters.push(resolve)),
      apply: (rotations: StoredRotations) =>
        this.enqueue(async () => {
          // A load, unload or destroy since then: that model (and this calibration) is gone.
          if (this.calibration !== calibration || runner.loaded !== loaded || !this.cache) return false;
          await runner.switchToCalibratedRotations(rotations);
          const evictions = this.cache.evictions;
          this.cache.clear();
          this.cache.evictions = evictions;
          return true;
        }),
      onStatus: () => this.notify(),
    });
    this.calibration = calibration;
    calibration.start();
  }

  private async stopCalibration(): Promise<void> {
    const calibration = this.calibration;
    this.calibration = null;
    await calibration?.stop();
  }

  private rotationState(): KvRotationState {
    const loaded = this.modelRunner?.loaded;
    const calibration = this.calibration?.status;
    if (
      calibration &&
      calibration.phase !== 'done' &&
      calibration.phase !== 'failed' &&
      calibration.phase !== 'stopped'
    )
      return `calibrating ${Math.floor(calibration.progress * 100)}%`;
    return loaded?.kv.rotation.kind ?? 'none';
  }

  private unloadNow(): void {
    this.formats?.then((f) => f.dispose()).catch(() => undefined);
    this.formats = null;
    this.cache?.clear();
    this.cache = null;
    this.modelRunner?.unload();
    this.modelInfo = null;
    this.template = '';
  }

  private requireRunner(): ModelRunner {
    if (!this.modelRunner?.loaded || !this.cache) throw new ModelNotLoadedError();
    return this.modelRunner;
  }

  private snapshot(): EngineStats {
    const gpu = this.gpuContext;
    const memory = gpu?.allocator.snapshot();
    const loaded = this.modelRunner?.loaded ?? null;
    const pool = loaded?.pool.stats();
    const config = loaded?.config;
    const f16BytesPerToken = config ? 2 * config.layers * config.kvHeads * config.headDim * 2 : 0;
    const kvBytes = memory?.bytes.kv ?? 0;
    const capacity = loaded ? loaded.pool.maxPagesPerSequence * loaded.pool.pageTokens : 0;
    return {
      model: this.modelInfo,
      memory: {
        weights: memory?.bytes.weights ?? 0,
        kvUsed: pool?.bytesUsed ?? 0,
        kvReserved: pool?.bytesReserved ?? 0,
        kvTotal: kvBytes,
        kvF16Equivalent: (pool?.tokensHeld ?? 0) * f16BytesPerToken,
        scratch: memory?.bytes.scratch ?? 0,
        staging: memory?.bytes.staging ?? 0,
        total: memory?.totalBytes ?? 0,
        peak: memory?.peakBytes ?? 0,
      },
      kv: {
        mode: this.modelInfo?.kv ?? 'f16',
        rotation: this.rotationState(),
        calibration: this.calibration ? { ...this.calibration.status } : null,
        clip: loaded?.pool.quant
          ? { key: loaded.pool.quant.key.clipQuantile, value: loaded.pool.quant.value.clipQuantile }
          : null,
        boostLayers: [...(loaded?.pool.quant?.boostLayers ?? [])],
        plan: loaded ? planStats(loaded.pool, loaded.kv.options) : null,
        holds: {
          tokens: capacity,
          f16Tokens: loaded ? f16TokensInBudget(loaded.pool, loaded.kv.options, f16BytesPerToken) : 0,
        },
        pageTokens: pool?.pageTokens ?? 0,
        pageBytes: pool?.pageBytes ?? 0,
        pagesUsed: pool?.pagesUsed ?? 0,
        pagesFree: pool?.pagesFree ?? 0,
        pagesReserved: pool?.pagesReserved ?? 0,
        pagesBudget: pool?.pagesBudget ?? 0,
        sequences: pool?.sequences ?? 0,
      },
      context: {
        used: pool?.tokensHeld ?? 0,
        capacity,
        conversations: this.cache?.size ?? 0,
        evictions: this.cache?.evictions ?? 0,
      },
      host: {
        conversations: this.cache?.savedCount ?? 0,
        bytes: this.cache?.hostBytes ?? 0,
        budgetBytes: this.cache?.hostBudgetBytes ?? 0,
        saves: this.cache?.saves ?? 0,
        restores: this.cache?.restores ?? 0,
      },
      stored: this.cache?.store
        ? {
            conversations: this.cache.storedCount,
            bytes: this.cache.storedBytes,
            ...this.cache.storedCounts,
          }
        : null,
      queue: { running: this.running, waiting: this.waiting },
      adapter: gpu
        ? {
            ...gpu.adapter,
            features: { ...gpu.features },
            maxBufferSize: gpu.limits.maxBufferSize,
            maxStorageBufferBindingSize: gpu.limits.maxStorageBufferBindingSize,
          }
        : null,
    };
  }

  private notify(): void {
    if (this.listeners.size === 0) return;
    const stats = this.snapshot();
    for (const listener of this.listeners) this.emit(listener, stats);
  }

  private emit(listener: (stats: EngineStats) => void, stats: EngineStats): void {
    try {
      // A listener across the worker returns a promise; a failing one must not break generation.
      const result = listener(stats) as unknown;
      if (result instanceof Promise) result.catch(() => this.listeners.delete(listener));
    } catch {
      this.listeners.delete(listener);
    }
  }
}
