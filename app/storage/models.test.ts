/**
 * The page's resumable download (downloadModel) against a real HTTP server (test/http-file-server.ts), storing into a
 * temporary folder through the ModelStorage interface the page implements with IndexedDB and OPFS: a resume never
 * splices two versions of a file (issue 39, point 3), gzip is not taken for a changed file, and a stalled server
 * ends the download (point 4).
 */
import { mkdtemp, open, readFile, rm, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { GgmlType } from '../../core/gguf-types.ts';
import { writeGguf } from '../../runtime/gguf/writer.ts';
import { randomBytes } from '../../test/gguf-fixtures.ts';
import { type FileServer, startFileServer } from '../../test/http-file-server.ts';
import { describeRefusal, faultLog, isRefusal, rejectionOf } from '../../test/regressions/fault-log.ts';
import {
  type DownloadOptions,
  type DownloadProgress,
  downloadModel,
  ModelDownloadError,
  type ModelFileWriter,
  type ModelStorage,
  type StoredModel,
} from './models.ts';

/** ModelStorage over a folder: one file per model, the records in a Map (the page keeps them in IndexedDB). */
function folderStorage(dir: string): ModelStorage & { records: Map<string, StoredModel>; path(id: string): string } {
  const records = new Map<string, StoredModel>();
  const path = (id: string) => join(dir, `${id}.gguf`);
  const storage = {
    records,
    path,
    async getRecord(id: string) {
      const record = records.get(id);
      return record && structuredClone(record);
    },
    async putRecord(model: StoredModel) {
      records.set(model.id, structuredClone(model));
    },
    async deleteModel(id: string) {
      await storage.removeFile(id);
      records.delete(id);
    },
    async storedSize(id: string) {
      return stat(path(id)).then(
        (s) => s.size,
        () => 0,
      );
    },
    async openWriter(id: string, truncate: boolean): Promise<ModelFileWriter> {
      const file = await open(path(id), 'a+').then(async (h) => {
        await h.close();
        return open(path(id), 'r+');
      });
      if (truncate) await file.truncate(0);
      let closed = false;
      return {
        async write(chunk, at) {
          await file.write(chunk, 0, chunk.byteLength, at);
        },
        async close() {
          if (closed) return;
          closed = true;
          await file.close();
        },
      };
    },
    async removeFile(id: string) {
      await rm(path(id), { force: true });
    },
    async freeBytes() {
      return null;
    },
  };
  return storage;
}

let dir: string;
let server: FileServer | null = null;
beforeEach(async () => {
  dir = await mkdtemp(join(tmpdir(), 'longtab-download-'));
});
afterEach(async () => {
  await server?.close();
  server = null;
  await rm(dir, { recursive: true, force: true });
});

/** A GGUF file of `size` bytes or a little more; `seed` makes two versions differ in every tensor byte. */
function modelFile(seed: number, tensorBytes = 1 << 20): Uint8Array {
  return writeGguf({
    metadata: [{ key: 'general.architecture', type: 'string', value: 'llama' }],
    tensors: [{ name: 'w', shape: [tensorBytes], type: GgmlType.I8, data: randomBytes(tensorBytes, seed) }],
  });
}

/** Whether the stored file holds exactly `bytes` (toEqual on a megabyte array is slow: it compares element by element). */
async function storedEquals(path: string, bytes: Uint8Array): Promise<boolean> {
  return Buffer.from(bytes).equals(await readFile(path));
}

const log = faultLog('download');

const MONDAY = 'Mon, 01 Jan 2024 00:00:00 GMT';
const TUESDAY = 'Tue, 02 Jan 2024 00:00:00 GMT';

async function register(storage: ModelStorage, url: string): Promise<void> {
  await storage.putRecord({
    id: 'm',
    name: 'Model',
    fileName: 'model.gguf',
    url,
    origin: 'url',
    totalBytes: null,
    storedBytes: 0,
    complete: false,
    addedAt: 0,
  });
}

/** Downloads until about half the file is stored, then pauses (as the page's Pause button does). */
async function downloadHalfThenPause(storage: ModelStorage, half: number, options: DownloadOptions): Promise<void> {
  server!.behaviour.stallAfterBytes = half;
  const controller = new AbortController();
  const onProgress = (p: DownloadProgress) => {
    if (p.bytesDone >= half) controller.abort();
  };
  const paused = downloadModel('m', onProgress, controller.signal, { ...options, storage });
  await expect(paused).rejects.toMatchObject({ code: 'aborted' });
  server!.behaviour.stallAfterBytes = null;
  expect(await storage.storedSize('m')).toBe(half);
}

describe('downloadModel resumes only the same file', () => {
  const options: DownloadOptions = { retryDelayMs: 10 };

  for (const honourIfRange of [true, false]) {
    it(`starts over when a same-size file with a new ETag replaced it (server ${honourIfRange ? 'honours' : 'ignores'} If-Range)`, async () => {
      const v1 = modelFile(1);
      const v2 = modelFile(2);
      expect(v2.byteLength).toBe(v1.byteLength);
      server = await startFileServer({ bytes: v1, etag: '"v1"', lastModified: MONDAY });
      server.behaviour.honourIfRange = honourIfRange;
      const storage = folderStorage(dir);
      await register(storage, server.url);
      await downloadHalfThenPause(storage, 512 << 10, options);

      server.file = { bytes: v2, etag: '"v2"', lastModified: TUESDAY };
      const done = await downloadModel('m', () => {}, undefined, { ...options, storage });
      // The stored file is v2 whole, not v1's first half spliced onto v2's second.
      const whole = await storedEquals(storage.path('m'), v2);
      const resumed = server.requests.filter((headers) => headers.range === `bytes=${512 << 10}-`);
      log.record({
        area: 'download',
        fault: `paused at 512 KiB, then the file replaced by a same-size one with a new ETag (server ${honourIfRange ? 'honours' : 'ignores'} If-Range)`,
        expected:
          'the resume asks If-Range with the old ETag, sees the change and starts over; the stored file is the new one whole',
        outcome: `${resumed.length} resume with If-Range ${resumed[0]?.['if-range'] ?? 'none'}; ${done.complete ? 'complete' : 'incomplete'}; stored file ${whole ? 'is v2 byte for byte' : 'differs from v2'}`,
        ok:
          done.complete &&
          whole &&
          resumed.length === 1 &&
          resumed[0]!['if-range'] === '"v1"' &&
          done.version?.etag === '"v2"' &&
          done.version?.lastModified === TUESDAY,
      });
      expect(done.complete).toBe(true);
      expect(whole).toBe(true);
      expect(resumed.length).toBe(1);
      expect(resumed[0]!['if-range']).toBe('"v1"');
      expect(done.version).toEqual({ etag: '"v2"', lastModified: TUESDAY });
    });
  }

  it('resumes an unchanged file from its last byte, with If-Range by Last-Modified where there is no ETag', async () => {
    const v1 = modelFile(3);
    server = await startFileServer({ bytes: v1, etag: null, lastModified: MONDAY });
    const storage = folderStorage(dir);
    await register(storage, server.url);
    await downloadHalfThenPause(storage, 256 << 10, options);
    const done = await downloadModel('m', () => {}, undefined, { ...options, storage });
    const last = server.requests.at(-1)!;
    const sent = server.bodyBytesSent.at(-1);
    const whole = await storedEquals(storage.path('m'), v1);
    log.record({
      area: 'download',
      fault: 'paused at 256 KiB, the file unchanged (no ETag, a Last-Modified)',
      expected: 'resumes from byte 262144 with If-Range by Last-Modified, sends only the rest; the stored file whole',
      outcome: `resumed with ${last.range}, If-Range ${last['if-range'] === MONDAY ? 'Last-Modified' : (last['if-range'] ?? 'none')}; ${sent} bytes sent; stored file ${whole ? 'identical' : 'differs'}`,
      ok:
        done.complete &&
        last.range === `bytes=${256 << 10}-` &&
        last['if-range'] === MONDAY &&
        sent === v1.byteLength - (256 << 10) &&
        whole,
    });
    expect(done.complete).toBe(true);
    expect(last.range).toBe(`bytes=${256 << 10}-`);
    expect(last['if-range']).toBe(MONDAY);
    expect(sent).toBe(v1.byteLength - (256 << 10));
    expect(whole).toBe(true);
  });

  it('stores a gzip-encoded download whole (its Content-Length is the compressed size, not a changed file)', async () => {
    // Compressible: a quarter of the size once gzipped.
    const bytes = writeGguf({
      metadata: [{ key: 'general.architecture', type: 'string', value: 'llama' }],
      tensors: [{ name: 'w', shape: [1 << 18], type: GgmlType.I8, data: new Uint8Array(1 << 18).fill(7) }],
    });
    server = await startFileServer({ bytes, etag: '"gz"', lastModified: null });
    server.behaviour.gzip = true;
    const storage = folderStorage(dir);
    await register(storage, server.url);
    const done = await downloadModel('m', () => {}, undefined, { ...options, storage });
    const whole = await storedEquals(storage.path('m'), bytes);
    log.record({
      area: 'download',
      fault: 'a gzip-encoded answer whose Content-Length is the compressed size (a quarter of the file)',
      expected: 'not taken for a changed or short file: stored whole, the total the file size',
      outcome: `${done.complete ? 'complete' : 'incomplete'}, total ${done.totalBytes} of ${bytes.byteLength}; stored file ${whole ? 'identical' : 'differs'}`,
      ok: done.complete && done.totalBytes === bytes.byteLength && whole,
    });
    expect(server.requests[0]!['accept-encoding']).toMatch(/gzip/);
    expect(done).toMatchObject({ complete: true, totalBytes: bytes.byteLength });
    expect(whole).toBe(true);
  });
});

describe('downloadModel deadlines', () => {
  it('a server that stops sending mid-file fails the download with download-failed after chunkTimeoutMs per attempt', async () => {
    server = await startFileServer({ bytes: modelFile(4), etag: '"v1"', lastModified: null });
    server.behaviour.stallAfterBytes = 100 << 10;
    const storage = folderStorage(dir);
    await register(storage, server.url);
    const error = await rejectionOf(
      downloadModel('m', () => {}, undefined, { storage, chunkTimeoutMs: 150, retryDelayMs: 10 }),
    );
    const message = /stopped answering \(download\): no bytes for 0.15 s/;
    const complete = (await storage.getRecord('m'))!.complete;
    log.record({
      area: 'download',
      fault: 'a server that stops sending after 100 KiB, every attempt (chunkTimeoutMs 150)',
      expected: 'ModelDownloadError (download-failed) after 4 attempts, each resuming; the model not marked complete',
      outcome: `${describeRefusal(error, message)}; ${server.requests.length} requests; ${complete ? 'marked complete' : 'not complete'}`,
      ok:
        isRefusal(error, ModelDownloadError, message) &&
        (error as ModelDownloadError).code === 'download-failed' &&
        server.requests.length === 4 &&
        !complete,
    });
    expect(error).toBeInstanceOf(ModelDownloadError);
    expect(error).toMatchObject({ code: 'download-failed' });
    expect((error as Error).message).toMatch(message);
    // Each attempt kept what reached the disk and resumed from it.
    expect(server.requests.length).toBe(4);
    expect(complete).toBe(false);
  });

  it('a server that never answers fails it after headersTimeoutMs per attempt', async () => {
    server = await startFileServer({ bytes: modelFile(5), etag: '"v1"', lastModified: null });
    server.behaviour.stallHeaders = true;
    const storage = folderStorage(dir);
    await register(storage, server.url);
    const error = await rejectionOf(
      downloadModel('m', () => {}, undefined, { storage, headersTimeoutMs: 150, retryDelayMs: 10 }),
    );
    const message = /stopped answering \(download\): no response within 0.15 s/;
    log.record({
      area: 'download',
      fault: 'a server that never sends headers (headersTimeoutMs 150)',
      expected: 'ModelDownloadError saying so, after 4 attempts',
      outcome: `${describeRefusal(error, message)}; ${server.requests.length} requests`,
      ok: isRefusal(error, ModelDownloadError, message) && server.requests.length === 4,
    });
    expect((error as Error).message).toMatch(message);
    expect(server.requests.length).toBe(4);
  });
});
