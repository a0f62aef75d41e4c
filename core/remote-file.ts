/**
 * Reading one file over HTTP in several requests, as the engine's URL source (runtime/gguf/sources.ts) and the page's
 * resumable download (app/storage/models.ts) both do. Each request must get bytes of the same file as the first:
 * later requests send `If-Range` with the first response's validator, and each response's `Content-Range` total and
 * ETag / Last-Modified are compared with the first's. Every request has a deadline for its headers and one per body
 * chunk, so a server that stops sending ends in a DownloadFailedError instead of a wait with no end.
 */
import { AbortedError, DownloadFailedError } from './errors.ts';

/** Defaults for RemoteTimeouts: long enough for a slow hub's first byte, short enough that a dead one is noticed. */
export const DEFAULT_HEADERS_TIMEOUT_MS = 30_000;
export const DEFAULT_CHUNK_TIMEOUT_MS = 30_000;

export interface RemoteTimeouts {
  /** Longest wait for a response's status and headers (ms; default 30 000). */
  headersTimeoutMs?: number;
  /** Longest wait for each chunk of a response's body (ms; default 30 000). */
  chunkTimeoutMs?: number;
}

/** Which version of the file a response carries: its ETag and Last-Modified, as the server sent them. */
export interface RemoteFileVersion {
  etag: string | null;
  lastModified: string | null;
}

export function versionOf(headers: Headers): RemoteFileVersion {
  return { etag: headers.get('ETag'), lastModified: headers.get('Last-Modified') };
}

/**
 * The `If-Range` value for later requests: a strong ETag, else Last-Modified. A weak ETag (`W/"…"`) may not be used
 * there (a server must then always send the whole file); such a file is still checked by comparing ETags.
 */
export function ifRangeOf(version: RemoteFileVersion): string | null {
  if (version.etag && !version.etag.startsWith('W/')) return version.etag;
  return version.lastModified;
}

/**
 * Whether a response is of the same file version as `first`: an ETag both carry must match (but for what compression
 * adds to it: etagCore), else a Last-Modified both carry. A response that carries neither cannot be told apart (the Content-Range total is still checked).
 */
export function sameVersion(first: RemoteFileVersion, headers: Headers): boolean {
  const now = versionOf(headers);
  if (first.etag !== null && now.etag !== null) return etagCore(first.etag) === etagCore(now.etag);
  if (first.lastModified !== null && now.lastModified !== null) return first.lastModified === now.lastModified;
  return true;
}

/**
 * An ETag without what compression adds to it: servers weaken it (nginx's gzip: `W/"x"`) or suffix it (Apache's
 * mod_deflate: `"x-gzip"`) on a compressed body, which a Range request for the same file never gets.
 */
