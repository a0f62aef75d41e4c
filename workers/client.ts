/**
 * `createEngine()`: the engine in a dedicated module worker, used through the same `LongtabEngineApi` as the
 * in-process LongtabEngine. Callbacks (load progress, stats) cross as Comlink proxies. Streams are pull-based: each
 * `for await` step is one `next` call to the worker, which buffers the chunks generated meanwhile. Errors thrown in
 * the worker are rebuilt here as the LongtabError subclass their code names, with the worker's message and details.
 */
import { proxy, type Remote, wrap } from 'comlink';
import type {
  ChatCompletion,
  ChatCompletionChunk,
  ChatCompletionRequest,
  Completion,
  CompletionRequest,
  CompletionStream,
  EngineLoadOptions,
  EngineStats,
  LongtabEngineApi,
  ModelInfo,
  ModelSource,
  StoredKvUsage,
} from '../runtime/engine/api-types.ts';
import { fromWireError, isWireError } from '../runtime/engine/wire-errors.ts';
import {
  DEBUG_WORKER_NAME,
  type EngineWorkerApi,
  type StreamHandle,
  WORKER_NAME,
  type WorkerDebugAction,
} from './protocol.ts';

export interface CreateEngineOptions {
  /** A worker you started yourself (e.g. from your bundler's worker import); by default one is started here. */
  worker?: Worker;
  /**
   * Starts the worker in debug mode, which accepts `debug()` calls (fault injection for tests, e.g. destroying its
   * GPU device). Never in production: an ordinary worker rejects them at its message check. Ignored with `worker`
   * (a worker you start is a debug one when its name is 'longtab-engine-debug').
   */
  debug?: boolean;
}

export interface EngineClient extends LongtabEngineApi {
  readonly worker: Worker;
  /** Stops the worker (and with it the GPU device and everything loaded). */
  terminate(): void;
  /** Fault injection, accepted only by a worker started with `debug: true` (InvalidRequestError otherwise). */
  debug(action: WorkerDebugAction): Promise<void>;
}

/** Rejects once the worker fails to start or crashes (comlink alone would leave every pending call hanging). */
const workerFailures = new WeakMap<Worker, Promise<never>>();

function watchWorker(worker: Worker): void {
  const failed = new Promise<never>((_, reject) => {
    worker.addEventListener('error', (event) => {
      event.preventDefault();
      reject(
        Object.assign(
          new Error(
            `The engine worker failed${event.message ? `: ${event.message}` : ' to start (its script could not be loaded)'}. Check that longtab's assets are served next to longtab.js, then create a new engine.`,
          ),
          { name: 'EngineWorkerError' },
        ),
      );
    });
  });
  failed.catch(() => {});
  workerFailures.set(worker, failed);
}

async function call<T>(promise: Promise<T>, worker?: Worker): Promise<T> {
  try {
    const failed = worker ? workerFailures.get(worker) : undefined;
    return await (failed ? Promise.race([promise, failed]) : promise);
  } catch (error) {
    throw isWireError(error) ? fromWireError(error) : error;
  }
}

function isStream(value: unknown): value is StreamHandle {
  return typeof value === 'object' && value !== null && (value as StreamHandle).object === 'longtab.stream';
}

class RemoteStream<T> implements CompletionStream<T> {
  private readonly remote: Remote<EngineWorkerApi>;
  private readonly worker: Worker;
  private readonly id: number;
  private finished = false;

  constructor(remote: Remote<EngineWorkerApi>, worker: Worker, id: number) {
    this.remote = remote;
    this.worker = worker;
    this.id = id;
  }

  abort(): void {
    if (!this.finished) call(this.remote.abortStream(this.id)).catch(() => {});
  }

