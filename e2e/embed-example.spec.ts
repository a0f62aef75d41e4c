/**
 * examples/embed.html, the README's complete embedding page (issue 38, point 4), in Chromium (SwiftShader WebGPU): as
 * its comment says to run it, from a static server over the repository root with the library built into dist-lib/.
 * With no ?model it runs the demo model from the same server (no hub, nothing off this machine); a load that fails
 * says why on the page. The library is built here into a folder of this test's own, served as /dist-lib/. The README's
 * embedding snippet runs as pasted too, its hub URL answered from the demo file.
 */
import { execFileSync } from 'node:child_process';
import { createReadStream, existsSync, mkdtempSync, readFileSync, rmSync, statSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { extname, join, normalize, resolve, sep } from 'node:path';
import { expect, test } from '@playwright/test';

const repoRoot = resolve('.');
const haveDemo = existsSync(join(repoRoot, 'public/models/longtab-demo.gguf'));
const PROMPT = 'It is a truth universally acknowledged';

const TYPES: Record<string, string> = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript',
  '.map': 'application/json',
  '.wasm': 'application/wasm',
};

let libDir = '';
/** The page the README snippet test serves at /readme-snippet.html. */
let snippetPage = '';
let server: Server;
let origin = '';

/** Files under `root` (a path of the URL that leaves it is refused), with Range support as a static host gives. */
function fileFor(url: string): string | null {
  const path = decodeURIComponent(new URL(url, 'http://localhost').pathname);
  const [root, rest] = path.startsWith('/dist-lib/') ? [libDir, path.slice('/dist-lib'.length)] : [repoRoot, path];
  const file = join(root, normalize(rest));
  if (!file.startsWith(root + sep) || !existsSync(file) || statSync(file).isDirectory()) return null;
  return file;
}

test.describe('examples/embed.html', () => {
  test.beforeAll(async () => {
    test.setTimeout(240_000);
    libDir = mkdtempSync(join(tmpdir(), 'longtab-embed-lib-'));
    execFileSync('npx', ['vite', 'build', '-c', 'vite.lib.config.ts', '--outDir', libDir, '--emptyOutDir'], {
      stdio: 'pipe',
      timeout: 220_000,
    });
    server = createServer((req, res) => {
      if (req.url === '/readme-snippet.html') {
        return void res.writeHead(200, { 'Content-Type': TYPES['.html'] }).end(snippetPage);
      }
      const file = fileFor(req.url ?? '/');
      if (!file) return void res.writeHead(404).end();
      const size = statSync(file).size;
      const type = TYPES[extname(file)] ?? 'application/octet-stream';
      const range = /^bytes=(\d+)-(\d*)$/.exec(req.headers.range ?? '');
      let [start, end] = [0, size - 1];
      if (range) {
        start = Number(range[1]);
        end = range[2] ? Math.min(Number(range[2]), size - 1) : size - 1;
        res.writeHead(206, {
          'Content-Type': type,
          'Content-Range': `bytes ${start}-${end}/${size}`,
          'Content-Length': end - start + 1,
        });
      } else {
        res.writeHead(200, { 'Content-Type': type, 'Content-Length': size, 'Accept-Ranges': 'bytes' });
      }
      if (req.method === 'HEAD') return void res.end();
      createReadStream(file, { start, end }).pipe(res);
    });
    await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
    origin = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  });
  test.afterAll(async () => {
    await new Promise<void>((ok) => (server ? server.close(() => ok()) : ok()));
    if (libDir) rmSync(libDir, { recursive: true, force: true });
  });

  test('with no ?model it continues text with the demo model from the same server', async ({ page }) => {
    test.skip(!haveDemo, 'this checkout has no demo model');
    // The demo's first token on SwiftShader with two busy cores can take a minute or more.
    test.setTimeout(420_000);
    const requests: string[] = [];
    page.on('request', (request) => requests.push(request.url()));
    const errors: string[] = [];
    page.on('pageerror', (error) => errors.push(error.message));
    await page.goto(`${origin}/examples/embed.html`);
    const out = page.locator('#out');
    // The passage's start, then the model's first words after it.
    await expect(out).toHaveText(new RegExp(`^${PROMPT}.+`, 's'), { timeout: 400_000 });
    await expect(out).not.toHaveAttribute('data-error');
    expect(requests.some((url) => url === `${origin}/public/models/longtab-demo.gguf`)).toBe(true);
    expect(requests.filter((url) => !url.startsWith(origin))).toEqual([]);
    expect(errors).toEqual([]);
  });

  test("the README's embedding snippet runs as pasted: the hub model it names (served here from the demo file) streams a reply into its <pre>", async ({
    page,
    context,
  }) => {
    test.skip(!haveDemo, 'this checkout has no demo model');
    test.setTimeout(420_000);
    // The first js block after the README's embedding heading, exactly as a reader copies it.
    const readme = readFileSync(join(repoRoot, 'README.md'), 'utf8');
    const section = readme.slice(readme.indexOf('## Embedding the engine in your page'));
    const snippet = /```js\n([\s\S]*?)```/.exec(section)?.[1];
    expect(snippet).toContain("from './dist-lib/longtab.js'");
    const hubUrl = /'(https:\/\/huggingface\.co\/[^']+\.gguf)'/.exec(snippet ?? '')?.[1];
    expect(hubUrl).toBeDefined();
    // Nothing leaves this machine: the hub's answers come from the demo file, with the Range support the hub has.
    const demo = readFileSync(join(repoRoot, 'public/models/longtab-demo.gguf'));
    await context.route(hubUrl as string, (route) => {
      const range = /^bytes=(\d+)-(\d*)$/.exec(route.request().headers().range ?? '');
      const [start, end] = range
        ? [Number(range[1]), range[2] ? Math.min(Number(range[2]), demo.length - 1) : demo.length - 1]
        : [0, demo.length - 1];
      const headers: Record<string, string> = {
        'Content-Type': 'application/octet-stream',
        'Accept-Ranges': 'bytes',
        ETag: '"demo"',
        'Access-Control-Allow-Origin': '*',
        'Access-Control-Expose-Headers': 'Content-Range, Content-Length, ETag, Accept-Ranges',
      };
      if (range) headers['Content-Range'] = `bytes ${start}-${end}/${demo.length}`;
      return route.fulfill({ status: range ? 206 : 200, headers, body: demo.subarray(start, end + 1) });
    });
    const errors: string[] = [];
    page.on('pageerror', (error) => errors.push(error.message));
    snippetPage = `<!doctype html><meta charset="utf-8"><body><script type="module">${snippet}</script></body>`;
    await page.goto(`${origin}/readme-snippet.html`);
    await expect(page.locator('pre')).toHaveText(/\S/, { timeout: 400_000 });
    expect(errors).toEqual([]);
  });

  test('a model that does not load says why on the page', async ({ page }) => {
    await page.goto(`${origin}/examples/embed.html?model=/models/missing.gguf`);
    const out = page.locator('#out');
    await expect(out).toHaveAttribute('data-error', 'true', { timeout: 60_000 });
    await expect(out).toHaveText(/^Could not run \/models\/missing\.gguf: \w+: .*404/);
  });
});
