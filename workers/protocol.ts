/**
 * The engine worker's message surface: the flat method list comlink calls, and the check every incoming message
 * passes before comlink sees it (only calls of these methods, with plain values or callback proxies as arguments).
 */
import type { Endpoint } from 'comlink';
import { InvalidRequestError } from '../core/errors.ts';
import type {
  ChatCompletion,
  ChatCompletionChunk,
  ChatCompletionRequest,
  Completion,
  CompletionRequest,
  EngineLoadOptions,
  EngineStats,
  LoadProgress,
  ModelInfo,
  StoredKvUsage,
} from '../runtime/engine/api-types.ts';
import { toWireError } from '../runtime/engine/wire-errors.ts';

/** A stream stays in the worker; the client pulls its chunks one `next` call at a time. */
export interface StreamHandle {
  object: 'longtab.stream';
  stream: number;
}

export type WorkerLoadSource = string | Blob;

/**
 * Fault injection for tests. Honoured only by a worker started with `createEngine({ debug: true })` (its name is
 * DEBUG_WORKER_NAME, fixed at creation): any other worker rejects the call at the message check.
 * 'destroyDevice' calls GPUDevice.destroy() on the engine's device, as a driver reset would lose it.
 */
export type WorkerDebugAction = 'destroyDevice';
export const DEBUG_ACTIONS: readonly WorkerDebugAction[] = ['destroyDevice'];
export const WORKER_NAME = 'longtab-engine';
export const DEBUG_WORKER_NAME = 'longtab-engine-debug';

export interface WorkerCheckOptions {
  /** Whether `debug` calls are accepted (the worker was started in debug mode). */
  debug?: boolean;
}

/** What the worker exposes. Every method validates its arguments; errors arrive as WireError objects. */
export interface EngineWorkerApi {
  load(
    source: WorkerLoadSource,
    options: Omit<EngineLoadOptions, 'onProgress'> | undefined,
    onProgress: ((progress: LoadProgress) => void) | undefined,
  ): Promise<ModelInfo>;
  chat(request: ChatCompletionRequest): Promise<ChatCompletion | StreamHandle>;
  completion(request: CompletionRequest): Promise<Completion | StreamHandle>;
  next(stream: number): Promise<IteratorResult<ChatCompletionChunk | Completion, undefined>>;
  /** Aborts the stream's request; its remaining chunks (ending with finish_reason 'abort') can still be read. */
  abortStream(stream: number): Promise<void>;
  /** The reader is gone: abort and forget the stream. */
  closeStream(stream: number): Promise<void>;
  stats(): Promise<EngineStats>;
  subscribeStats(listener: (stats: EngineStats) => void): Promise<number>;
  unsubscribeStats(subscription: number): Promise<void>;
  deleteConversation(conversationId: string): Promise<void>;
  storedKv(): Promise<StoredKvUsage | null>;
  clearStoredKv(): Promise<void>;
  abort(): Promise<void>;
  unload(): Promise<void>;
  /** Only in a debug worker (see WorkerDebugAction). */
  debug(action: WorkerDebugAction): Promise<void>;
}

/** Each method's most arguments, and which of them may be a callback (a Comlink.proxy). */
const SIGNATURES: Record<keyof EngineWorkerApi, { args: number; callbacks: number[] }> = {
  load: { args: 3, callbacks: [2] },
  chat: { args: 1, callbacks: [] },
  completion: { args: 1, callbacks: [] },
  next: { args: 1, callbacks: [] },
  abortStream: { args: 1, callbacks: [] },
  closeStream: { args: 1, callbacks: [] },
  stats: { args: 0, callbacks: [] },
  subscribeStats: { args: 1, callbacks: [0] },
  unsubscribeStats: { args: 1, callbacks: [] },
  deleteConversation: { args: 1, callbacks: [] },
  storedKv: { args: 0, callbacks: [] },
  clearStoredKv: { args: 0, callbacks: [] },
  abort: { args: 0, callbacks: [] },
  unload: { args: 0, callbacks: [] },
  debug: { args: 1, callbacks: [] },
};

export const WORKER_METHODS = Object.keys(SIGNATURES) as (keyof EngineWorkerApi)[];

/** Why a message is not a call this worker accepts, or null when it is. */
export function checkWorkerMessage(data: unknown, options: WorkerCheckOptions = {}): string | null {
  if (typeof data !== 'object' || data === null) return 'not an object';
  const m = data as Record<string, unknown>;
  if (typeof m.id !== 'string' || m.id.length === 0 || m.id.length > 128) return 'no valid message id';
  if (m.type === 'RELEASE') return Array.isArray(m.path) && m.path.length === 0 ? null : 'RELEASE of a member';
  if (m.type !== 'APPLY') return `message type ${String(m.type)} is not accepted (only method calls)`;
  const method = Array.isArray(m.path) && m.path.length === 1 ? m.path[0] : undefined;
  if (typeof method !== 'string' || !Object.hasOwn(SIGNATURES, method))
    return `unknown method ${JSON.stringify(m.path)}`;
  const signature = SIGNATURES[method as keyof EngineWorkerApi];
  const args = m.argumentList;
  if (!Array.isArray(args) || args.length > signature.args)
    return `${method} takes at most ${signature.args} argument(s)`;
  for (let i = 0; i < args.length; i++) {
    const wire = args[i] as Record<string, unknown> | null;
    if (typeof wire !== 'object' || wire === null) return `${method}: malformed argument ${i}`;
    if (wire.type === 'RAW') continue;
    const isCallback = wire.type === 'HANDLER' && wire.name === 'proxy' && wire.value instanceof MessagePort;
    if (isCallback && signature.callbacks.includes(i)) continue;
    return `${method}: argument ${i} must be a plain value${signature.callbacks.includes(i) ? ' or a Comlink.proxy callback' : ''}`;
  }
  if (method === 'debug') {
    if (!options.debug) return 'debug calls are not accepted (this worker was not started with debug: true)';
    const action = (args[0] as { value?: unknown } | undefined)?.value;
    if (!DEBUG_ACTIONS.includes(action as WorkerDebugAction)) return `unknown debug action ${JSON.stringify(action)}`;
  }
  return null;
}

/**
 * Wraps the worker's global scope so comlink only receives messages that pass `checkWorkerMessage`. A rejected
 * message with an id is answered with an InvalidRequestError (as comlink answers a throw); one without is dropped.
 */
export function guardedEndpoint(scope: Endpoint, options: WorkerCheckOptions = {}): Endpoint {
  const wrapped = new Map<EventListenerOrEventListenerObject, EventListener>();
  return {
    postMessage: (message, transfer) => scope.postMessage(message, transfer),
    addEventListener(type, listener) {
      const guard: EventListener = (event) => {
        const data = (event as MessageEvent).data;
        const problem = checkWorkerMessage(data, options);
        if (problem === null) {
          if (typeof listener === 'function') listener(event);
          else listener.handleEvent(event);
          return;
        }
        const id = (data as { id?: unknown } | null)?.id;
        if (typeof id !== 'string') return;
        const error = toWireError(new InvalidRequestError(`The engine worker rejected a message: ${problem}.`));
        scope.postMessage({ id, type: 'HANDLER', name: 'throw', value: { isError: false, value: error } });
      };
      wrapped.set(listener, guard);
      scope.addEventListener(type, guard);
    },
    removeEventListener(type, listener) {
      const guard = wrapped.get(listener);
      if (guard) scope.removeEventListener(type, guard);
      wrapped.delete(listener);
    },
  };
}
