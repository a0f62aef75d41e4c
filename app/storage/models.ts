/**
 * Models stored for offline use: the bytes in the Origin Private File System (models/<id>.gguf), the metadata in
 * IndexedDB. A download resumes from the last byte on disk with an HTTP Range request, and a file is marked complete
 * only when its size on disk equals the total the server announced (Content-Range total or Content-Length). A server
 * that sends more than it announced, or has nothing more to send short of it, has a file of another size than it says:
 * those bytes are discarded, never kept as a start to resume from. A resume asks for the version of the file the first
 * bytes came from (`If-Range` with its ETag or Last-Modified, kept in the record) and checks the answer's version and
 * total: bytes of two versions are never spliced into one file. Each request has deadlines (core/remote-file.ts).
 * Model files are far too big for the service worker's precache, which holds only the app shell.
 */
import { createStore, del, get, set, values } from 'idb-keyval';
import { AbortedError, DownloadFailedError } from '../../core/errors.ts';
import { GGUF_MAGIC } from '../../core/gguf-types.ts';
import {
  fetchRemote,
  ifRangeOf,
  isContentEncoded,
  parseContentRange,
  type RemoteFileVersion,
  type RemoteResponse,
  type RemoteTimeouts,
  sameVersion,
  totalOfContentRange,
  versionOf,
} from '../../core/remote-file.ts';

export interface StoredModel {
  id: string;
  name: string;
  fileName: string;
  /** Where it downloads from; null for a file opened from disk. */
  url: string | null;
  origin: 'preset' | 'url' | 'demo' | 'local';
  /** Total size announced by the server (or the local file's size); null until the first response. */
  totalBytes: number | null;
  /** Bytes on disk, as of the last write. */
  storedBytes: number;
  complete: boolean;
  addedAt: number;
  error?: string;
  /** The ETag and Last-Modified of the response the stored bytes came from, for a resume to ask for that version. */
  version?: RemoteFileVersion;
}

export interface DownloadProgress {
  bytesDone: number;
  bytesTotal: number | null;
  /** Bytes per second, smoothed. */
  speed: number;
  /** Seconds left at that speed, or null when unknown. */
  secondsLeft: number | null;
}

/** A download that stopped with bytes still missing; `resumable` says whether trying again can help. */
export class ModelDownloadError extends Error {
  readonly code: 'storage-quota' | 'download-failed' | 'aborted' | 'size-mismatch' | 'not-found' | 'not-a-model';
  constructor(code: ModelDownloadError['code'], message: string) {
    super(message);
    this.name = 'ModelDownloadError';
    this.code = code;
  }
}

const store = createStore('longtab-models', 'models');
const MODELS_DIR = 'models';
/** In a worker, bytes are flushed to disk (and the record updated) this often: a crash loses at most this much. */
const CHECKPOINT_EVERY_BYTES = 8 * 1024 * 1024;

export interface ModelFileWriter {
  write(chunk: Uint8Array, at: number): Promise<void>;
  /** Makes the bytes written so far durable; absent where that would cost a copy of the whole file. */
  checkpoint?(): Promise<void>;
  close(): Promise<void>;
}

type SyncAccessHandle = {
  write(buffer: Uint8Array, options: { at: number }): number;
  truncate(size: number): void;
  flush(): void;
  close(): void;
};

/**
 * In a worker (download.worker.ts) a sync access handle writes in place and flushes cheaply. On the main thread a
 * writable stream is the only way; it writes into a swap file that replaces the real one on close, so it is opened
 * once per attempt (re-opening it to checkpoint would copy the whole file each time) and closed, keeping the bytes,
 * when the connection drops.
 */
