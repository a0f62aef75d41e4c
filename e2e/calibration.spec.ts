/**
 * Background KV calibration in the real module worker (Chromium, SwiftShader WebGPU): a load with rotation
 * 'calibrated' and an empty IndexedDB starts on Hadamard, answers a request while it calibrates, stores the fitted
 * rotations in IndexedDB under the model's digest and switches; after a page reload (a new worker, the same
 * origin's IndexedDB) the next load finds them and does not calibrate again.
 */
import { createReadStream, existsSync, statSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { join } from 'node:path';
import { expect, type Page, test } from '@playwright/test';
import { sourceFromPath } from '../runtime/gguf/node-source.ts';
import { parseGguf } from '../runtime/gguf/parse.ts';
import { modelDigest } from '../runtime/kv/rotation-store.ts';
import { STORIES260K, sharedRoot } from '../test/shared.ts';

const modelFile = join(sharedRoot, STORIES260K);
const haveModel = existsSync(modelFile);
if (!haveModel) console.warn(`\n*** SKIPPING calibration.spec.ts: ${modelFile} is missing (set LONGTAB_SHARED). ***\n`);

let server: Server;
let modelUrl = '';

/** Serves the model with Range support and CORS (the page's origin is the vite preview server). */
function serveModel(): Promise<string> {
  const size = statSync(modelFile).size;
  server = createServer((req, res) => {
    res.setHeader('Access-Control-Allow-Origin', '*');
    res.setHeader('Access-Control-Allow-Headers', 'Range');
    res.setHeader('Access-Control-Expose-Headers', 'Content-Range, Content-Length');
    if (req.method === 'OPTIONS') return void res.writeHead(204).end();
    if (req.url !== '/models/stories260K.gguf') return void res.writeHead(404).end();
    const match = /^bytes=(\d+)-(\d+)?$/.exec(req.headers.range ?? '');
    if (!match) {
      res.writeHead(200, { 'Content-Length': size, 'Accept-Ranges': 'bytes' });
      return void (req.method === 'HEAD' ? res.end() : createReadStream(modelFile).pipe(res));
    }
    const start = Number(match[1]);
    const end = Math.min(match[2] === undefined ? size - 1 : Number(match[2]), size - 1);
    res.writeHead(206, { 'Content-Range': `bytes ${start}-${end}/${size}`, 'Content-Length': end - start + 1 });
    createReadStream(modelFile, { start, end }).pipe(res);
  });
  return new Promise((resolve) =>
    server.listen(0, '127.0.0.1', () => resolve(`http://127.0.0.1:${(server.address() as AddressInfo).port}`)),
  );
}

/** stories260K: rows of 32 values; a small sink and window so 2-bit pages are read; a very short calibration text. */
const LOAD = {
  kv: 'int2',
  kvBudgetBytes: 1 << 20,
  rotation: 'calibrated',
  experimental: { sink: 16, window: 16, groupSize: 32, calibrationTokens: 24 },
} as const;

/** The keys and value sizes of longtab's rotation store in this origin's IndexedDB (as idb-keyval lays it out). */
async function storedRotations(page: Page): Promise<Array<{ key: string; bytes: number; version: number }>> {
  return page.evaluate(
    () =>
      new Promise((resolve, reject) => {
        const open = indexedDB.open('longtab-kv-rotations');
        open.onupgradeneeded = () => open.result.createObjectStore('rotations');
        open.onerror = () => reject(open.error);
        open.onsuccess = () => {
          const db = open.result;
          const out: Array<{ key: string; bytes: number; version: number }> = [];
          const cursor = db.transaction('rotations', 'readonly').objectStore('rotations').openCursor();
          cursor.onerror = () => reject(cursor.error);
          cursor.onsuccess = () => {
            const c = cursor.result;
            if (!c) {
              db.close();
              resolve(out);
              return;
            }
            const value = c.value as Uint8Array;
            out.push({
              key: String(c.key),
              bytes: value.byteLength,
              version: new DataView(value.buffer, value.byteOffset).getUint32(4, true),
            });
            c.continue();
          };
        };
      }),
  );
}

test.describe('background KV calibration in the worker (Chromium, IndexedDB)', () => {
  test.skip(!haveModel, 'stories260K is not available');
  test.beforeAll(async () => {
    modelUrl = `${await serveModel()}/models/stories260K.gguf`;
  });
  test.afterAll(() => new Promise<void>((resolve) => (server ? server.close(() => resolve()) : resolve())));

  test('calibrates between requests, stores the result in IndexedDB, and a reload finds it', async ({ page }) => {
    // SwiftShader on two shared cores: the calibration text is one decode submit per token (seconds each under load).
    test.setTimeout(900_000);
    const pageErrors: string[] = [];
    page.on('pageerror', (error) => pageErrors.push(error.message));
    page.on('console', (message) => console.log(`[page] ${message.text()}`));
    await page.goto('/e2e/harness/worker-api.html');
    await page.waitForFunction(() => window.harness !== undefined);
    expect(await storedRotations(page)).toEqual([]);

    const first = await page.evaluate(
      async ({ url, load }) => {
        const engine = window.harness!.createEngine();
        const rotations: string[] = [];
        const phases: string[] = [];
        await engine.subscribeStats((s) => {
          if (rotations.at(-1) !== s.kv.rotation) rotations.push(s.kv.rotation);
          const phase = s.kv.calibration?.phase;
          if (phase && phases.at(-1) !== phase) phases.push(phase);
        });
        await engine.load(url, load);
        const atLoad = (await engine.stats()).kv.rotation;
        // A request while the calibration is under way (it pauses for it).
        const reply = await engine.completions.create({ prompt: '', max_tokens: 4, temperature: 0 });
        let logged = 0;
        for (;;) {
          const s = await engine.stats();
          if (s.kv.rotation === 'calibrated' || s.kv.calibration?.phase === 'failed') break;
          if (performance.now() - logged > 30_000) {
            logged = performance.now();
            console.log(`${Math.round(logged / 1000)} s: ${s.kv.rotation} ${JSON.stringify(s.kv.calibration)}`);
          }
          await new Promise((resolve) => setTimeout(resolve, 200));
        }
        const stats = await engine.stats();
        const after = await engine.completions.create({ prompt: '', max_tokens: 4, temperature: 0 });
        engine.terminate();
        return { atLoad, reply: reply.choices[0].text, stats, rotations, phases, after: after.choices[0].text };
      },
      { url: modelUrl, load: LOAD },
    );
    expect(first.atLoad).toMatch(/^calibrating \d+%$/);
    expect(first.reply.length).toBeGreaterThan(0);
    expect(first.stats.kv.calibration).toMatchObject({ phase: 'done', progress: 1, tokens: 24 });
    expect(first.stats.kv.rotation).toBe('calibrated');
    expect(first.phases).toContain('paused');
    expect(first.rotations.at(-1)).toBe('calibrated');

    // IndexedDB holds one entry, keyed by the model's digest, with clip quantiles (format version 2).
    const source = await sourceFromPath(modelFile);
    const digest = await modelDigest(await parseGguf(source), source);
    await source.close?.();
    const stored = await storedRotations(page);
    expect(stored).toHaveLength(1);
    expect(stored[0]).toMatchObject({ key: digest, version: 2 });

    // Reload: a new worker finds the rotations in IndexedDB and does not calibrate.
    await page.reload();
    await page.waitForFunction(() => window.harness !== undefined);
    const second = await page.evaluate(
      async ({ url, load }) => {
        const engine = window.harness!.createEngine();
        await engine.load(url, load);
        const stats = await engine.stats();
        const reply = await engine.completions.create({ prompt: '', max_tokens: 4, temperature: 0 });
        await new Promise((resolve) => setTimeout(resolve, 500));
        const later = await engine.stats();
        engine.terminate();
        return { stats, later, reply: reply.choices[0].text };
      },
      { url: modelUrl, load: LOAD },
    );
    expect(second.stats.kv.rotation).toBe('calibrated');
    expect(second.stats.kv.calibration).toBeNull();
    expect(second.later.kv.calibration).toBeNull();
    // Stored as f32: the same quantiles up to that rounding.
    expect(second.stats.kv.clip!.key).toBeCloseTo(first.stats.kv.clip!.key, 6);
    expect(second.stats.kv.clip!.value).toBeCloseTo(first.stats.kv.clip!.value, 6);
    expect(second.reply).toBe(first.after);
    expect(await storedRotations(page)).toHaveLength(1);
    expect(pageErrors).toEqual([]);
  });
});
