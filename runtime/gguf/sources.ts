/**
 * ByteSource implementations for the browser and tests: a File/Blob, a URL read with HTTP Range requests, and bytes
 * already in memory. Each read fetches only the range asked for, so a multi-gigabyte model is never held whole.
 * The Node file source lives in node-source.ts so browser bundles never see `node:fs`.
 */
import { AbortedError, CorruptModelFileError, DownloadFailedError, InvalidRequestError } from '../../core/errors.ts';
import type { ByteSource, ByteSourcePart } from '../../core/gguf-types.ts';
import {
  fetchRemote,
  ifRangeOf,
  isContentEncoded,
  parseContentRange,
  type RemoteTimeouts,
  sameVersion,
  totalOfContentRange,
  versionOf,
} from '../../core/remote-file.ts';
import { openShards } from './split.ts';

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

/**
 * One source over `sources` joined end to end (the shards of a split model, runtime/gguf/split.ts), named after the
 * first: a read goes to the source that holds it, and one across sources (which no tensor read is) is put together.
 */
export function joinSources(sources: readonly ByteSource[]): ByteSource {
  const parts: ByteSourcePart[] = [];
  let size = 0;
  for (const s of sources) {
    parts.push({ name: s.name, offset: size, size: s.size });
    size += s.size;
  }
  const name = sources[0]?.name ?? 'no files';
  return {
    name,
    size,
    parts,
    async read(offset, length) {
      checkReadRange({ name, size }, offset, length);
      const pieces: Uint8Array[] = [];
      for (let i = 0, at = offset, end = offset + length; at < end; i++) {
        const part = parts[i];
        const take = Math.min(end, part.offset + part.size) - at;
        if (take <= 0) continue;
        pieces.push(await sources[i].read(at - part.offset, take));
        at += take;
      }
      if (pieces.length === 1) return pieces[0];
      const joined = new Uint8Array(length);
      let filled = 0;
      for (const piece of pieces) {
        joined.set(piece, filled);
        filled += piece.byteLength;
      }
      return joined;
    },
    async close() {
      await Promise.all(sources.map((s) => s.close?.()));
    },
  };
}

/**
 * `source` whose reads fail with an AbortedError once `signal` aborts: a load (parse, weight upload) stops at its
 * next read, whatever the source.
 */
export function abortableSource(source: ByteSource, signal: AbortSignal): ByteSource {
  return {
    name: source.name,
    size: source.size,
    async read(offset, length) {
      if (signal.aborted) throw new AbortedError(`Loading ${source.name} was aborted.`);
      return source.read(offset, length);
    },
    close: source.close && (() => source.close!()),
    ...(source.parts ? { parts: source.parts } : {}),
  };
}

export interface UrlSourceOptions extends RemoteTimeouts {
  /** Injected for callers that wrap fetch (auth headers, caching); defaults to globalThis.fetch. */
  fetch?: typeof fetch;
  signal?: AbortSignal;
}

/**
 * A source over a URL that serves HTTP Range requests (Hugging Face, most CDNs, `vite` and `npx serve`). A URL whose
 * file is named as a shard of a split model (`NAME-00001-of-00003.gguf`) opens every shard beside it, by the same
 * names, and joins them (joinSources); a shard that cannot be opened fails the open naming it.
 */
export async function sourceFromUrl(url: string, options: UrlSourceOptions = {}): Promise<ByteSource> {
  const shards = await openShards(nameFromUrl(url), async (shard, index, count) => {
    const shardUrl = withFileName(url, shard);
    try {
      return await sourceFromOneUrl(shardUrl, options);
    } catch (error) {
      if (!(error instanceof DownloadFailedError)) throw error;
      throw new DownloadFailedError(
        `Part ${index} of ${count} of the split model could not be opened: ${error.message} A split GGUF model loads from all of its parts, served side by side under the names llama.cpp's gguf-split gives them.`,
        { ...error.details, url: shardUrl, shard: index, shards: count },
      );
    }
  });
  return shards ? joinSources(shards) : sourceFromOneUrl(url, options);
}