async function openWriter(handle: FileSystemFileHandle, truncate: boolean): Promise<ModelFileWriter> {
  const withSync = handle as FileSystemFileHandle & { createSyncAccessHandle?: () => Promise<SyncAccessHandle> };
  if (typeof withSync.createSyncAccessHandle === 'function' && typeof document === 'undefined') {
    const access = await withSync.createSyncAccessHandle();
    if (truncate) access.truncate(0);
    let closed = false;
    return {
      async write(chunk, at) {
        let offset = 0;
        while (offset < chunk.byteLength) offset += access.write(chunk.subarray(offset), { at: at + offset });
      },
      async checkpoint() {
        access.flush();
      },
      async close() {
        if (closed) return;
        closed = true;
        access.flush();
        access.close();
      },
    };
  }
  const writable = await handle.createWritable({ keepExistingData: !truncate });
  if (truncate) await writable.truncate(0);
  let closed = false;
  return {
    async write(chunk, at) {
      await writable.write({ type: 'write', position: at, data: chunk as Uint8Array<ArrayBuffer> });
    },
    async close() {
      if (closed) return;
      closed = true;
      await writable.close();
    },
  };
}

/**
 * Where downloads keep records and bytes: IndexedDB and OPFS in the page (`browserModelStorage`). The download logic
 * below uses only this, so it runs the same against any store of files (tests use a temporary folder).
 */
export interface ModelStorage {
  getRecord(id: string): Promise<StoredModel | undefined>;
  putRecord(model: StoredModel): Promise<void>;
  /** Removes the record and the bytes. */
  deleteModel(id: string): Promise<void>;
  /** Bytes stored for the model so far (0 when none). */
  storedSize(id: string): Promise<number>;
  /** Opens the model's file for writing, emptied first with `truncate`. */
  openWriter(id: string, truncate: boolean): Promise<ModelFileWriter>;
  /** Removes the bytes (none stored is fine); the record stays. */
  removeFile(id: string): Promise<void>;
  /** Space left for new bytes, or null when the store does not say. */
  freeBytes(): Promise<number | null>;
}

export function opfsAvailable(): boolean {
  return typeof navigator !== 'undefined' && typeof navigator.storage?.getDirectory === 'function';
}

async function modelsDir(): Promise<FileSystemDirectoryHandle> {
  const root = await navigator.storage.getDirectory();
  return root.getDirectoryHandle(MODELS_DIR, { create: true });
}

function fileNameFor(id: string): string {
  return `${id.replace(/[^a-zA-Z0-9._-]/g, '_')}.gguf`;
}

async function fileHandle(id: string, create: boolean): Promise<FileSystemFileHandle | null> {
  try {
    return await (await modelsDir()).getFileHandle(fileNameFor(id), { create });
  } catch (error) {
    if (error instanceof DOMException && error.name === 'NotFoundError') return null;
    throw error;
  }
}

export async function listModels(): Promise<StoredModel[]> {
  const all = await values<StoredModel>(store);
  return all.sort((a, b) => a.addedAt - b.addedAt);
}

export async function getModel(id: string): Promise<StoredModel | undefined> {
  return get<StoredModel>(id, store);
}

async function putModel(model: StoredModel): Promise<void> {
  await set(model.id, model, store);
}

/** The stored file of a complete model, for `engine.load(file)`. */
export async function openModelFile(id: string): Promise<File> {
  const model = await getModel(id);
  if (!model?.complete) throw new ModelDownloadError('download-failed', 'This model is not fully downloaded yet.');
  const handle = await fileHandle(id, false);
  if (!handle) {
    await putModel({ ...model, complete: false, storedBytes: 0, error: 'The stored file is gone; download it again.' });
    throw new ModelDownloadError('download-failed', `The stored file of ${model.name} is gone; download it again.`);
  }
  const file = await handle.getFile();
  if (model.totalBytes !== null && file.size !== model.totalBytes) {
    await putModel({ ...model, complete: false, storedBytes: file.size });
    throw new ModelDownloadError(
      'size-mismatch',
      `${model.name} on disk is ${file.size} bytes, not ${model.totalBytes}.`,
    );
  }
  return file;
}

/** Removes a model's bytes from OPFS (none stored is fine); its record stays. */
async function removeModelFile(id: string): Promise<void> {
  try {
    await (await modelsDir()).removeEntry(fileNameFor(id));
  } catch (error) {
    if (!(error instanceof DOMException && error.name === 'NotFoundError')) throw error;
  }
}

