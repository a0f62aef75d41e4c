/**
 * engine.load(url) against a real HTTP server serving stories260K (test/http-file-server.ts): a stalled server ends
 * the load with a DownloadFailedError after the load's network deadlines, abort() and unload() end a load in progress,
 * and the request queue moves on to the next load each time (issue 39, point 4).
 */
import { readFileSync } from 'node:fs';
import { afterEach, describe, expect, it } from 'vitest';
import { AbortedError, DownloadFailedError } from '../../core/errors.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { type FileServer, startFileServer } from '../../test/http-file-server.ts';
import { describeRefusal, faultLog, isRefusal, rejectionOf } from '../../test/regressions/fault-log.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import type { LoadProgress } from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const log = faultLog('load-network');

let server: FileServer | null = null;
afterEach(async () => {
  await server?.close();
  server = null;
});

/** Resolves once the load has its source open (the size probe answered): the next reads are the ones that stall. */
function downloadStarted(): { onProgress: (p: LoadProgress) => void; started: Promise<void> } {
  let resolve = () => {};
  const started = new Promise<void>((r) => {
    resolve = r;
  });
  return {
    onProgress: (p) => {
      if (p.phase === 'download' && p.bytesTotal > 0) resolve();
    },
    started,
  };
}

describe.skipIf(!modelPath)('engine.load(url) never wedges the engine', () => {
  const options = { kv: 'f16', kvBudgetBytes: 4 << 20 } as const;

  it('a server that stops sending ends the load with DownloadFailedError after network.chunkTimeoutMs; the next load runs', async () => {
    server = await startFileServer({ bytes: readFileSync(modelPath!), etag: '"s1"', lastModified: null });
    const engine = createNodeEngine({ gpu: ctx.gpu });
    try {
      // The probe's one byte goes out; every later body stops after 1 KiB.
      server.behaviour.stallAfterBytes = 1024;
      const error = await rejectionOf(
        engine.load(server.url, { ...options, network: { headersTimeoutMs: 300, chunkTimeoutMs: 300 } }),
      );
      const message = /model.gguf stopped answering \(bytes=.*\): no bytes for 0.3 s/;
      const model = (await engine.stats()).model;
      log.record({
        area: 'load',
        fault: 'engine.load(url) of stories260K from a server whose bodies stop after 1 KiB (chunkTimeoutMs 300)',
        expected: 'DownloadFailedError saying so; no model loaded',
        outcome: `${describeRefusal(error, message)}; ${model === null ? 'no model' : 'a model loaded'}`,
        ok: isRefusal(error, DownloadFailedError, message) && model === null,
      });
      expect(error).toBeInstanceOf(DownloadFailedError);
      expect((error as Error).message).toMatch(message);
      expect(model).toBeNull();

      server.behaviour.stallAfterBytes = null;
      const info = await engine.load(server.url, options);
      log.record({
        area: 'load',
        fault: 'the next engine.load(url) on the same engine, the server healthy again',
        expected: 'loads',
        outcome: `loaded, ${info.layers} layers`,
        ok: info.layers > 0,
      });
      expect(info.layers).toBeGreaterThan(0);
    } finally {
      engine.destroy();
    }
  });

  it('a server that sends no headers ends the load after network.headersTimeoutMs', async () => {
    server = await startFileServer({ bytes: readFileSync(modelPath!), etag: '"s1"', lastModified: null });
    server.behaviour.stallHeaders = true;
    const engine = createNodeEngine({ gpu: ctx.gpu });
    try {
      const error = await rejectionOf(engine.load(server.url, { ...options, network: { headersTimeoutMs: 300 } }));
      const message = /stopped answering \(probe\): no response within 0.3 s/;
      log.record({
        area: 'load',
        fault: 'engine.load(url) from a server that never sends headers (headersTimeoutMs 300)',
        expected: 'DownloadFailedError saying so',
        outcome: describeRefusal(error, message),
        ok: isRefusal(error, DownloadFailedError, message),
      });
      expect((error as Error).message).toMatch(message);
    } finally {
      engine.destroy();
    }
  });

  for (const stop of ['abort', 'unload'] as const) {
    it(`${stop}() ends a load stalled on the network (default deadlines) with AbortedError; the next load runs`, async () => {
      server = await startFileServer({ bytes: readFileSync(modelPath!), etag: '"s1"', lastModified: null });
      server.behaviour.stallAfterBytes = 1024;
      const engine = createNodeEngine({ gpu: ctx.gpu });
      try {
        const { onProgress, started } = downloadStarted();
        const stalled = engine.load(server.url, { ...options, onProgress });
        const outcome = stalled.then(
          () => null,
          (error: unknown) => error,
        );
        // A second load waits in the queue behind the stalled one: it is ended too, before it starts.
        const queued = rejectionOf(engine.load(server.url, options));
        await started;
        await new Promise((resolve) => setTimeout(resolve, 100));
        await engine[stop]();
        const error = await outcome;
        const queuedError = await queued;
        const model = (await engine.stats()).model;
        server.behaviour.stallAfterBytes = null;
        const next = await rejectionOf(engine.load(server.url, options));
        log.record({
          area: 'load',
          fault: `${stop}() during engine.load(url) stalled on the network (default 30 s deadlines)`,
          expected:
            'AbortedError without waiting out the deadlines, for the queued load too; no model loaded; the next load on the same engine runs',
          outcome: `${describeRefusal(error)}; the load queued behind it: ${describeRefusal(queuedError)}; ${model === null ? 'no model' : 'a model loaded'}; next load ${next === null ? 'loaded' : describeRefusal(next)}`,
          ok: isRefusal(error, AbortedError) && isRefusal(queuedError, AbortedError) && model === null && next === null,
        });
        expect(error).toBeInstanceOf(AbortedError);
        expect(queuedError).toBeInstanceOf(AbortedError);
        expect(model).toBeNull();
        expect(next).toBeNull();
        expect((await engine.stats()).model).not.toBeNull();
      } finally {
        engine.destroy();
      }
    });
  }
});
