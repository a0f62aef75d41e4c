/**
 * ByteSource implementations for the browser and tests: a File/Blob, a URL read with HTTP Range requests, and bytes
 * already in memory. Each read fetches only the range asked for, so a multi-gigabyte model is never held whole.
 * The Node file source lives in node-source.ts so browser bundles never see `node:fs`.
 */
import { AbortedError, CorruptModelFileError, DownloadFailedError, InvalidRequestError } from '../../core/errors.ts';
import type { ByteSource } from '../../core/gguf-types.ts';

/**
 * Rejects reads outside [0, size). Callers (the parser, streamTensorBytes) check bounds against the file size first,
 * so reaching this means the file's own offsets point past its end.
 */
export function checkReadRange(source: { name: string; size: number }, offset: number, length: number): void {
  if (!Number.isSafeInteger(offset) || !Number.isSafeInteger(length) || offset < 0 || length < 0) {
    throw new InvalidRequestError(`Invalid read of ${length} bytes at offset ${offset} from ${source.name}.`, {
      offset,
      length,
    });
  }
  if (offset + length > source.size) {
    throw new CorruptModelFileError(
      `${source.name} ends at byte ${source.size} but a read needs bytes ${offset}..${offset + length}: the file is truncated.`,
      { offset, length, size: source.size },
    );
  }
}

/** A source over bytes already in memory (tests, tools, files written by writeGguf). Reads return views, not copies. */
export function sourceFromBytes(bytes: Uint8Array, name = 'in-memory GGUF'): ByteSource {
  return {
    name,
    size: bytes.byteLength,
    async read(offset, length) {
      checkReadRange({ name, size: bytes.byteLength }, offset, length);
      return bytes.subarray(offset, offset + length);
    },
  };
}

/** A source over a File or Blob (file picker, drag and drop, OPFS): each read slices the blob and loads only that slice. */
export function sourceFromBlob(blob: Blob, name?: string): ByteSource {
  const sourceName = name ?? (typeof File !== 'undefined' && blob instanceof File ? blob.name : 'blob');
  return {
    name: sourceName,
    size: blob.size,
    async read(offset, length) {
      checkReadRange({ name: sourceName, size: blob.size }, offset, length);
      let buffer: ArrayBuffer;
      try {
        buffer = await blob.slice(offset, offset + length).arrayBuffer();
      } catch (error) {
        // Browsers fail reads of a File that was modified, moved or deleted after it was picked.
        throw new CorruptModelFileError(
          `${sourceName} could not be read (${error instanceof Error ? error.message : String(error)}). It may have been changed, moved or deleted since it was chosen; pick the file again.`,
        );
      }
      if (buffer.byteLength !== length) {
        throw new CorruptModelFileError(
          `Reading ${length} bytes at offset ${offset} from ${sourceName} returned ${buffer.byteLength}: the file changed or was truncated while loading.`,
        );
      }
      return new Uint8Array(buffer);
    },
  };
}

export interface UrlSourceOptions {
  /** Injected for tests and for callers that wrap fetch (auth headers, caching); defaults to globalThis.fetch. */
  fetch?: typeof fetch;
  signal?: AbortSignal;
}

/**
 * A source over a URL that serves HTTP Range requests (Hugging Face, most CDNs, `vite` and `npx serve`).
 * The size comes from a one-byte Range probe (`Content-Range: bytes 0-0/SIZE`), which also proves the server honours
 * ranges; HEAD is only a fallback because compressed responses often omit Content-Length there.
 */
