/**
 * Security of the built chat page (issue 9): it carries a Content-Security-Policy without 'unsafe-eval' or inline
 * scripts and still runs a model under it (the jinja interpreter, comlink and our code need no eval), and a model
 * whose general.name, chat template and file name carry `<img onerror>` and `<script>` never reaches the DOM as HTML.
 * The hostile model is stories260K's tensors with crafted metadata, written at test time with the project's GGUF
 * writer (nothing from shared/ is copied into the repository).
 */
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { expect, type Page, test } from '@playwright/test';
import { parseGguf } from '../runtime/gguf/parse.ts';
import { sourceFromBytes } from '../runtime/gguf/sources.ts';
import { metadataEntriesOf, writeGguf } from '../runtime/gguf/writer.ts';
import { faultLog } from '../test/regressions/fault-log.ts';
import { STORIES260K, sharedRoot } from '../test/shared.ts';

const modelFile = join(sharedRoot, STORIES260K);
const haveModel = existsSync(modelFile);
if (!haveModel)
  console.warn(`\n*** SKIPPING security.spec.ts model tests: ${modelFile} is missing (set LONGTAB_SHARED). ***\n`);

const HOSTILE = `<img src=x onerror="window.__pwned='img'"><script>window.__pwned='script'</script>`;
const HOSTILE_FILE = `<img src=x onerror=window.__pwned=1>.gguf`;

/** stories260K with a hostile general.name and a chat template that writes the same markup into every prompt. */
async function hostileModel(path: string): Promise<void> {
  const bytes = new Uint8Array(readFileSync(modelFile));
  const file = await parseGguf(sourceFromBytes(bytes));
  const metadata = metadataEntriesOf(file, (key) => key !== 'general.name' && key !== 'tokenizer.chat_template');
  metadata.push(
    { key: 'general.name', value: `Lily ${HOSTILE}` },
    {
      key: 'tokenizer.chat_template',
      value: `${HOSTILE}{% for message in messages %}{{ message['content'] }}\n{% endfor %}{{ '<script>alert(1)</script>' }}`,
    },
  );
  const tensors = file.tensors.map((t) => ({
    name: t.name,
    shape: t.shape,
    type: t.type,
    data: bytes.subarray(t.offset, t.offset + t.byteLength),
  }));
  writeFileSync(path, writeGguf({ metadata, tensors, alignment: file.alignment }));
}

/** CSP violations the page reports, and whether anything hostile ran. */
async function watchPage(page: Page): Promise<string[]> {
  const console: string[] = [];
  page.on('console', (m) => {
    if (/Content Security Policy|unsafe-eval|EvalError/i.test(m.text())) console.push(m.text());
  });
  page.on('pageerror', (e) => console.push(`pageerror: ${e.message}`));
  await page.addInitScript(() => {
    const w = window as unknown as { __csp: string[] };
    w.__csp = [];
    document.addEventListener('securitypolicyviolation', (e) => {
      w.__csp.push(`${e.violatedDirective} blocked ${e.blockedURI} (${e.sourceFile}:${e.lineNumber})`);
    });
  });
  return console;
}

