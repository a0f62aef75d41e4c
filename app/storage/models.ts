/**
 * Models stored for offline use: the bytes in the Origin Private File System (models/<id>.gguf), the metadata in
 * IndexedDB. A download resumes from the last byte on disk with an HTTP Range request, and a file is marked complete
 * only when its size on disk equals the total the server announced (Content-Range total or Content-Length). A server
 * that sends more than it announced, or has nothing more to send short of it, has a file of another size than it says:
 * those bytes are discarded, never kept as a start to resume from.
 * Model files are far too big for the service worker's precache, which holds only the app shell.
 */
import { createStore, del, get, set, values } from 'idb-keyval';
import { GGUF_MAGIC } from '../../core/gguf-types.ts';

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

interface ModelFileWriter {
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

/** Content-Range: bytes a-b/total → total (null when '*'). */
function rangeTotal(header: string | null): number | null {
  const match = header?.match(/\/(\d+)\s*$/);
  return match ? Number(match[1]) : null;
}

function rangeStart(header: string | null): number | null {
  const match = header?.match(/bytes\s+(\d+)-/);
  return match ? Number(match[1]) : null;
}

/**
 * The server's file is not the size it announced (it changed after announcing it, or the server misreports it). The
 * bytes on disk cannot be trusted as the start of either file, so they are removed and the record starts from nothing.
 */
async function rejectWrongSize(model: StoredModel, announced: number, received: number): Promise<never> {
  await removeModelFile(model.id);
  await putModel({ ...model, totalBytes: null, storedBytes: 0, complete: false, error: 'wrong size; nothing kept' });
  // Exact counts: a wrong size may be off by a few bytes, which formatBytes would round away.
  const sent = received > announced ? 'sent more than that' : `sent only ${received.toLocaleString('en-US')}`;
  throw new ModelDownloadError(
    'size-mismatch',
    `The server announced ${announced.toLocaleString('en-US')} bytes for ${model.name} but ${sent}. The download was discarded and nothing of it is stored; try again later (the file may have changed on the server) or use another source.`,
  );
}

/**
 * Downloads (or resumes) a stored model. Retries a dropped connection a few times from the last byte on disk.
 * Resolves with the completed record; rejects with ModelDownloadError leaving the record incomplete.
 */
export async function downloadModel(
  id: string,
  onProgress: (progress: DownloadProgress) => void,
  signal?: AbortSignal,
): Promise<StoredModel> {
  const attempts = 4;
  let lastError: unknown = null;
  for (let attempt = 0; attempt < attempts; attempt++) {
    try {
      return await downloadOnce(id, onProgress, signal);
    } catch (error) {
      lastError = error;
      if (error instanceof ModelDownloadError && error.code !== 'download-failed') throw error;
      if (signal?.aborted) throw new ModelDownloadError('aborted', 'Download paused.');
      await new Promise((resolve) => setTimeout(resolve, 300 * (attempt + 1)));
    }
  }
  throw lastError instanceof ModelDownloadError
    ? lastError
    : new ModelDownloadError('download-failed', `Download failed: ${String(lastError)}`);
}

async function downloadOnce(
  id: string,
  onProgress: (progress: DownloadProgress) => void,
  signal?: AbortSignal,
): Promise<StoredModel> {
  const model = await getModel(id);
  if (!model?.url) throw new ModelDownloadError('download-failed', 'Unknown model, or one that has no URL.');
  if (model.complete) return model;
  const handle = (await fileHandle(id, true))!;
  let start = (await handle.getFile()).size;

  let response: Response;
  try {
    response = await fetch(model.url, {
      headers: start > 0 ? { Range: `bytes=${start}-` } : {},
      signal,
      cache: 'no-store',
    });
  } catch (error) {
    if (signal?.aborted) throw new ModelDownloadError('aborted', 'Download paused.');
    throw new ModelDownloadError('download-failed', `Could not reach ${model.url}: ${String(error)}`);
  }

  let total: number | null;
  let truncate = false;
  if (response.status === 416 && start > 0) {
    // Asked past the end: the file may already be whole. Ask for the size with a one-byte range.
    await response.body?.cancel();
    const announced = await probeTotal(model.url, signal);
    if (announced !== null && announced !== start) return rejectWrongSize(model, announced, start);
    return finish(model, handle, announced);
  }
  if (response.status === 206) {
    total = rangeTotal(response.headers.get('Content-Range'));
    const served = rangeStart(response.headers.get('Content-Range'));
    if (served !== start) {
      await response.body?.cancel();
      throw new ModelDownloadError('download-failed', `The server sent bytes from ${served}, not ${start}.`);
    }
  } else if (response.ok) {
    // No Range support (or a fresh start): write from byte 0.
    const length = response.headers.get('Content-Length');
    total = length === null ? null : Number(length);
    truncate = start > 0;
    start = 0;
  } else {
    await response.body?.cancel();
    // Nothing stored and nothing to resume: no row is left behind for it.
    if (start === 0 && response.status >= 400 && response.status < 500) await deleteModel(model.id);
    throw new ModelDownloadError(
      response.status === 404 ? 'not-found' : 'download-failed',
      `${model.url} answered ${response.status} ${response.statusText}.${start === 0 ? ' Nothing was stored.' : ''}`,
    );
  }
  if (!response.body) throw new ModelDownloadError('download-failed', 'The response has no body.');
  if (total !== null && model.totalBytes !== null && model.totalBytes !== total && start > 0) {
    // The file on the server changed since the bytes on disk were written: start over.
    await response.body.cancel();
    const writable = await handle.createWritable({ keepExistingData: false });
    await writable.close();
    await putModel({ ...model, totalBytes: total, storedBytes: 0 });
    throw new ModelDownloadError('download-failed', 'The file on the server changed; starting over.');
  }
  // From byte 0, the body must be a GGUF file: a server that answers a missing file with its app page (200,
  // text/html, as vite and any SPA host do) must not become a stored model, let alone the selected one.
  const contentType = response.headers.get('Content-Type') ?? '';
  if (start === 0 && /^text\/html\b/i.test(contentType)) {
    await response.body.cancel();
    return rejectNotAModel(model, `the server sent a web page (${contentType}), not a model file`);
  }
  model.totalBytes = total;
  model.error = undefined;
  await putModel(model);

  if (total !== null) {
    const estimate = await navigator.storage.estimate?.().catch(() => null);
    const free = estimate?.quota !== undefined && estimate.usage !== undefined ? estimate.quota - estimate.usage : null;
    if (free !== null && total - start > free) {
      await response.body.cancel();
      const message = quotaMessage(model.name, total - start);
      await putModel({ ...model, error: 'not enough storage' });
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

  const writer = await openWriter(handle, truncate);
  let sinceCheckpoint = 0;
  /** Set when the body runs past the announced total: where it would have ended up. */
  let overrun: number | null = null;
  const reader = response.body.getReader();
  /** From byte 0: the first bytes, held back until they show the GGUF magic (null once checked, or on a resume). */
  let unchecked: Uint8Array<ArrayBuffer> | null = start === 0 ? new Uint8Array(0) : null;
  let notAModel = false;
  report();
  try {
    for (;;) {
      const next = await reader.read();
      let value = next.value;
      if (unchecked !== null) {
        if (value) unchecked = concatBytes(unchecked, value);
        if (!next.done && unchecked.byteLength < GGUF_MAGIC_BYTES) continue;
        if (!startsWithGgufMagic(unchecked)) {
          notAModel = true;
          await reader.cancel();
          break;
        }
        value = unchecked;
        unchecked = null;
      }
      if (!value || value.byteLength === 0) {
        if (next.done) break;
        continue;
      }
      if (total !== null && written + value.byteLength > total) {
        // Stop before writing past the announced size, so a server that never stops cannot fill the disk.
        overrun = written + value.byteLength;
        await reader.cancel();
        break;
      }
      await writer.write(value, written);
      written += value.byteLength;
      sinceCheckpoint += value.byteLength;
      if (sinceCheckpoint >= CHECKPOINT_EVERY_BYTES && writer.checkpoint) {
        await writer.checkpoint();
        await putModel({ ...model, storedBytes: written });
        sinceCheckpoint = 0;
      }
      report();
      if (next.done) break;
    }
    await writer.close();
  } catch (error) {
    // Whatever reached the disk stays (the next try resumes from it); the record stays incomplete either way.
    await writer.close().catch(() => {});
    const storedBytes = (await handle.getFile()).size;
    if (isQuotaError(error)) {
      const message = quotaMessage(model.name, total);
      await putModel({ ...model, storedBytes, error: 'not enough storage' });
      throw new ModelDownloadError('storage-quota', message);
    }
    await putModel({ ...model, storedBytes });
    if (signal?.aborted) throw new ModelDownloadError('aborted', 'Download paused.');
    throw new ModelDownloadError('download-failed', `The connection dropped at ${formatBytes(written)}: ${error}`);
  }
  if (notAModel) return rejectNotAModel(model, 'its first bytes are not a GGUF header');
  if (overrun !== null) return rejectWrongSize(model, total!, overrun);
  // A compressed response (vite preview gzips the demo model) carries no length: ask for it with a one-byte range.
  const announced = total ?? (await probeTotal(model.url, signal));
  // The body ended cleanly (a cut connection errors instead). Past the announced size, or short of it without a byte
  // more than we asked from, the server's file is another size; short after some bytes, the next try resumes.
  if (announced !== null && (written > announced || (written < announced && written === start))) {
    return rejectWrongSize(model, announced, written);
  }
  return finish(model, handle, announced);
}

/** The file's size from a one-byte Range request (its Content-Range total), or null when the server does not say. */
async function probeTotal(url: string, signal?: AbortSignal): Promise<number | null> {
  const probe = await fetch(url, { headers: { Range: 'bytes=0-0' }, signal, cache: 'no-store' }).catch(() => null);
  if (signal?.aborted) throw new ModelDownloadError('aborted', 'Download paused.');
  if (!probe) return null;
  await probe.body?.cancel();
  return probe.status === 206 ? rangeTotal(probe.headers.get('Content-Range')) : null;
}

async function finish(model: StoredModel, handle: FileSystemFileHandle, total: number | null): Promise<StoredModel> {
  const size = (await handle.getFile()).size;
  if (total === null) {
    // Without an announced size a short file cannot be told from a whole one: refuse to mark it complete.
    await putModel({ ...model, storedBytes: size, error: 'The server did not say how big the file is.' });
    throw new ModelDownloadError('size-mismatch', 'The server did not announce the file size; it cannot be verified.');
  }
  if (size !== total) {
    await putModel({ ...model, totalBytes: total, storedBytes: size });
    throw new ModelDownloadError('download-failed', `Stored ${size} of ${total} bytes.`);
  }
  const complete: StoredModel = { ...model, totalBytes: total, storedBytes: size, complete: true, error: undefined };
  await putModel(complete);
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
async function rejectNotAModel(model: StoredModel, what: string): Promise<never> {
  await deleteModel(model.id);
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
  return finish(model, handle, file.size);
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