function etagCore(etag: string): string {
  return etag.replace(/^W\//, '').replace(/-(gzip|br|deflate|zstd)"$/, '"');
}

/** A body sent with a Content-Encoding (gzip, br): its Content-Length counts the compressed bytes, not the file's. */
export function isContentEncoded(headers: Headers): boolean {
  const encoding = headers.get('Content-Encoding')?.trim().toLowerCase();
  return !!encoding && encoding !== 'identity';
}

export interface ContentRange {
  start: number;
  end: number;
  /** The whole file's size; null for `*`. */
  total: number | null;
}

/** Parses `bytes 100-199/12345` (or `/*`); null when absent or malformed. */
export function parseContentRange(header: string | null): ContentRange | null {
  const match = header ? /^\s*bytes\s+(\d+)-(\d+)\s*\/\s*(\d+|\*)\s*$/i.exec(header) : null;
  if (!match) return null;
  const total = match[3] === '*' ? null : Number(match[3]);
  return {
    start: Number(match[1]),
    end: Number(match[2]),
    total: total !== null && Number.isSafeInteger(total) ? total : null,
  };
}

/** The total of a Content-Range, including the `bytes *\/12345` a 416 carries; null when absent or `*`. */
export function totalOfContentRange(header: string | null): number | null {
  const match = header ? /\/\s*(\d+)\s*$/.exec(header) : null;
  if (!match) return null;
  const total = Number(match[1]);
  return Number.isSafeInteger(total) ? total : null;
}

export interface RemoteRequestInit {
  headers?: Record<string, string>;
  method?: string;
  cache?: RequestCache;
  /** The caller's signal: its abort ends the request with an AbortedError. */
  signal?: AbortSignal;
  /** What the request is for, in error messages ("bytes=0-99", "probe"). */
  what: string;
}

/** An open response whose body is read under the chunk deadline; `cancel` frees the connection. */
export interface RemoteResponse {
  readonly response: Response;
  /**
   * Hands each chunk of the body to `take` until the body ends or `take` returns false (the rest is then cancelled,
   * so a server that sends more than was asked is never buffered whole).
   */
  readChunks(take: (chunk: Uint8Array) => boolean | Promise<boolean>): Promise<void>;
  /** The body's first `limit` bytes at most, cancelling the rest. */
  readUpTo(limit: number): Promise<Uint8Array>;
  cancel(): Promise<void>;
}

/**
 * Fetches with a deadline on the headers and, through the returned reader, on each chunk of the body. A deadline
 * passed or a network failure is a DownloadFailedError naming the URL; the caller's abort is an AbortedError.
 */
export async function fetchRemote(
  fetchImpl: typeof fetch,
  url: string,
  init: RemoteRequestInit,
  timeouts: RemoteTimeouts = {},
): Promise<RemoteResponse> {
  const headersMs = timeouts.headersTimeoutMs ?? DEFAULT_HEADERS_TIMEOUT_MS;
  const chunkMs = timeouts.chunkTimeoutMs ?? DEFAULT_CHUNK_TIMEOUT_MS;
  const controller = new AbortController();
  const outer = init.signal;
  const forward = () => controller.abort(outer?.reason);
  if (outer?.aborted) throw new AbortedError(`Reading ${url} was aborted.`);
  outer?.addEventListener('abort', forward, { once: true });
  let stalled: string | null = null;
  const fail = (cause: unknown): Error => {
    if (outer?.aborted) return new AbortedError(`Reading ${url} was aborted.`);
    if (stalled !== null) {
      return new DownloadFailedError(
        `${url} stopped answering (${init.what}): ${stalled}. The server or the connection stalled; try again later.`,
        { url, what: init.what, timeout: true },
      );
    }
    const reason = cause instanceof Error ? cause.message : String(cause);
    return new DownloadFailedError(
      `Network error while reading ${url} (${init.what}): ${reason}. Check the connection and that the server allows this origin (CORS), then try again.`,
      { url, what: init.what, cause: reason },
    );
  };
  const release = () => outer?.removeEventListener('abort', forward);

  let response: Response;
  const headersTimer = setTimeout(() => {
    stalled = `no response within ${headersMs / 1000} s`;
    controller.abort();
  }, headersMs);
  try {
    response = await fetchImpl(url, {
      method: init.method,
      headers: init.headers,
      cache: init.cache,
      signal: controller.signal,
    });
  } catch (error) {
    release();
    throw fail(error);
  } finally {
    clearTimeout(headersTimer);
  }

  let done = false;
  const cancel = async () => {
    if (done) return;
    done = true;
    release();
    try {
      await response.body?.cancel();
    } catch {
      // Nothing to free.
    }
    controller.abort();
  };

  const readChunks = async (take: (chunk: Uint8Array) => boolean | Promise<boolean>) => {
    if (!response.body) {
      done = true;
      release();
      return;
    }
    const reader = response.body.getReader();
    try {
      for (;;) {
        let timer: ReturnType<typeof setTimeout> | undefined;
        const deadline = new Promise<never>((_, reject) => {
          timer = setTimeout(() => {
            stalled = `no bytes for ${chunkMs / 1000} s`;
            controller.abort();
            reject(new Error('chunk deadline'));
          }, chunkMs);
        });
        let next: ReadableStreamReadResult<Uint8Array>;
        try {
          next = await Promise.race([reader.read(), deadline]);
        } catch (error) {
          throw fail(error);
        } finally {
          clearTimeout(timer);
        }
        if (next.done) break;
        // An error of `take` (a full disk) goes to the caller as it is.
        if (!(await take(next.value))) {
          await reader.cancel().catch(() => {});
          controller.abort();
          break;
        }
      }
    } catch (error) {
      reader.cancel().catch(() => {});
      controller.abort();
      throw error;
    } finally {
      done = true;
      release();
    }
  };

  const readUpTo = async (limit: number) => {
    const out = new Uint8Array(limit);
    let filled = 0;
    await readChunks((chunk) => {
      const n = Math.min(chunk.byteLength, limit - filled);
      out.set(chunk.subarray(0, n), filled);
      filled += n;
      return filled < limit;
    });
    return filled === limit ? out : out.subarray(0, filled);
  };

  return { response, readChunks, readUpTo, cancel };
}