export async function deleteModel(id: string): Promise<void> {
  await removeModelFile(id);
  await del(id, store);
}

/** The page's store: records in IndexedDB, bytes in OPFS (models/<id>.gguf). */
export const browserModelStorage: ModelStorage = {
  getRecord: getModel,
  putRecord: putModel,
  deleteModel,
  async storedSize(id) {
    const handle = await fileHandle(id, false);
    return handle ? (await handle.getFile()).size : 0;
  },
  async openWriter(id, truncate) {
    return openWriter((await fileHandle(id, true))!, truncate);
  },
  removeFile: removeModelFile,
  async freeBytes() {
    const estimate = await navigator.storage.estimate?.().catch(() => null);
    return estimate?.quota !== undefined && estimate.usage !== undefined ? estimate.quota - estimate.usage : null;
  },
};

/** Registers a model to download (or returns the existing record for that id). */
export async function addRemoteModel(entry: {
  id: string;
  name: string;
  fileName: string;
  url: string;
  origin: StoredModel['origin'];
}): Promise<StoredModel> {
  const existing = await getModel(entry.id);
  if (existing) {
    if (existing.url !== entry.url && !existing.complete) {
      // Same model from another base URL (the hub setting changed): keep the bytes, follow the new address.
      existing.url = entry.url;
      await putModel(existing);
    }
    return existing;
  }
  const model: StoredModel = { ...entry, totalBytes: null, storedBytes: 0, complete: false, addedAt: Date.now() };
  await putModel(model);
  return model;
}