test.describe('security of the built chat page', () => {
  test.skip(!haveModel, 'stories260K is not available');

  test('runs a model under a CSP without unsafe-eval; hostile names and templates stay text', async ({
    page,
  }, testInfo) => {
    test.setTimeout(400_000);
    const log = faultLog('page');
    const modelPath = testInfo.outputPath(HOSTILE_FILE);
    await hostileModel(modelPath);
    const consoleProblems = await watchPage(page);
    await page.goto('/');

    const csp = await page.evaluate(
      () => document.querySelector('meta[http-equiv="Content-Security-Policy"]')?.getAttribute('content') ?? '',
    );
    log.record({
      area: 'page',
      fault: 'Content-Security-Policy of the built page',
      expected: "present, script-src 'self' without 'unsafe-eval' or 'unsafe-inline'",
      outcome: csp
        ? csp
            .split(';')
            .find((d) => d.trim().startsWith('script-src'))!
            .trim()
        : 'missing',
      ok: /script-src 'self'(;|$)/.test(csp) && !csp.includes('unsafe-eval'),
    });
    expect(csp).toMatch(/script-src 'self'(;|$)/);
    expect(csp).not.toContain('unsafe-eval');
    // The policy is live: a page script cannot eval.
    const evalBlocked = await page.evaluate(() => {
      const script = document.createElement('script');
      script.textContent = "window.__inline = 'ran'";
      document.head.append(script);
      let evaluated = 'blocked';
      try {
        // biome-ignore lint/security/noGlobalEval: probing that the CSP blocks it
        evaluated = String(eval('"ran"'));
      } catch {}
      script.remove();
      return { inline: (window as unknown as { __inline?: string }).__inline ?? 'blocked', evaluated };
    });
    log.record({
      area: 'page',
      fault: 'an inline <script> added to the page, and eval() from page code',
      expected: 'the inline script is blocked by the CSP',
      // eval from Playwright's evaluate runs in a DevTools context the page's CSP does not govern, so only inline is asserted.
      outcome: `inline script ${evalBlocked.inline}; eval from the DevTools context ${evalBlocked.evaluated === 'ran' ? 'ran (not governed by the page CSP)' : 'blocked'}`,
      ok: evalBlocked.inline === 'blocked',
    });
    expect(evalBlocked.inline).toBe('blocked');
    // The probe's own refusal is expected; from here on, any CSP report is a failure.
    await page.evaluate(() => {
      (window as unknown as { __csp: string[] }).__csp.length = 0;
    });
    consoleProblems.length = 0;

    // Pick the hostile file, load it, chat: the template renders the markup into the prompt, never into the page.
    if (!(await page.getByTestId('models-panel').isVisible())) await page.getByTestId('model-chip').click();
    await page.getByTestId('model-file-input').setInputFiles(modelPath);
    const chip = page.getByTestId('model-chip');
    await expect(chip).toHaveAttribute('data-status', 'ready', { timeout: 90_000 });
    await page.getByTestId('open-settings').click();
    await page.getByTestId('setting-maxTokens').fill('8');
    await page.keyboard.press('Escape');
    const replies = page.getByTestId('message-assistant');
    await page.getByTestId('composer-input').fill(`Tell me a story ${HOSTILE}`);
    await page.getByTestId('send').click();
    await expect(replies).toHaveCount(1);
    await expect(replies.first()).toHaveAttribute('data-status', 'done', { timeout: 240_000 });
    const reply = ((await replies.first().locator('.bubble').textContent()) ?? '').trim();

    const dom = await page.evaluate(() => ({
      pwned: (window as unknown as { __pwned?: unknown }).__pwned ?? null,
      images: document.querySelectorAll('img[src="x"]').length,
      inlineScripts: [...document.querySelectorAll('script')].filter((s) => !s.src).length,
      text: document.body.textContent ?? '',
      csp: (window as unknown as { __csp: string[] }).__csp,
    }));
    const ok =
      dom.pwned === null && dom.images === 0 && dom.inlineScripts === 0 && dom.csp.length === 0 && reply.length > 0;
    log.record({
      area: 'page',
      fault:
        'a model whose general.name, chat template and file name hold <img onerror> and <script>, loaded and chatted with',
      expected: 'the model runs under the CSP; the markup shows as text; nothing runs; no CSP violation',
      outcome: `reply ${JSON.stringify(reply.slice(0, 40))}; injected img ${dom.images}, inline scripts ${dom.inlineScripts}, __pwned ${dom.pwned}, CSP violations ${dom.csp.length}`,
      ok,
    });
    expect(dom.pwned).toBeNull();
    expect(dom.images).toBe(0);
    expect(dom.inlineScripts).toBe(0);
    // The file name the chip shows, and the user's message, appear literally as text.
    expect(dom.text).toContain('<img src=x onerror=window.__pwned=1>');
    expect(dom.text).toContain(HOSTILE);
    expect(reply.length).toBeGreaterThan(0);
    expect(dom.csp).toEqual([]);
    expect(consoleProblems).toEqual([]);
  });
});
