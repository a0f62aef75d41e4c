/**
 * The engine worker: one LongtabEngine (one model on this worker's GPU device) behind comlink. Every message is
 * checked by `guardedEndpoint` and every method validates its arguments; errors leave as WireErrors, which the client
 * turns back into the LongtabError subclass their code names.
 */

import { type Endpoint, expose } from 'comlink';
import { InvalidRequestError } from '../core/errors.ts';
import { acquireGpu, type GpuContext } from '../core/gpu/device.ts';
import { LongtabEngine } from '../runtime/engine/api.ts';
import type {
  ChatCompletionChunk,
  Completion,
  CompletionStream,
  EngineStats,
  LoadProgress,
} from '../runtime/engine/api-types.ts';
import { opfsKvFileStore } from '../runtime/engine/kv-file-store-opfs.ts';
import { isPlainObject } from '../runtime/engine/validate.ts';
import { toWireError } from '../runtime/engine/wire-errors.ts';
import { indexedDbRotationCache } from '../runtime/kv/rotation-cache-idb.ts';
import {
  DEBUG_ACTIONS,
  DEBUG_WORKER_NAME,
  type EngineWorkerApi,
  guardedEndpoint,
  type StreamHandle,
} from './protocol.ts';

/** Debug calls (fault injection for tests) only in a worker started as such: its name is fixed at creation. */
const debug = (self as unknown as { name?: string }).name === DEBUG_WORKER_NAME;
/** The engine's device, kept only in a debug worker (for `debug('destroyDevice')`). */
let debugGpu: GpuContext | null = null;

// Calibrated KV rotations (and the background calibration's results, load option `calibrate`) live in IndexedDB:
// the next worker of this origin finds them under the model's digest and does not calibrate again. Conversations'
// KV below host memory, and what persists across reloads, lives in OPFS where the browser has it.
const engine = new LongtabEngine({
  rotationCache: indexedDbRotationCache(),
  ...(typeof navigator.storage?.getDirectory === 'function' ? { kvStore: opfsKvFileStore() } : {}),
  ...(debug ? { gpu: async () => (debugGpu = await acquireGpu()) } : {}),
});
const streams = new Map<
  number,
  {
    stream: CompletionStream<ChatCompletionChunk | Completion>;
    iterator: AsyncIterator<ChatCompletionChunk | Completion>;
  }
>();
const subscriptions = new Map<number, () => void>();
let nextHandle = 1;

function integer(name: string, value: unknown): number {
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < 1) {
    throw new InvalidRequestError(`${name} must be a positive integer handle, got ${String(value)}.`);
  }
  return value;
}

function keep(stream: CompletionStream<ChatCompletionChunk | Completion>): StreamHandle {
  const id = nextHandle++;
  streams.set(id, { stream, iterator: stream[Symbol.asyncIterator]() });
  return { object: 'longtab.stream', stream: id };
}

function stream(id: unknown) {
  const entry = streams.get(integer('stream', id));
  if (!entry) throw new InvalidRequestError(`Stream ${String(id)} does not exist (finished or closed).`);
  return entry;
}

const api: EngineWorkerApi = {
  async load(source, options, onProgress) {
    if (typeof source !== 'string' && !(source instanceof Blob)) {
      throw new InvalidRequestError('load(source): pass an http(s) URL string, a File or a Blob.');
    }
    if (onProgress !== undefined && typeof onProgress !== 'function') {
      throw new InvalidRequestError('load: onProgress must be a callback (Comlink.proxy).');
    }
    // The options are checked once, by engine.load (parseLoadOptions); here only the callback, which crosses as its
    // own argument, joins them. Progress calls are messages on their own port: wait for the last one so none lands
    // after load resolves.
    let delivered: unknown = Promise.resolve();
    const progress = onProgress && ((p: LoadProgress) => (delivered = onProgress(p)));
    const info = await engine.load(
      source,
      progress && (options === undefined || isPlainObject(options)) ? { ...options, onProgress: progress } : options,
    );
    await delivered;
    return info;
  },
  async chat(request) {
    const result = await engine.chat.completions.create(request);
    return Symbol.asyncIterator in result ? keep(result) : result;
  },
  async completion(request) {
    const result = await engine.completions.create(request);
    return Symbol.asyncIterator in result ? keep(result) : result;
  },
  async next(id) {
    const entry = stream(id);
    try {
      const result = await entry.iterator.next();
      if (result.done) streams.delete(id);
      return result.done ? { done: true, value: undefined } : result;
    } catch (error) {
      streams.delete(id);
      throw error;
    }
  },
  async abortStream(id) {
    stream(id).stream.abort();
  },
  async closeStream(id) {
    if (!streams.has(integer('stream', id))) return;
    const entry = stream(id);
    streams.delete(id);
    await entry.iterator.return?.();
  },
  stats: () => engine.stats(),
  async subscribeStats(listener) {
    if (typeof listener !== 'function')
      throw new InvalidRequestError('subscribeStats needs a callback (Comlink.proxy).');
    const id = nextHandle++;
    subscriptions.set(id, await engine.subscribeStats((stats: EngineStats) => listener(stats)));
    return id;
  },
  async unsubscribeStats(id) {
    subscriptions.get(integer('subscription', id))?.();
    subscriptions.delete(id);
  },
  deleteConversation: (id) => engine.deleteConversation(id),
  storedKv: () => engine.storedKv(),
  clearStoredKv: () => engine.clearStoredKv(),
  abort: () => engine.abort(),
  unload: () => engine.unload(),
  async debug(action) {
    // The message check already refused this unless the worker is a debug one; checked again for any other caller.
    if (!debug) throw new InvalidRequestError('debug calls are not accepted (this worker was not started with debug).');
    if (!DEBUG_ACTIONS.includes(action)) throw new InvalidRequestError(`Unknown debug action ${String(action)}.`);
    if (!debugGpu) throw new InvalidRequestError('debug(destroyDevice): no GPU device yet (load a model first).');
    debugGpu.device.destroy();
  },
};

/** Errors cross as plain WireError objects (comlink would keep only an Error's name and message). */
const wireApi = Object.fromEntries(
  Object.entries(api).map(([name, method]) => [
    name,
    async (...args: unknown[]) => {
      try {
        return await (method as (...a: unknown[]) => Promise<unknown>)(...args);
      } catch (error) {
        throw toWireError(error);
      }
    },
  ]),
);

expose(wireApi, guardedEndpoint(self as unknown as Endpoint, { debug }));