export async function sourceFromUrl(url: string, options: UrlSourceOptions = {}): Promise<ByteSource> {
  const fetchImpl = options.fetch ?? globalThis.fetch;
  const signal = options.signal;
  const probe = await fetchOrThrow(fetchImpl, url, { headers: { Range: 'bytes=0-0' }, signal }, 'probe');
  let size: number | null = null;
  if (probe.status === 206) {
    size = totalFromContentRange(probe.headers.get('Content-Range'));
    await discardBody(probe);
  } else {
    await discardBody(probe);
    if (probe.ok) {
      throw new DownloadFailedError(
        `${url} answered a Range request with HTTP ${probe.status} instead of 206: the server does not support Range requests, which loading a model in pieces needs. Serve the file from a server that does (most static servers and CDNs do), or pick the file from disk.`,
        { url, status: probe.status },
      );
    }
    throw httpError(url, probe.status, 'probe');
  }
  if (size === null) {
    const head = await fetchOrThrow(fetchImpl, url, { method: 'HEAD', signal }, 'HEAD');
    await discardBody(head);
    const length = Number(head.headers.get('Content-Length'));
    if (!head.ok || !Number.isSafeInteger(length) || length <= 0) {
      throw new DownloadFailedError(
        `Could not learn the size of ${url}: neither Content-Range nor Content-Length was usable (HTTP ${head.status}).`,
        { url, status: head.status },
      );
    }
    size = length;
  }
  const fileSize = size;
  const name = nameFromUrl(url);

  return {
    name,
    size: fileSize,
    async read(offset, length) {
      checkReadRange({ name, size: fileSize }, offset, length);
      if (length === 0) return new Uint8Array(0);
      const range = `bytes=${offset}-${offset + length - 1}`;
      const response = await fetchOrThrow(fetchImpl, url, { headers: { Range: range }, signal }, range);
      if (response.status !== 206) {
        await discardBody(response);
        throw httpError(url, response.status, range);
      }
      const servedStart = startFromContentRange(response.headers.get('Content-Range'));
      if (servedStart !== null && servedStart !== offset) {
        await discardBody(response);
        throw new DownloadFailedError(
          `${url} answered ${range} with bytes starting at ${servedStart}: the server or a proxy mangled the Range request.`,
          { url, range, servedStart },
        );
      }
      let buffer: ArrayBuffer;
      try {
        buffer = await response.arrayBuffer();
      } catch (error) {
        throw networkError(url, range, error, signal);
      }
      if (buffer.byteLength !== length) {
        throw new DownloadFailedError(
          `${url} returned ${buffer.byteLength} bytes for ${range} (expected ${length}): the download was cut short or the file changed on the server. Try again.`,
          { url, range, received: buffer.byteLength },
        );
      }
      return new Uint8Array(buffer);
    },
  };
}

async function fetchOrThrow(fetchImpl: typeof fetch, url: string, init: RequestInit, what: string): Promise<Response> {
  try {
    return await fetchImpl(url, init);
  } catch (error) {
    throw networkError(url, what, error, init.signal ?? undefined);
  }
}

function networkError(url: string, what: string, cause: unknown, signal: AbortSignal | undefined): Error {
  if (signal?.aborted) return new AbortedError(`Loading ${url} was aborted.`);
  const reason = cause instanceof Error ? cause.message : String(cause);
  return new DownloadFailedError(
    `Network error while reading ${url} (${what}): ${reason}. Check the connection and that the server allows this origin (CORS), then try again.`,
    { url, what, cause: reason },
  );
}

function httpError(url: string, status: number, what: string): DownloadFailedError {
  const hint =
    status === 404
      ? ' The file does not exist at that address.'
      : status === 401 || status === 403
        ? ' The server refused access; the model may need a login or an access token.'
        : status === 416
          ? ' The server says the range lies outside the file; the file may have changed.'
          : '';
  return new DownloadFailedError(`${url} answered HTTP ${status} for ${what}.${hint}`, { url, status, what });
}

/** Parses the total out of `bytes 0-0/12345`; null when absent or `*`. */
function totalFromContentRange(header: string | null): number | null {
  const match = header ? /\/\s*(\d+)\s*$/.exec(header) : null;
  if (!match) return null;
  const total = Number(match[1]);
  return Number.isSafeInteger(total) && total > 0 ? total : null;
}

/** Parses the start out of `bytes 100-199/12345`; null when absent. */
function startFromContentRange(header: string | null): number | null {
  const match = header ? /^\s*bytes\s+(\d+)-/.exec(header) : null;
  return match ? Number(match[1]) : null;
}

/** Frees the connection; a server that ignored Range would otherwise go on sending the whole file. */
async function discardBody(response: Response): Promise<void> {
  try {
    await response.body?.cancel();
  } catch {
    // Nothing to free.
  }
}

function nameFromUrl(url: string): string {
  try {
    const path = new URL(url, 'http://localhost/').pathname;
    return decodeURIComponent(path.slice(path.lastIndexOf('/') + 1)) || url;
  } catch {
    return url;
  }
}
