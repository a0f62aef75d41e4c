/**
 * sourceFromUrl against a real HTTP server (test/http-file-server.ts): every read is of the file the probe saw (issue
 * 39, point 3), a long answer is cut at the range, and a server that stalls ends in a DownloadFailedError within the
 * stated deadlines (point 4).
 */
import { afterEach, describe, expect, it } from 'vitest';
import { AbortedError, DownloadFailedError } from '../../core/errors.ts';
import { randomBytes } from '../../test/gguf-fixtures.ts';
import { type FileServer, startFileServer } from '../../test/http-file-server.ts';
import { describeRefusal, faultLog, isRefusal, rejectionOf } from '../../test/regressions/fault-log.ts';
import { parseGguf } from './parse.ts';
import { sourceFromBytes, sourceFromUrl } from './sources.ts';
import { writeGguf } from './writer.ts';

let server: FileServer | null = null;
afterEach(async () => {
  await server?.close();
  server = null;
});

const log = faultLog('url-source');

/** Records a read or open that must fail with `type` saying `message`, then asserts it. */
async function expectRefusal(
  fault: string,
  attempt: Promise<unknown>,
  type: typeof DownloadFailedError | typeof AbortedError,
  message?: RegExp,
): Promise<void> {
  const error = await rejectionOf(attempt);
  log.record({
    area: 'sources',
    fault,
    expected: `${type.name}${message ? ' saying why' : ''}`,
    outcome: describeRefusal(error, message),
    ok: isRefusal(error, type, message),
  });
  expect(error, fault).toBeInstanceOf(type);
  if (message) expect((error as Error).message, fault).toMatch(message);
}

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
    const parsed = await parseGguf(source);
    const reads = server.requests.slice(1);
    const withIfRange = reads.filter((headers) => headers['if-range'] === '"v1"').length;
    log.record({
      area: 'sources',
      fault: 'a GGUF file served with an ETag, read range by range',
      expected: 'every read after the probe carries If-Range with the ETag; the file parses as from bytes',
      outcome: `${withIfRange} of ${reads.length} reads with If-Range "v1"`,
      ok: reads.length > 0 && withIfRange === reads.length,
    });
    expect(parsed).toEqual(await parseGguf(sourceFromBytes(bytes, 'model.gguf')));
    expect(reads.length).toBeGreaterThan(0);
    expect(withIfRange).toBe(reads.length);
  });

  it('fails a read once the file is replaced by one of the same size with a new ETag (server honours If-Range)', async () => {
    const first = randomBytes(4096, 2);
    server = await startFileServer({ bytes: first, etag: '"v1"', lastModified: MONDAY });
    const source = await sourceFromUrl(server.url);
    expect(await source.read(0, 100)).toEqual(first.subarray(0, 100));
    server.file = { bytes: randomBytes(4096, 3), etag: '"v2"', lastModified: TUESDAY };
    await expectRefusal(
      'the file replaced mid-load by one of the same size with a new ETag (server honours If-Range)',
      source.read(100, 100),
      DownloadFailedError,
      /changed on the server while it was loading.*load the model again/,
    );
  });

  it('fails it too when the server ignores If-Range and sends the new file with its new ETag', async () => {
    server = await startFileServer({ bytes: randomBytes(4096, 2), etag: '"v1"', lastModified: null });
    server.behaviour.honourIfRange = false;
    const source = await sourceFromUrl(server.url);
    await source.read(0, 100);
    server.file = { bytes: randomBytes(4096, 3), etag: '"v2"', lastModified: null };
    await expectRefusal(
      'the file replaced mid-load, new ETag, by a server that ignores If-Range',
      source.read(100, 100),
      DownloadFailedError,
      /changed on the server.*another ETag/,
    );
  });

  it('uses Last-Modified where there is no ETag, and a weak ETag only to compare', async () => {
    server = await startFileServer({ bytes: randomBytes(4096, 2), etag: null, lastModified: MONDAY });
    const byDate = await sourceFromUrl(server.url);
    await byDate.read(0, 10);
    expect(server.requests.at(-1)!['if-range']).toBe(MONDAY);
    server.file = { bytes: randomBytes(4096, 3), etag: null, lastModified: TUESDAY };
    await expectRefusal(
      'the file replaced mid-load, no ETag, a new Last-Modified',
      byDate.read(10, 10),
      DownloadFailedError,
      /changed on the server/,
    );

    // A weak ETag may not go into If-Range (servers would then always send the whole file): no If-Range, but the
    // ETag of each answer is still compared.
    server.file = { bytes: randomBytes(4096, 4), etag: 'W/"w1"', lastModified: null };
    const weak = await sourceFromUrl(server.url);
    await weak.read(0, 10);
    expect(server.requests.at(-1)!['if-range']).toBeUndefined();
    server.file = { bytes: randomBytes(4096, 5), etag: 'W/"w2"', lastModified: null };
    await expectRefusal(
      'the file replaced mid-load, a new weak ETag (not sent in If-Range)',
      weak.read(10, 10),
      DownloadFailedError,
      /changed on the server/,
    );
  });

  it('fails a read when the Content-Range total says the file is now another size', async () => {
    server = await startFileServer({ bytes: randomBytes(4096, 2), etag: null, lastModified: null });
    const source = await sourceFromUrl(server.url);
    server.file = { bytes: randomBytes(5000, 3), etag: null, lastModified: null };
    await expectRefusal(
      'the file replaced mid-load by one of another size, no ETag or Last-Modified (Content-Range total 5000, not 4096)',
      source.read(0, 10),
      DownloadFailedError,
      /changed on the server.*now 5000 bytes, not 4096/,
    );
  });

  it('cuts an answer longer than the range at the range, without receiving the rest', async () => {
    const bytes = randomBytes(48 << 20, 6);
    server = await startFileServer({ bytes, etag: '"big"', lastModified: null });
    server.behaviour.ignoreRangeEnd = true;
    const source = await sourceFromUrl(server.url);
    const read = await source.read(1000, 100);
    // The server stopped when the client hung up: far less than the 48 MiB it had to send went out.
    await new Promise((resolve) => setTimeout(resolve, 100));
    const sent = server.bodyBytesSent.at(-1)!;
    const exact = read.length === 100 && Buffer.from(read).equals(bytes.subarray(1000, 1100));
    log.record({
      area: 'sources',
      fault: 'a 100-byte range answered with the rest of a 48 MiB file (the server ignores the range end)',
      expected: 'the read returns the 100 bytes asked for; the client hangs up long before 24 MiB',
      outcome: `${exact ? 'the 100 bytes' : `${read.length} bytes, not the range`}; server sent ${(sent / 2 ** 20).toFixed(1)} MiB`,
      ok: exact && sent < 24 << 20,
    });
    expect(read).toEqual(bytes.subarray(1000, 1100));
    expect(sent).toBeLessThan(24 << 20);
  });
});

