/**
 * What the page says about the model and the machine it runs on (issue 38, points 1 and 2), in Chromium (SwiftShader
 * WebGPU): the demo model's purpose, its text mode through the completions API, one step from it to a chat model, a
 * note on a software adapter's speed; live stats while a reply streams, TTFT as the person waits for it, and what the
 * KV budget holds where the model's context length is the limit.
 * Screenshots of the main states are attached to each test (test-results/, and the HTML report).
 */
import { existsSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { expect, type Page, type TestInfo, test } from '@playwright/test';
import { STORIES260K, sharedRoot } from '../test/shared.ts';
import { collectPageErrors, pickModelFile, replyText, setSettings } from './fixtures/chat-page.ts';
import { startHubServer } from './fixtures/hub-server.ts';

const modelFile = join(sharedRoot, STORIES260K);
const haveModel = existsSync(modelFile);
if (!haveModel)
  console.warn(
    `\n*** SKIPPING demo-purpose.spec.ts stories260K tests: ${modelFile} is missing (set LONGTAB_SHARED). ***\n`,
  );
const haveDemo = existsSync(resolve('public/models/longtab-demo.gguf'));
/** The preset the demo's notice offers (CHAT_PRESET); the stand-in hub serves stories260K under its name. */
const CHAT_PRESET = {
  label: 'Qwen2.5 0.5B Instruct (Q4_K_M)',
  repo: 'Qwen/Qwen2.5-0.5B-Instruct-GGUF',
  file: 'qwen2.5-0.5b-instruct-q4_k_m.gguf',
};

async function shot(page: Page, testInfo: TestInfo, name: string): Promise<void> {
  const path = testInfo.outputPath(`${name}.png`);
  await page.screenshot({ path });
  await testInfo.attach(name, { path, contentType: 'image/png' });
}

/** Whether this browser's WebGPU adapter is a software one, asked of the page itself (not of the app). */
function softwareAdapter(page: Page): Promise<boolean> {
  return page.evaluate(async () => {
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) return false;
    const info = adapter.info as GPUAdapterInfo & { isFallbackAdapter?: boolean };
    const words = `${info.vendor} ${info.architecture} ${info.device} ${info.description}`;
    return /swiftshader|lavapipe|llvmpipe|microsoft basic render/i.test(words) || Boolean(info.isFallbackAdapter);
  });
}

function statNumber(text: string | null): number {
  return Number.parseFloat((text ?? '').replace(/[^\d.]/g, ''));
}