  [Symbol.asyncIterator](): AsyncIterator<T> {
    return {
      next: async () => {
        if (this.finished) return { done: true, value: undefined };
        const result = (await call(
          this.remote.next(this.id) as Promise<IteratorResult<unknown>>,
          this.worker,
        )) as IteratorResult<T>;
        if (result.done) this.finished = true;
        return result;
      },
      return: async () => {
        if (!this.finished) {
          this.finished = true;
          await call(this.remote.closeStream(this.id));
        }
        return { done: true, value: undefined };
      },
    };
  }
}

class EngineWorkerClient implements EngineClient {
  readonly worker: Worker;
  readonly chat: LongtabEngineApi['chat'];
  readonly completions: LongtabEngineApi['completions'];
  private readonly remote: Remote<EngineWorkerApi>;

  constructor(worker: Worker) {
    this.worker = worker;
    watchWorker(worker);
    this.remote = wrap<EngineWorkerApi>(worker);
    this.chat = {
      completions: {
        create: (async (request: ChatCompletionRequest) => {
          const result = await call(this.remote.chat(request) as Promise<ChatCompletion | StreamHandle>, this.worker);
          return isStream(result)
            ? new RemoteStream<ChatCompletionChunk>(this.remote, this.worker, result.stream)
            : (result as ChatCompletion);
        }) as never,
      },
    };
    this.completions = {
      create: (async (request: CompletionRequest) => {
        const result = await call(this.remote.completion(request) as Promise<Completion | StreamHandle>, this.worker);
        return isStream(result)
          ? new RemoteStream<Completion>(this.remote, this.worker, result.stream)
          : (result as Completion);
      }) as never,
    };
  }

  load(source: ModelSource, options: EngineLoadOptions = {}): Promise<ModelInfo> {
    const { onProgress, ...rest } = options;
    const src = resolveModelSource(source, pageBase());
    return call(this.remote.load(src, rest, onProgress ? proxy(onProgress) : undefined), this.worker);
  }

  stats(): Promise<EngineStats> {
    return call(this.remote.stats(), this.worker);
  }

  async subscribeStats(listener: (stats: EngineStats) => void): Promise<() => void> {
    const id = await call(this.remote.subscribeStats(proxy(listener)), this.worker);
    return () => {
      call(this.remote.unsubscribeStats(id)).catch(() => {});
    };
  }

  deleteConversation(conversationId: string): Promise<void> {
    return call(this.remote.deleteConversation(conversationId), this.worker);
  }

  storedKv(): Promise<StoredKvUsage | null> {
    return call(this.remote.storedKv(), this.worker);
  }

  clearStoredKv(): Promise<void> {
    return call(this.remote.clearStoredKv(), this.worker);
  }

  abort(): Promise<void> {
    return call(this.remote.abort(), this.worker);
  }

  unload(): Promise<void> {
    return call(this.remote.unload(), this.worker);
  }

  terminate(): void {
    this.worker.terminate();
  }

  debug(action: WorkerDebugAction): Promise<void> {
    return call(this.remote.debug(action), this.worker);
  }
}

/** Starts the engine worker and returns its client. */
export function createEngine(options: CreateEngineOptions = {}): EngineClient {
  const worker =
    options.worker ??
    new Worker(new URL('./engine.worker.ts', import.meta.url), {
      type: 'module',
      name: options.debug ? DEBUG_WORKER_NAME : WORKER_NAME,
    });
  return new EngineWorkerClient(worker);
}

/** The page's base URL (where a relative model URL is meant from), or null outside a page. */
function pageBase(): string | null {
  const g = globalThis as { document?: { baseURI?: string }; location?: { href?: string } };
  return g.document?.baseURI ?? g.location?.href ?? null;
}

/**
 * A model source as the worker must see it: a URL object or a relative URL string becomes absolute against the
 * page's base (the worker would otherwise resolve it against its own script); absolute URLs and Blobs pass as they
 * are, and the worker validates the scheme.
 */
export function resolveModelSource(source: ModelSource, base: string | null): string | Blob {
  if (source instanceof URL) return source.href;
  if (typeof source !== 'string' || base === null) return source;
  try {
    return new URL(source, base).href;
  } catch {
    return source;
  }
}