describe('sourceFromUrl deadlines', () => {
  it('a server that never answers ends in DownloadFailedError after headersTimeoutMs', async () => {
    server = await startFileServer({ bytes: randomBytes(4096, 7), etag: '"v1"', lastModified: null });
    server.behaviour.stallHeaders = true;
    await expectRefusal(
      'a server that never sends headers (headersTimeoutMs 200)',
      sourceFromUrl(server.url, { headersTimeoutMs: 200 }),
      DownloadFailedError,
      /stopped answering \(probe\): no response within 0.2 s/,
    );
  });

  it('a body that stops mid-read ends in DownloadFailedError after chunkTimeoutMs', async () => {
    const bytes = randomBytes(1 << 20, 8);
    server = await startFileServer({ bytes, etag: '"v1"', lastModified: null });
    const source = await sourceFromUrl(server.url, { chunkTimeoutMs: 200 });
    server.behaviour.stallAfterBytes = 300 << 10;
    await expectRefusal(
      'a body that stops after 300 KiB of a 1 MiB read (chunkTimeoutMs 200)',
      source.read(0, 1 << 20),
      DownloadFailedError,
      /stopped answering \(bytes=0-1048575\): no bytes for 0.2 s/,
    );
  });

  it('an abort ends a stalled read with AbortedError', async () => {
    server = await startFileServer({ bytes: randomBytes(4096, 9), etag: '"v1"', lastModified: null });
    const controller = new AbortController();
    const source = await sourceFromUrl(server.url, { signal: controller.signal });
    server.behaviour.stallHeaders = true;
    const read = source.read(0, 10);
    setTimeout(() => controller.abort(), 50);
    await expectRefusal('abort() during a read whose headers never come', read, AbortedError);
  });
});