test.describe('what the page says about the model and the adapter', () => {
  test('the demo model says what it is; text mode continues a passage through the completions API; one step gets a chat model; a software adapter gets a note on speed', async ({
    page,
  }, testInfo) => {
    test.skip(!haveDemo, 'this checkout has no demo model');
    test.skip(!haveModel, 'stories260K is missing (the stand-in chat model)');
    test.setTimeout(600_000);
    const errors = collectPageErrors(page);
    const hub = await startHubServer({
      files: [{ repo: CHAT_PRESET.repo, file: CHAT_PRESET.file, path: modelFile }],
    });
    try {
      await page.goto('/?debug=1');
      const chip = page.getByTestId('model-chip');
      await expect(chip).toHaveText('longtab demo model · int2 KV', { timeout: 180_000 });
      const about = page.getByTestId('demo-about');
      await expect(about).toContainText('about 10 million parameters');
      await expect(about).toContainText('public-domain books (the King James Bible and Jane Austen');
      await expect(about).toContainText('It continues text; it does not follow instructions.');
      // The adapter: a software one is named, with what to expect of its speed; a hardware GPU gets no note.
      const note = page.getByTestId('software-adapter');
      if (await softwareAdapter(page)) {
        await expect(note).toContainText(/^WebGPU runs in software here \(.+\), on the CPU: expect replies many times/);
        await expect(page.getByTestId('stat-adapter')).toContainText('(software)');
      } else {
        await expect(note).toHaveCount(0);
      }
      await shot(page, testInfo, 'p1-demo-notice');

      // Text mode: what is typed is the start of a passage, and the model continues it (no chat template).
      await page.getByTestId('demo-text-mode').click();
      await expect(page.getByTestId('mode-text')).toBeChecked();
      await expect(page.getByTestId('demo-text-mode')).toHaveCount(0);
      await expect(page.getByTestId('composer-input')).toHaveAttribute('placeholder', /^The start of a passage/);
      await setSettings(page, { maxTokens: '4' });
      const start = 'It is a truth universally acknowledged';
      await page.getByTestId('composer-input').fill(start);
      await page.getByTestId('composer-input').press('Enter');
      const continuation = await replyText(page, 0);
      expect(continuation.length).toBeGreaterThan(0);
      const sent = await page.evaluate(() => {
        const hooks = (window as { longtabDebug?: { lastPrompt: string | null; lastRequest: unknown } }).longtabDebug;
        return { prompt: hooks?.lastPrompt, messages: hooks?.lastRequest };
      });
      expect(sent).toEqual({ prompt: start, messages: null });
      await shot(page, testInfo, 'p2-text-mode');

      // One step to a chat model: the button stores the preset (from the hub set in Settings) and chooses it.
      await setSettings(page, { hub: `${hub.hubBase}` });
      await page.getByTestId('demo-chat-model').click();
      await expect(chip).toContainText(CHAT_PRESET.label, { timeout: 120_000 });
      await expect(chip).toHaveAttribute('data-status', 'ready', { timeout: 120_000 });
      await expect(page.getByTestId('demo-about')).toHaveCount(0);
      await shot(page, testInfo, 'p3-chat-model');
      expect(errors).toEqual([]);
    } finally {
      await hub.close();
    }
  });

  test('stats move while a reply streams, TTFT is the wait from the send to the first token shown, and the KV budget names the context length as its cap', async ({
    page,
  }, testInfo) => {
    test.skip(!haveModel, 'stories260K is missing');
    test.setTimeout(360_000);
    const errors = collectPageErrors(page);
    await page.goto('/');
    await pickModelFile(page, modelFile);
    await setSettings(page, { maxTokens: '10' });
    // A long system prompt: the engine prefills it apart from the conversation (a shared prefix), outside its own
    // ttft_ms, so only a TTFT that starts at the send counts that wait.
    await page.getByTestId('toggle-system').click();
    await page
      .getByTestId('system-prompt')
      .fill('Lily and her mom went to the park to play with the big red ball. '.repeat(12).trim());
    await page.getByTestId('composer-input').fill('Once upon a time');

    // What the page shows, watched from inside it: the context count beside the reply's length while it streams,
    // when the reply's first text appears, and the send itself.
    type Watch = { sentAt: number; firstShownAt: number | null; seen: Array<{ chars: number; context: string }> };
    await page.evaluate(() => {
      const w = window as unknown as { watch: Watch };
      w.watch = { sentAt: 0, firstShownAt: null, seen: [] };
      new MutationObserver(() => {
        const reply = document.querySelector('[data-testid="message-assistant"]');
        if (reply?.getAttribute('data-status') !== 'streaming') return;
        const chars = (reply.querySelector('.markdown')?.textContent ?? '').length;
        if (w.watch.firstShownAt === null && chars > 0) w.watch.firstShownAt = performance.now();
        const context = document.querySelector('[data-testid="stat-context"]')?.textContent ?? '';
        const last = w.watch.seen.at(-1);
        if (last?.chars !== chars || last.context !== context) w.watch.seen.push({ chars, context });
      }).observe(document.body, { subtree: true, childList: true, characterData: true, attributes: true });
      w.watch.sentAt = performance.now();
      document.querySelector<HTMLButtonElement>('[data-testid="send"]')!.click();
    });
    const reply = await replyText(page, 0);
    const watch = await page.evaluate(() => (window as unknown as { watch: Watch }).watch);
    // Live: the context count moved between the reply's first and last tokens, as they came, not only at its end.
    const midReply = watch.seen.filter((s) => s.chars > 0 && s.chars < reply.length).map((s) => s.context);
    expect(new Set(midReply).size, JSON.stringify(watch.seen)).toBeGreaterThanOrEqual(2);
    const waited = watch.firstShownAt! - watch.sentAt;
    const ttft = statNumber(await page.getByTestId('stat-ttft').textContent());
    // The page's own measure starts a moment after the click and ends a moment before the text is drawn, so it lies
    // inside the test's window; and it covers the wait for the model, not only the prefill (the engine's ttft_ms,
    // a small part of that wait here).
    const what = `shown TTFT against ${waited.toFixed(0)} ms from the send to the first token shown`;
    expect(ttft, what).toBeLessThan(waited + 2);
    expect(ttft, what).toBeGreaterThan(waited / 2);
    await shot(page, testInfo, 'p4-live-stats');

    // stories260K's context (2048) is the cap in both modes, not the 64 MiB budget: the panel and Settings say so.
    await expect(page.getByTestId('stat-kv-holds')).toHaveText(
      "int2: 2K tokens in this budget; f16 would hold 2K (capped at the model's context length, 2K)",
    );
    await page.getByTestId('open-settings').click();
    await expect(page.getByTestId('settings-kv-holds')).toHaveText(
      "With the loaded model: int2: 2K tokens in this budget; f16 would hold 2K (capped at the model's context length, 2K).",
    );
    await expect(page.getByTestId('settings-panel')).not.toContainText('more context');
    await shot(page, testInfo, 'p5-settings-kv');
    expect(errors).toEqual([]);
  });
});
