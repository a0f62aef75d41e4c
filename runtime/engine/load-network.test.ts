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
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import type { LoadProgress } from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);

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
      const stalled = engine.load(server.url, { ...options, network: { headersTimeoutMs: 300, chunkTimeoutMs: 300 } });
      await expect(stalled).rejects.toBeInstanceOf(DownloadFailedError);
      await expect(stalled).rejects.toThrow(/model.gguf stopped answering \(bytes=.*\): no bytes for 0.3 s/);
      expect((await engine.stats()).model).toBeNull();

      server.behaviour.stallAfterBytes = null;
      const info = await engine.load(server.url, options);
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
      const stalled = engine.load(server.url, { ...options, network: { headersTimeoutMs: 300 } });
      await expect(stalled).rejects.toThrow(/stopped answering \(probe\): no response within 0.3 s/);
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
        await started;
        await new Promise((resolve) => setTimeout(resolve, 100));
        await engine[stop]();
        expect(await outcome).toBeInstanceOf(AbortedError);
        expect((await engine.stats()).model).toBeNull();

        server.behaviour.stallAfterBytes = null;
        expect((await engine.load(server.url, options)).layers).toBeGreaterThan(0);
      } finally {
        engine.destroy();
      }
    });
  }
});