export function modelIdForUrl(url: string): string {
  let hash = 0;
  for (const char of url) hash = (Math.imul(hash, 31) + char.charCodeAt(0)) | 0;
  const last = url.split(/[?#]/)[0]!.split('/').pop() || 'model';
  return `url-${(hash >>> 0).toString(36)}-${last.replace(/\.gguf$/i, '')}`;
}

function isQuotaError(error: unknown): boolean {
  return error instanceof DOMException && (error.name === 'QuotaExceededError' || error.code === 22);
}

function quotaMessage(name: string, needed: number | null): string {
  const size = needed === null ? '' : ` (it needs ${formatBytes(needed)})`;
  return `Not enough storage for ${name}${size}. Delete stored models or free disk space, then resume: the bytes already saved are kept, and the model stays marked incomplete.`;
}

/**
 * The server's file is not the size it announced (it changed after announcing it, or the server misreports it). The
 * bytes on disk cannot be trusted as the start of either file, so they are removed and the record starts from nothing.
 */
async function rejectWrongSize(
  storage: ModelStorage,
  model: StoredModel,
  announced: number,
  received: number,
): Promise<never> {
  await storage.removeFile(model.id);
  await storage.putRecord({
    ...model,
    totalBytes: null,
    storedBytes: 0,
    complete: false,
    version: undefined,
    error: 'wrong size; nothing kept',
  });
  // Exact counts: a wrong size may be off by a few bytes, which formatBytes would round away.
  const sent = received > announced ? 'sent more than that' : `sent only ${received.toLocaleString('en-US')}`;
  throw new ModelDownloadError(
    'size-mismatch',
    `The server announced ${announced.toLocaleString('en-US')} bytes for ${model.name} but ${sent}. The download was discarded and nothing of it is stored; try again later (the file may have changed on the server) or use another source.`,
  );
}

/**
 * The file on the server is another version than the stored bytes' (another ETag, Last-Modified or size): those bytes
 * are removed and the record starts from nothing, so the next attempt (downloadModel retries) starts from byte 0.
 */
async function restartChangedFile(storage: ModelStorage, model: StoredModel, how: string): Promise<never> {
  await storage.removeFile(model.id);
  await storage.putRecord({ ...model, totalBytes: null, storedBytes: 0, complete: false, version: undefined });
  throw new ModelDownloadError(
    'download-failed',
    `The file on the server changed since the stored part of ${model.name} was downloaded (${how}); starting over from the first byte.`,
  );
}

export interface DownloadOptions extends RemoteTimeouts {
  /** Where records and bytes go; the page's IndexedDB and OPFS by default. */
  storage?: ModelStorage;
  /** Defaults to globalThis.fetch. */
  fetch?: typeof fetch;
  /** Wait before the n-th retry of a failed attempt: n × this (ms; default 300). */
  retryDelayMs?: number;
}

/**
 * Downloads (or resumes) a stored model. Retries a dropped connection a few times from the last byte on disk, and a
 * file that changed on the server from byte 0. A server that stops sending fails an attempt after the deadlines of
 * `RemoteTimeouts` (30 s for the headers and for each chunk by default), so a stalled download ends in
 * ModelDownloadError('download-failed') after 4 attempts.
 * Resolves with the completed record; rejects with ModelDownloadError leaving the record incomplete.
 */
export async function downloadModel(
  id: string,
  onProgress: (progress: DownloadProgress) => void,
  signal?: AbortSignal,
  options: DownloadOptions = {},
): Promise<StoredModel> {
  const attempts = 4;
  const delay = options.retryDelayMs ?? 300;
  let lastError: unknown = null;
  for (let attempt = 0; attempt < attempts; attempt++) {
    try {
      return await downloadOnce(id, onProgress, signal, options);
    } catch (error) {
      lastError = error;
      if (error instanceof ModelDownloadError && error.code !== 'download-failed') throw error;
      if (signal?.aborted) throw new ModelDownloadError('aborted', 'Download paused.');
      if (attempt + 1 < attempts) await new Promise((resolve) => setTimeout(resolve, delay * (attempt + 1)));
    }
  }
  throw lastError instanceof ModelDownloadError
    ? lastError
    : new ModelDownloadError('download-failed', `Download failed: ${String(lastError)}`);
}

/** A network failure, a passed deadline or an abort, as the ModelDownloadError the page shows. */
function requestFailed(error: unknown, signal: AbortSignal | undefined): ModelDownloadError {
  if (signal?.aborted || error instanceof AbortedError) return new ModelDownloadError('aborted', 'Download paused.');
  if (error instanceof ModelDownloadError) return error;
  return new ModelDownloadError('download-failed', error instanceof Error ? error.message : String(error));
}

async function downloadOnce(
  id: string,
  onProgress: (progress: DownloadProgress) => void,
  signal: AbortSignal | undefined,
  options: DownloadOptions,
): Promise<StoredModel> {
  const storage = options.storage ?? browserModelStorage;
  const fetchImpl = options.fetch ?? globalThis.fetch;
  const model = await storage.getRecord(id);
  if (!model?.url) throw new ModelDownloadError('download-failed', 'Unknown model, or one that has no URL.');
  if (model.complete) return model;
  const url = model.url;
  let start = await storage.storedSize(id);
  const stored: RemoteFileVersion | null = start > 0 && model.version ? model.version : null;

  const headers: Record<string, string> = {};
  if (start > 0) {
    headers.Range = `bytes=${start}-`;
    // Only the stored bytes' version may continue them; another one comes back whole (200) and starts over.
    const ifRange = stored ? ifRangeOf(stored) : null;
    if (ifRange) headers['If-Range'] = ifRange;
  }
  let request: RemoteResponse;
  try {
    request = await fetchRemote(fetchImpl, url, { headers, signal, cache: 'no-store', what: 'download' }, options);
  } catch (error) {
    throw requestFailed(error, signal);
  }
  const { response } = request;

  let total: number | null;
  let truncate = false;
  if (response.status === 416 && start > 0) {
    // Asked past the end: the file may already be whole. Ask for the size with a one-byte range.
    await request.cancel();
    const probe = await probeFile(fetchImpl, url, signal, options);
    if (stored && probe && !sameVersion(stored, probe.headers)) {
      return restartChangedFile(storage, model, 'another ETag or Last-Modified');
    }
    const announced = probe?.total ?? null;
    if (announced !== null && announced !== start) return rejectWrongSize(storage, model, announced, start);
    return finish(storage, model, announced);
  }
  if (response.status === 206) {
    const range = parseContentRange(response.headers.get('Content-Range'));
    total = range?.total ?? null;
    if (range?.start !== start) {
      await request.cancel();
      throw new ModelDownloadError('download-failed', `The server sent bytes from ${range?.start}, not ${start}.`);
    }
    if (stored && !sameVersion(stored, response.headers)) {
      await request.cancel();
      return restartChangedFile(storage, model, 'another ETag or Last-Modified');
    }
    if (total !== null && model.totalBytes !== null && model.totalBytes !== total) {
      await request.cancel();
      return restartChangedFile(storage, model, `${total} bytes, not ${model.totalBytes}`);
    }
  } else if (response.ok) {
    // No Range support, a fresh start, or (after If-Range) a new version of the file: write from byte 0. A body sent
    // with a Content-Encoding arrives decoded, so its Content-Length (the compressed size) is not the file's.
    const length = response.headers.get('Content-Length');
    total = length === null || isContentEncoded(response.headers) ? null : Number(length);
    truncate = start > 0;
    start = 0;
  } else {
    await request.cancel();
    // Nothing stored and nothing to resume: no row is left behind for it.
    if (start === 0 && response.status >= 400 && response.status < 500) await storage.deleteModel(model.id);
    throw new ModelDownloadError(
      response.status === 404 ? 'not-found' : 'download-failed',
      `${url} answered ${response.status} ${response.statusText}.${start === 0 ? ' Nothing was stored.' : ''}`,
    );
  }
  if (!response.body) throw new ModelDownloadError('download-failed', 'The response has no body.');
  // From byte 0, the body must be a GGUF file: a server that answers a missing file with its app page (200,
  // text/html, as vite and any SPA host do) must not become a stored model, let alone the selected one.
  const contentType = response.headers.get('Content-Type') ?? '';
  if (start === 0 && /^text\/html\b/i.test(contentType)) {
    await request.cancel();
    return rejectNotAModel(storage, model, `the server sent a web page (${contentType}), not a model file`);
  }
  const version = start === 0 ? versionOf(response.headers) : stored;
  model.totalBytes = total;
  model.version = version ?? undefined;
  model.error = undefined;
  await storage.putRecord(model);

  if (total !== null) {
    const free = await storage.freeBytes();
    if (free !== null && total - start > free) {
      await request.cancel();
      const message = quotaMessage(model.name, total - start);
      await storage.putRecord({ ...model, error: 'not enough storage' });
      throw new ModelDownloadError('storage-quota', message);
    }
  }

  let written = start;
  const startedAt = performance.now();
  let speed = 0;
  let lastTick = startedAt;
  let lastBytes = start;
  const report = () => {
    const now = performance.now();
    if (now - lastTick > 250) {
      const instant = ((written - lastBytes) * 1000) / (now - lastTick);
      speed = speed === 0 ? instant : speed * 0.7 + instant * 0.3;
      lastTick = now;
      lastBytes = written;
    }
    onProgress({
      bytesDone: written,
      bytesTotal: total,
      speed,
      secondsLeft: total !== null && speed > 0 ? (total - written) / speed : null,
    });
  };

  const writer = await storage.openWriter(id, truncate);
  let sinceCheckpoint = 0;
  /** Set when the body runs past the announced total: where it would have ended up. */
  let overrun: number | null = null;
  /** From byte 0: the first bytes, held back until they show the GGUF magic (null once checked, or on a resume). */
  let unchecked: Uint8Array<ArrayBuffer> | null = start === 0 ? new Uint8Array(0) : null;
  let notAModel = false;
  const write = async (value: Uint8Array): Promise<boolean> => {
    if (value.byteLength === 0) return true;
    if (total !== null && written + value.byteLength > total) {
      // Stop before writing past the announced size, so a server that never stops cannot fill the disk.
      overrun = written + value.byteLength;
      return false;
    }
    await writer.write(value, written);
    written += value.byteLength;
    sinceCheckpoint += value.byteLength;
    if (sinceCheckpoint >= CHECKPOINT_EVERY_BYTES && writer.checkpoint) {
      await writer.checkpoint();
      await storage.putRecord({ ...model, storedBytes: written });
      sinceCheckpoint = 0;
    }
    report();
    return true;
  };
  report();
  try {
    await request.readChunks(async (value) => {
      if (unchecked === null) return write(value);
      unchecked = concatBytes(unchecked, value);
      if (unchecked.byteLength < GGUF_MAGIC_BYTES) return true;
      if (!startsWithGgufMagic(unchecked)) {
        notAModel = true;
        return false;
      }
      const first = unchecked;
      unchecked = null;
      return write(first);
    });
    // A body shorter than the magic number ends with the bytes still held back.
    if (unchecked !== null && !notAModel) {
      if (startsWithGgufMagic(unchecked)) await write(unchecked);
      else notAModel = true;
    }
    await writer.close();
  } catch (error) {
    // Whatever reached the disk stays (the next try resumes from it); the record stays incomplete either way.
    await writer.close().catch(() => {});
    const storedBytes = await storage.storedSize(id);
    if (isQuotaError(error)) {
      const message = quotaMessage(model.name, total);
      await storage.putRecord({ ...model, storedBytes, error: 'not enough storage' });
      throw new ModelDownloadError('storage-quota', message);
    }
    await storage.putRecord({ ...model, storedBytes });
    if (signal?.aborted) throw new ModelDownloadError('aborted', 'Download paused.');
    const reason = error instanceof DownloadFailedError ? error.message : String(error);
    throw new ModelDownloadError('download-failed', `The connection dropped at ${formatBytes(written)}: ${reason}`);
  }
  if (notAModel) return rejectNotAModel(storage, model, 'its first bytes are not a GGUF header');
  if (overrun !== null) return rejectWrongSize(storage, model, total!, overrun);
  let announced = total;
  if (announced === null) {
    // A compressed response (vite preview gzips the demo model) carries no usable length: ask for it with a one-byte
    // range, which must be of the same version.
    const probe = await probeFile(fetchImpl, url, signal, options);
    if (probe && version && !sameVersion(version, probe.headers)) {
      return restartChangedFile(storage, model, 'another ETag or Last-Modified');
    }
    announced = probe?.total ?? null;
  }
  // The body ended cleanly (a cut connection errors instead). Past the announced size, or short of it without a byte
  // more than we asked from, the server's file is another size; short after some bytes, the next try resumes.
  if (announced !== null && (written > announced || (written < announced && written === start))) {
    return rejectWrongSize(storage, model, announced, written);
  }
  return finish(storage, model, announced);
}

/** The file's size (a one-byte Range request's Content-Range total) and version, or null when the server does not say. */
async function probeFile(
  fetchImpl: typeof fetch,
  url: string,
  signal: AbortSignal | undefined,
  timeouts: RemoteTimeouts,
): Promise<{ total: number | null; headers: Headers } | null> {
  let probe: RemoteResponse;
  try {
    probe = await fetchRemote(
      fetchImpl,
      url,
      { headers: { Range: 'bytes=0-0' }, signal, cache: 'no-store', what: 'size probe' },
      timeouts,
    );
  } catch {
    if (signal?.aborted) throw new ModelDownloadError('aborted', 'Download paused.');
    return null;
  }
  await probe.cancel();
  if (probe.response.status !== 206) return null;
  return {
    total: totalOfContentRange(probe.response.headers.get('Content-Range')),
    headers: probe.response.headers,
  };
}

async function finish(storage: ModelStorage, model: StoredModel, total: number | null): Promise<StoredModel> {
  const size = await storage.storedSize(model.id);
  if (total === null) {
    // Without an announced size a short file cannot be told from a whole one: refuse to mark it complete.
    await storage.putRecord({ ...model, storedBytes: size, error: 'The server did not say how big the file is.' });
    throw new ModelDownloadError('size-mismatch', 'The server did not announce the file size; it cannot be verified.');
  }
  if (size !== total) {
    await storage.putRecord({ ...model, totalBytes: total, storedBytes: size });
    throw new ModelDownloadError('download-failed', `Stored ${size} of ${total} bytes.`);
  }
  const complete: StoredModel = { ...model, totalBytes: total, storedBytes: size, complete: true, error: undefined };
  await storage.putRecord(complete);
  return complete;
}

/** Bytes of the magic number every GGUF file starts with. */
const GGUF_MAGIC_BYTES = 4;

function startsWithGgufMagic(bytes: Uint8Array): boolean {
  return (
    bytes.byteLength >= GGUF_MAGIC_BYTES &&
    new DataView(bytes.buffer, bytes.byteOffset, GGUF_MAGIC_BYTES).getUint32(0, true) === GGUF_MAGIC
  );
}

function concatBytes(a: Uint8Array, b: Uint8Array): Uint8Array<ArrayBuffer> {
  const out = new Uint8Array(a.byteLength + b.byteLength);
  out.set(a);
  out.set(b, a.byteLength);
  return out;
}

/**
 * What the URL serves is not a model: the record and any bytes are removed (there is nothing to resume), so the
 * list shows no row for it and nothing can select it; the message says what came back.
 */
async function rejectNotAModel(storage: ModelStorage, model: StoredModel, what: string): Promise<never> {
  await storage.deleteModel(model.id);
  throw new ModelDownloadError(
    'not-a-model',
    `${model.url} is not a GGUF model: ${what}. Nothing was stored, and the model in use is unchanged. Check the address (a missing file often comes back as a web page).`,
  );
}

/** Copies a file opened from disk into storage so it also works offline. */
export async function importLocalFile(file: File): Promise<StoredModel> {
  const id = `local-${file.name.replace(/\.gguf$/i, '')}-${file.size}`;
  const model: StoredModel = {
    id,
    name: file.name,
    fileName: file.name,
    url: null,
    origin: 'local',
    totalBytes: file.size,
    storedBytes: 0,
    complete: false,
    addedAt: Date.now(),
  };
  const existing = await getModel(id);
  if (existing?.complete) return existing;
  await putModel(model);
  const handle = (await fileHandle(id, true))!;
  const writable = await handle.createWritable({ keepExistingData: false });
  try {
    await writable.write(file);
    await writable.close();
  } catch (error) {
    await writable.abort().catch(() => {});
    if (isQuotaError(error)) {
      const message = quotaMessage(file.name, file.size);
      await putModel({ ...model, error: 'not enough storage' });
      throw new ModelDownloadError('storage-quota', message);
    }
    throw error;
  }
  return finish(browserModelStorage, model, file.size);
}

export interface StorageQuota {
  usage: number;
  quota: number;
  persisted: boolean;
}

export async function storageQuota(): Promise<StorageQuota | null> {
  if (!navigator.storage?.estimate) return null;
  const { usage = 0, quota = 0 } = await navigator.storage.estimate();
  const persisted = (await navigator.storage.persisted?.().catch(() => false)) ?? false;
  return { usage, quota, persisted };
}

/** Reads the first bytes of a same-origin URL to tell a GGUF file from a missing one (a SPA fallback page). */
export async function ggufExistsAt(url: string): Promise<boolean> {
  try {
    const response = await fetch(url, { headers: { Range: 'bytes=0-3' }, cache: 'no-store' });
    if (!response.ok) return false;
    return startsWithGgufMagic(new Uint8Array(await response.arrayBuffer()));
  } catch {
    return false;
  }
}

export function formatBytes(bytes: number): string {
  if (bytes < 1024) return `${bytes} B`;
  const units = ['KiB', 'MiB', 'GiB', 'TiB'];
  let value = bytes / 1024;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit++;
  }
  return `${value.toFixed(value < 10 ? 1 : 0)} ${units[unit]}`;
}

export function formatDuration(seconds: number): string {
  if (!Number.isFinite(seconds)) return '—';
  if (seconds < 60) return `${Math.ceil(seconds)} s`;
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) return `${minutes} min ${Math.ceil(seconds % 60)} s`;
  return `${Math.floor(minutes / 60)} h ${minutes % 60} min`;
}