/** `url` with its last path segment (the file name) replaced by `name`, its query and fragment kept. */
function withFileName(url: string, name: string): string {
  const cut = url.search(/[?#]/);
  const path = cut < 0 ? url : url.slice(0, cut);
  return `${path.slice(0, path.lastIndexOf('/') + 1)}${encodeURIComponent(name)}${cut < 0 ? '' : url.slice(cut)}`;
}

/**
 * One file over HTTP Range requests.
 * The size comes from a one-byte Range probe (`Content-Range: bytes 0-0/SIZE`), which also proves the server honours
 * ranges; HEAD is only a fallback because compressed responses often omit Content-Length there.
 * Every read asks for the probe's version of the file (`If-Range` with its ETag or Last-Modified) and checks the
 * response's Content-Range and version, so a file replaced on the server mid-load fails with a DownloadFailedError
 * instead of splicing two files. Each request has the deadlines of `RemoteTimeouts` (30 s by default).
 */
async function sourceFromOneUrl(url: string, options: UrlSourceOptions): Promise<ByteSource> {
  const fetchImpl = options.fetch ?? globalThis.fetch;
  const signal = options.signal;
  const timeouts: RemoteTimeouts = {
    headersTimeoutMs: options.headersTimeoutMs,
    chunkTimeoutMs: options.chunkTimeoutMs,
  };
  // Browsers send `Accept-Encoding: identity` with every Range request themselves (and drop this header); Node's
  // fetch does not, and a range of a compressed body is not a range of the file.
  const identity = { 'Accept-Encoding': 'identity' };
  const probe = await fetchRemote(
    fetchImpl,
    url,
    { headers: { ...identity, Range: 'bytes=0-0' }, signal, what: 'probe' },
    timeouts,
  );
  await probe.cancel();
  if (probe.response.status !== 206) {
    if (probe.response.ok) {
      throw new DownloadFailedError(
        `${url} answered a Range request with HTTP ${probe.response.status} instead of 206: the server does not support Range requests, which loading a model in pieces needs. Serve the file from a server that does (most static servers and CDNs do), or pick the file from disk.`,
        { url, status: probe.response.status },
      );
    }
    throw httpError(url, probe.response.status, 'probe');
  }
  const version = versionOf(probe.response.headers);
  const ifRange = ifRangeOf(version);
  let size = totalOfContentRange(probe.response.headers.get('Content-Range'));
  if (size === null || size <= 0) {
    const head = await fetchRemote(
      fetchImpl,
      url,
      { method: 'HEAD', headers: identity, signal, what: 'HEAD' },
      timeouts,
    );
    await head.cancel();
    const length = Number(head.response.headers.get('Content-Length'));
    if (!head.response.ok || isContentEncoded(head.response.headers) || !Number.isSafeInteger(length) || length <= 0) {
      throw new DownloadFailedError(
        `Could not learn the size of ${url}: neither Content-Range nor Content-Length was usable (HTTP ${head.response.status}).`,
        { url, status: head.response.status },
      );
    }
    size = length;
  }
  const fileSize = size;
  const name = nameFromUrl(url);
  const changed = (range: string, how: string) =>
    new DownloadFailedError(
      `${url} changed on the server while it was loading (${how} for ${range}). Nothing of the new file was used; load the model again.`,
      { url, range, changed: true },
    );

  return {
    name,
    size: fileSize,
    async read(offset, length) {
      checkReadRange({ name, size: fileSize }, offset, length);
      if (length === 0) return new Uint8Array(0);
      const range = `bytes=${offset}-${offset + length - 1}`;
      const headers: Record<string, string> = { ...identity, Range: range };
      if (ifRange) headers['If-Range'] = ifRange;
      const request = await fetchRemote(fetchImpl, url, { headers, signal, what: range }, timeouts);
      const { response } = request;
      if (response.status !== 206) {
        await request.cancel();
        // With If-Range, a server whose file no longer matches sends the whole new file.
        if (response.ok && ifRange) throw changed(range, `HTTP ${response.status} instead of 206 to If-Range`);
        throw httpError(url, response.status, range);
      }
      const served = parseContentRange(response.headers.get('Content-Range'));
      if (served?.total != null && served.total !== fileSize) {
        await request.cancel();
        throw changed(range, `it is now ${served.total} bytes, not ${fileSize}`);
      }
      if (!sameVersion(version, response.headers)) {
        await request.cancel();
        throw changed(range, 'another ETag or Last-Modified');
      }
      if (served && served.start !== offset) {
        await request.cancel();
        throw new DownloadFailedError(
          `${url} answered ${range} with bytes starting at ${served.start}: the server or a proxy mangled the Range request.`,
          { url, range, servedStart: served.start },
        );
      }
      // A body longer than the range is cut at the range, never buffered whole.
      const bytes = await request.readUpTo(length);
      if (bytes.byteLength !== length) {
        throw new DownloadFailedError(
          `${url} returned ${bytes.byteLength} bytes for ${range} (expected ${length}): the download was cut short or the file changed on the server. Try again.`,
          { url, range, received: bytes.byteLength },
        );
      }
      return bytes;
    },
  };
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

function nameFromUrl(url: string): string {
  try {
    const path = new URL(url, 'http://localhost/').pathname;
    return decodeURIComponent(path.slice(path.lastIndexOf('/') + 1)) || url;
  } catch {
    return url;
  }
}
