/**
 * A real HTTP server (node:http on 127.0.0.1) serving one file the way static hosts and CDNs do: Range requests,
 * ETag and Last-Modified, If-Range. Tests swap the file and switch on the ways real servers misbehave (ignoring
 * If-Range, sending past the end of a range, gzip with a compressed Content-Length, stalling) and read back which
 * requests arrived and how many body bytes went out before the client hung up.
 */
import { createServer, type IncomingHttpHeaders, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { gzipSync } from 'node:zlib';

export interface ServedFile {
  bytes: Uint8Array;
  /** Sent as ETag (quoted by the caller: `"v1"`, `W/"v1"`); null sends none. */
  etag: string | null;
  /** Sent as Last-Modified; null sends none. */
  lastModified: string | null;
}

export interface FileServerBehaviour {
  /** Honour If-Range (a mismatch sends the whole current file with 200); false ignores the header. */
  honourIfRange: boolean;
  /** Serve Range requests; false answers every GET with 200 and the whole file. */
  ranges: boolean;
  /** Answer a bounded range with everything from its start to the end of the file (a server that ignores the end). */
  ignoreRangeEnd: boolean;
  /** Gzip 200 responses when the client accepts it, with the compressed Content-Length (as compression middleware). */
  gzip: boolean;
  /** Send no headers at all (the request hangs). */
  stallHeaders: boolean;
  /** Send the headers and this many body bytes, then nothing more (null: send everything). */
  stallAfterBytes: number | null;
  /** Cut the connection after this many body bytes of the next full (200) or open-ended response (once). */
  dropAfterBytes: number | null;
}

export interface FileServer {
  url: string;
  file: ServedFile;
  behaviour: FileServerBehaviour;
  /** Headers of each request, in order. */
  requests: IncomingHttpHeaders[];
  /** Body bytes written per response, in order (only what the socket accepted before the client went away). */
  bodyBytesSent: number[];
  close(): Promise<void>;
}

export async function startFileServer(file: ServedFile, name = 'model.gguf'): Promise<FileServer> {
  const sockets = new Set<import('node:net').Socket>();
  const state: FileServer = {
    url: '',
    file,
    behaviour: {
      honourIfRange: true,
      ranges: true,
      ignoreRangeEnd: false,
      gzip: false,
      stallHeaders: false,
      stallAfterBytes: null,
      dropAfterBytes: null,
    },
    requests: [],
    bodyBytesSent: [],
    close: async () => {
      for (const socket of sockets) socket.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
  const server: Server = createServer((req, res) => {
    state.requests.push(req.headers);
    const b = state.behaviour;
    if (b.stallHeaders) return;
    const { bytes, etag, lastModified } = state.file;
    const common: Record<string, string> = { 'Accept-Ranges': 'bytes', 'Content-Type': 'application/octet-stream' };
    if (etag) common.ETag = etag;
    if (lastModified) common['Last-Modified'] = lastModified;

    const range = /^bytes=(\d+)-(\d*)$/.exec(req.headers.range ?? '');
    const ifRange = req.headers['if-range'];
    const current = ifRange === undefined || ifRange === etag || ifRange === lastModified;
    if (!range || !b.ranges || (b.honourIfRange && !current)) {
      if (b.gzip && /gzip/.test(String(req.headers['accept-encoding'] ?? ''))) {
        const body = gzipSync(bytes);
        res.writeHead(200, { ...common, 'Content-Encoding': 'gzip', 'Content-Length': body.byteLength });
        send(res, body, req.method === 'HEAD');
        return;
      }
      res.writeHead(200, { ...common, 'Content-Length': bytes.byteLength });
      send(res, bytes, req.method === 'HEAD');
      return;
    }
    const start = Number(range[1]);
    if (start >= bytes.byteLength) {
      res.writeHead(416, { ...common, 'Content-Range': `bytes */${bytes.byteLength}` });
      res.end();
      return;
    }
    const asked = range[2] === '' ? bytes.byteLength - 1 : Math.min(Number(range[2]), bytes.byteLength - 1);
    const end = b.ignoreRangeEnd ? bytes.byteLength - 1 : asked;
    res.writeHead(206, {
      ...common,
      'Content-Range': `bytes ${start}-${end}/${bytes.byteLength}`,
      'Content-Length': end - start + 1,
    });
    send(res, bytes.subarray(start, end + 1), req.method === 'HEAD', range[2] === '');
  });

  /** Writes in 64 KiB pieces, waiting for the socket to drain, so what was sent is what the client took. */
  function send(res: ServerResponse, body: Uint8Array, headOnly: boolean, openEnded = true): void {
    const index = state.bodyBytesSent.push(0) - 1;
    if (headOnly) {
      res.end();
      return;
    }
    const b = state.behaviour;
    const stallAt = b.stallAfterBytes;
    let dropAt: number | null = null;
    if (openEnded && b.dropAfterBytes !== null) {
      dropAt = b.dropAfterBytes;
      b.dropAfterBytes = null;
    }
    let offset = 0;
    const pump = () => {
      while (offset < body.byteLength) {
        if (stallAt !== null && offset >= stallAt) return; // headers and some bytes out, then silence
        if (dropAt !== null && offset >= dropAt) {
          res.socket?.destroy();
          return;
        }
        let limit = offset + 64 * 1024;
        if (stallAt !== null) limit = Math.min(limit, stallAt);
        if (dropAt !== null) limit = Math.min(limit, dropAt);
        const piece = body.subarray(offset, Math.min(limit, body.byteLength));
        offset += piece.byteLength;
        state.bodyBytesSent[index] = offset;
        if (!res.write(piece)) {
          res.once('drain', pump);
          return;
        }
      }
      res.end();
    };
    res.on('error', () => {});
    pump();
  }

  server.on('connection', (socket) => {
    sockets.add(socket);
    socket.on('close', () => sockets.delete(socket));
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  state.url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/${name}`;
  return state;
}
