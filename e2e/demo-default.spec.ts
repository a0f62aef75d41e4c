/**
 * The page's default model (issue 5): a first visit stores the demo model that ships with the page
 * (public/models/longtab-demo.gguf) and loads it with no action, so typing a message is all it takes to get a reply;
 * after that visit the page answers offline. A model the user picks while the demo is still loading wins: the demo's
 * GPU memory is freed, and the choice outlives a reload.
 * Screenshots of the main states are attached to each test (test-results/, and the HTML report).
 */
import { existsSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { expect, type Locator, type Page, type TestInfo, test } from '@playwright/test';
import { STORIES260K, sharedRoot } from '../test/shared.ts';
import { startAppServer } from './fixtures/app-server.ts';

const appDir = resolve('dist/e2e');
const storiesFile = join(sharedRoot, STORIES260K);
const haveStories = existsSync(storiesFile);
if (!haveStories)
  console.warn(
    `\n*** SKIPPING demo-default.spec.ts model-choice test: ${storiesFile} is missing (set LONGTAB_SHARED). ***\n`,
  );
const DEMO_NAME = 'longtab demo model';
/** The demo's Q8_0 weights take 10.6 MiB; stories260K's about 1 MiB. */
const DEMO_WEIGHTS_MIB = 10;

async function shot(page: Page, testInfo: TestInfo, name: string): Promise<void> {
  if (process.env.LONGTAB_E2E_TIMING) console.log(`${new Date().toISOString()} ${name}`);
  const path = testInfo.outputPath(`${name}.png`);
  await page.screenshot({ path });
  await testInfo.attach(name, { path, contentType: 'image/png' });
}

function collectPageErrors(page: Page): string[] {
  const errors: string[] = [];
  page.on('pageerror', (error) => errors.push(error.message));
  return errors;
}

/** The model id saved in the app's settings store (null: none chosen). */
function storedModelId(page: Page): Promise<string | null> {
  return page.evaluate(async () => {
    const db = await new Promise<IDBDatabase>((ok, fail) => {
      const open = indexedDB.open('longtab-settings');
      open.onsuccess = () => ok(open.result);
      open.onerror = () => fail(open.error);
    });
    const settings = await new Promise<{ modelId?: string | null } | undefined>((ok, fail) => {
      const request = db.transaction('settings').objectStore('settings').get('settings');
      request.onsuccess = () => ok(request.result);
      request.onerror = () => fail(request.error);
    });
    db.close();
    return settings?.modelId ?? null;
  });
}

/** Mebibytes in a label such as "weights1.1 MiB" (formatBytes). */
function mebibytes(text: string | null): number {
  const match = /([\d.]+)\s*(B|KiB|MiB|GiB)/.exec(text ?? '');
  if (!match) return Number.NaN;
  const scale = { B: 1 / 1024 ** 2, KiB: 1 / 1024, MiB: 1, GiB: 1024 }[match[2] as 'B' | 'KiB' | 'MiB' | 'GiB'];
  return Number(match[1]) * scale;
}

/**
 * Types a message and sends it with Enter (no click), waits for the model's first words to stream in, then stops
 * the reply (the demo decodes slowly on a software GPU) unless it already ended. Returns the reply's text.
 */
async function askByTyping(page: Page, text: string): Promise<{ reply: Locator; content: string }> {
  const replies = page.getByTestId('message-assistant');
  const before = await replies.count();
  const input = page.getByTestId('composer-input');
  await input.fill(text);
  await input.press('Enter');
  await expect(replies).toHaveCount(before + 1);
  const reply = replies.nth(before);
  await expect(reply.locator('.markdown')).not.toBeEmpty({ timeout: 240_000 });
  if ((await reply.getAttribute('data-status')) === 'streaming') {
    await page
      .getByTestId('stop')
      .click({ timeout: 5_000 })
      .catch(() => {}); // it may have ended on its own just now
  }
  await expect(reply).toHaveAttribute('data-status', /^(done|stopped)$/, { timeout: 60_000 });
  return { reply, content: ((await reply.locator('.bubble').textContent()) ?? '').trim() };
}

test.describe('the default model', () => {
  test('a first visit answers from the demo model with no choice made, and again offline after a reload', async ({
    page,
  }, testInfo) => {
    test.skip(!existsSync(join(appDir, 'sw.js')), 'dist/e2e has no service worker (build first)');
    test.skip(!existsSync(join(appDir, 'models/longtab-demo.gguf')), 'this build has no demo model');
    // Two loads and two replies of a 10M-parameter model on SwiftShader with two busy cores.
    test.setTimeout(600_000);
    const errors = collectPageErrors(page);
    const server = await startAppServer(appDir);
    let stopped = false;
    try {
      await page.goto(`${server.origin}/`);
      const chip = page.getByTestId('model-chip');
      // No click: the page stores the demo model and loads it by itself.
      await expect(chip).toContainText(DEMO_NAME);
      // While the demo loads, the composer says so (it never asks to choose the model that is loading). One read of
      // both, in the page: a retried assertion would pass once the load is done, with or without the fix.
      const [chipStatus, placeholder] = await page.evaluate(() => [
        document.querySelector('[data-testid="model-chip"]')?.getAttribute('data-status'),
        document.querySelector('[data-testid="composer-input"]')?.getAttribute('placeholder'),
      ]);
      expect(placeholder).toMatch(chipStatus === 'loading' ? /model is loading; you can type meanwhile$/ : /^Message/);
      await shot(page, testInfo, 'd1-getting-demo');
      await expect(chip).toHaveAttribute('data-status', 'ready', { timeout: 180_000 });
      // The page's default cache is the 2-bit one (the demo's rows of 2 heads × 64 form one group of 128).
      await expect(chip).toHaveText(`${DEMO_NAME} · int2 KV`);
      await expect(page.getByTestId('no-model')).toHaveCount(0);
      await expect(page.getByTestId('engine-error')).toHaveCount(0);
      await expect(page.getByTestId('mem-weights')).not.toContainText(/^weights0 B$/);
      expect(await storedModelId(page)).toBe('longtab-demo');
      await shot(page, testInfo, 'd2-demo-ready');

      const first = await askByTyping(page, 'Hello! Who are you?');
      expect(first.content.length).toBeGreaterThan(0);
      expect(first.content).not.toBe('Hello! Who are you?');
      // Time to first token is measured from the model's first streamed token.
      expect(Number.parseFloat((await page.getByTestId('stat-ttft').textContent()) ?? '')).toBeGreaterThan(0);
      await shot(page, testInfo, 'd3-demo-reply');

      // The models panel lists the demo as stored and selected.
      await chip.click();
      const demoRow = page.locator('[data-testid="stored-model"][data-model-id="longtab-demo"]');
      await expect(demoRow).toContainText('stored');
      await expect(demoRow.getByRole('button', { name: 'Selected' })).toBeDisabled();
      await shot(page, testInfo, 'd4-models-panel');
      await page.keyboard.press('Escape');

      // Offline: the service worker serves the app shell, the demo comes from OPFS.
      await expect.poll(() => page.evaluate(() => Boolean(navigator.serviceWorker.controller))).toBe(true);
      await server.close();
      stopped = true;
      await page.reload();
      await expect(page.getByTestId('composer-input')).toBeVisible();
      await expect(chip).toHaveAttribute('data-status', 'ready', { timeout: 180_000 });
      await expect(chip).toHaveText(`${DEMO_NAME} · int2 KV`);
      await page.getByTestId('new-chat').click(); // a short prompt: the reply's wait is mostly the prefill
      // The restored conversation's reply must be gone before askByTyping counts replies: on a slow run it was still
      // shown, the count started at 1, and the new chat's first reply never made it 2.
      await expect(page.getByTestId('message-assistant')).toHaveCount(0);
      const second = await askByTyping(page, 'Tell me a story.');
      expect(second.content.length).toBeGreaterThan(0);
      await shot(page, testInfo, 'd5-offline-reply');
      expect(errors).toEqual([]);
    } finally {
      if (!stopped) await server.close();
    }
  });

  test('the top bar shows the load progress whole at 390 and 1280 px wide (the name may shorten, the percentage not)', async ({
    page,
  }, testInfo) => {
    test.skip(!existsSync(join(appDir, 'models/longtab-demo.gguf')), 'this build has no demo model');
    // The demo's download stops after 2 MiB and waits: the chip stays at its first percentage for the checks.
    const server = await startAppServer(appDir, { holdGgufAfterBytes: 2 << 20 });
    try {
      const progress = page.getByTestId('chip-progress');
      const whole = () =>
        page.evaluate(() => {
          const chip = document.querySelector('[data-testid="model-chip"]')!.getBoundingClientRect();
          const element = document.querySelector<HTMLElement>('[data-testid="chip-progress"]')!;
          const box = element.getBoundingClientRect();
          return {
            insideChip: box.left >= chip.left - 0.5 && box.right <= chip.right + 0.5,
            notClipped: element.scrollWidth <= element.clientWidth,
            onScreen: chip.right <= window.innerWidth + 0.5,
          };
        });
      await page.setViewportSize({ width: 390, height: 844 });
      await page.goto(`${server.origin}/`);
      await expect(progress).toHaveText(/\d+%$/, { timeout: 60_000 });
      expect(await whole(), '390 px').toEqual({ insideChip: true, notClipped: true, onScreen: true });
      await shot(page, testInfo, 'd6-progress-390');
      await page.setViewportSize({ width: 1280, height: 800 });
      await page.getByRole('button', { name: 'Stats' }).click();
      expect(await whole(), '1280 px, stats open').toEqual({ insideChip: true, notClipped: true, onScreen: true });
      await shot(page, testInfo, 'd7-progress-1280-stats');
    } finally {
      await server.close();
    }
  });

  test('a model chosen while the demo loads wins: the demo is unloaded, and the choice survives a reload', async ({
    page,
  }, testInfo) => {
    test.skip(!haveStories, 'stories260K is missing');
    test.setTimeout(300_000);
    const errors = collectPageErrors(page);
    await page.goto('/');
    const chip = page.getByTestId('model-chip');
    // The demo is stored, then its load starts in the engine: choose another model in the middle of it.
    await expect(chip).toContainText(new RegExp(`Loading ${DEMO_NAME}: (parse|upload|calibrate)`), { timeout: 60_000 });
    await chip.click();
    await page.getByTestId('model-file-input').setInputFiles(storiesFile);
    await expect(page.getByTestId('models-panel')).toBeHidden();
    // Never the demo shown as ready in between: the chip goes from loading straight to the chosen model.
    await expect(chip).toHaveAttribute('data-status', 'loading');
    await expect(chip).toContainText('stories260K');
    await shot(page, testInfo, 'd6-choice-while-demo-loads');
    await expect(chip).toHaveAttribute('data-status', 'ready', { timeout: 180_000 });
    await expect(chip).toHaveText('stories260K.gguf · int2 KV');
    // Only the chosen model's weights are on the GPU: the demo's 10.6 MiB were freed.
    await expect.poll(async () => mebibytes(await page.getByTestId('mem-weights').textContent())).toBeLessThan(2);
    expect(mebibytes(await page.getByTestId('mem-weights').textContent())).toBeLessThan(DEMO_WEIGHTS_MIB);
    await shot(page, testInfo, 'd7-chosen-model-ready');

    // The choice is what the settings keep: a reload opens on it, not on the default.
    await expect.poll(() => storedModelId(page)).toMatch(/^local-stories260K/);
    await page.reload();
    await expect(chip).toHaveAttribute('data-status', 'ready', { timeout: 120_000 });
    await expect(chip).toHaveText('stories260K.gguf · int2 KV');
    await chip.click();
    await expect(page.locator('[data-testid="stored-model"][data-model-id="longtab-demo"]')).toContainText('stored');
    await expect(
      page.locator('[data-testid="stored-model"][data-model-id^="local-stories260K"]').getByRole('button', {
        name: 'Selected',
      }),
    ).toBeDisabled();
    await shot(page, testInfo, 'd8-choice-after-reload');
    expect(errors).toEqual([]);
  });
});
