/**
 * sourceFromUrl against a real HTTP server (test/http-file-server.ts): every read is of the file the probe saw (issue
 * 39, point 3), a long answer is cut at the range, and a server that stalls ends in a DownloadFailedError within the
 * stated deadlines (point 4).
 */
import { afterEach, describe, expect, it } from 'vitest';
import { AbortedError, DownloadFailedError } from '../../core/errors.ts';
import { randomBytes } from '../../test/gguf-fixtures.ts';
import { type FileServer, startFileServer } from '../../test/http-file-server.ts';
import { parseGguf } from './parse.ts';
import { sourceFromBytes, sourceFromUrl } from './sources.ts';
import { writeGguf } from './writer.ts';

let server: FileServer | null = null;
afterEach(async () => {
  await server?.close();
  server = null;
});

const MONDAY = 'Mon, 01 Jan 2024 00:00:00 GMT';
const TUESDAY = 'Tue, 02 Jan 2024 00:00:00 GMT';

describe('sourceFromUrl reads one file, not two', () => {
  it('sends If-Range with the ETag of the probe on every read, and parses the file', async () => {
    const bytes = writeGguf({
      metadata: [{ key: 'general.architecture', type: 'string', value: 'llama' }],
      tensors: [{ name: 'w', shape: [64], type: 0, data: randomBytes(256, 1) }],
    });
    server = await startFileServer({ bytes, etag: '"v1"', lastModified: MONDAY });
    const source = await sourceFromUrl(server.url);
    expect(await parseGguf(source)).toEqual(await parseGguf(sourceFromBytes(bytes, 'model.gguf')));
    const reads = server.requests.slice(1);
    expect(reads.length).toBeGreaterThan(0);
    expect(reads.every((headers) => headers['if-range'] === '"v1"')).toBe(true);
  });

  it('fails a read once the file is replaced by one of the same size with a new ETag (server honours If-Range)', async () => {
    const first = randomBytes(4096, 2);
    server = await startFileServer({ bytes: first, etag: '"v1"', lastModified: MONDAY });
    const source = await sourceFromUrl(server.url);
    expect(await source.read(0, 100)).toEqual(first.subarray(0, 100));
    server.file = { bytes: randomBytes(4096, 3), etag: '"v2"', lastModified: TUESDAY };
    const read = source.read(100, 100);
    await expect(read).rejects.toBeInstanceOf(DownloadFailedError);
    await expect(read).rejects.toThrow(/changed on the server while it was loading.*load the model again/);
  });

  it('fails it too when the server ignores If-Range and sends the new file with its new ETag', async () => {
    server = await startFileServer({ bytes: randomBytes(4096, 2), etag: '"v1"', lastModified: null });
    server.behaviour.honourIfRange = false;
    const source = await sourceFromUrl(server.url);
    await source.read(0, 100);
    server.file = { bytes: randomBytes(4096, 3), etag: '"v2"', lastModified: null };
    await expect(source.read(100, 100)).rejects.toThrow(/changed on the server.*another ETag/);
  });

  it('uses Last-Modified where there is no ETag, and a weak ETag only to compare', async () => {
    server = await startFileServer({ bytes: randomBytes(4096, 2), etag: null, lastModified: MONDAY });
    const byDate = await sourceFromUrl(server.url);
    await byDate.read(0, 10);
    expect(server.requests.at(-1)!['if-range']).toBe(MONDAY);
    server.file = { bytes: randomBytes(4096, 3), etag: null, lastModified: TUESDAY };
    await expect(byDate.read(10, 10)).rejects.toThrow(/changed on the server/);

    // A weak ETag may not go into If-Range (servers would then always send the whole file): no If-Range, but the
    // ETag of each answer is still compared.
    server.file = { bytes: randomBytes(4096, 4), etag: 'W/"w1"', lastModified: null };
    const weak = await sourceFromUrl(server.url);
    await weak.read(0, 10);
    expect(server.requests.at(-1)!['if-range']).toBeUndefined();
    server.file = { bytes: randomBytes(4096, 5), etag: 'W/"w2"', lastModified: null };
    await expect(weak.read(10, 10)).rejects.toThrow(/changed on the server/);
  });

  it('fails a read when the Content-Range total says the file is now another size', async () => {
    server = await startFileServer({ bytes: randomBytes(4096, 2), etag: null, lastModified: null });
    const source = await sourceFromUrl(server.url);
    server.file = { bytes: randomBytes(5000, 3), etag: null, lastModified: null };
    await expect(source.read(0, 10)).rejects.toThrow(/changed on the server.*now 5000 bytes, not 4096/);
  });

  it('cuts an answer longer than the range at the range, without receiving the rest', async () => {
    const bytes = randomBytes(48 << 20, 6);
    server = await startFileServer({ bytes, etag: '"big"', lastModified: null });
    server.behaviour.ignoreRangeEnd = true;
    const source = await sourceFromUrl(server.url);
    expect(await source.read(1000, 100)).toEqual(bytes.subarray(1000, 1100));
    // The server stopped when the client hung up: far less than the 48 MiB it had to send went out.
    await new Promise((resolve) => setTimeout(resolve, 100));
    expect(server.bodyBytesSent.at(-1)!).toBeLessThan(24 << 20);
  });
});

describe('sourceFromUrl deadlines', () => {
  it('a server that never answers ends in DownloadFailedError after headersTimeoutMs', async () => {
    server = await startFileServer({ bytes: randomBytes(4096, 7), etag: '"v1"', lastModified: null });
    server.behaviour.stallHeaders = true;
    const opening = sourceFromUrl(server.url, { headersTimeoutMs: 200 });
    await expect(opening).rejects.toBeInstanceOf(DownloadFailedError);
    await expect(opening).rejects.toThrow(/stopped answering \(probe\): no response within 0.2 s/);
  });

  it('a body that stops mid-read ends in DownloadFailedError after chunkTimeoutMs', async () => {
    const bytes = randomBytes(1 << 20, 8);
    server = await startFileServer({ bytes, etag: '"v1"', lastModified: null });
    const source = await sourceFromUrl(server.url, { chunkTimeoutMs: 200 });
    server.behaviour.stallAfterBytes = 300 << 10;
    const read = source.read(0, 1 << 20);
    await expect(read).rejects.toBeInstanceOf(DownloadFailedError);
    await expect(read).rejects.toThrow(/stopped answering \(bytes=0-1048575\): no bytes for 0.2 s/);
  });

  it('an abort ends a stalled read with AbortedError', async () => {
    server = await startFileServer({ bytes: randomBytes(4096, 9), etag: '"v1"', lastModified: null });
    const controller = new AbortController();
    const source = await sourceFromUrl(server.url, { signal: controller.signal });
    server.behaviour.stallHeaders = true;
    const read = source.read(0, 10);
    setTimeout(() => controller.abort(), 50);
    await expect(read).rejects.toBeInstanceOf(AbortedError);
  });
});
