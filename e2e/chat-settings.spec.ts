/**
 * The chat page's sampling settings, theme and message editing, in Chromium (SwiftShader WebGPU) with stories260K
 * from the shared data folder: a stop sequence cuts the greedy reply where it appears, a seed makes a sampled reply
 * repeat (another seed gives another), out-of-range input is refused with its rule; the theme changes the page's
 * colours and survives a reload; editing a message replaces the conversation from there on, and its new reply is the
 * one a fresh conversation gets (the engine's cache reused nothing of the dropped turns).
 */
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { expect, type Page, test } from '@playwright/test';
import { STORIES260K, sharedRoot } from '../test/shared.ts';
import { chat, collectPageErrors, pickModelFile, replyText, setSettings } from './fixtures/chat-page.ts';

const modelFile = join(sharedRoot, STORIES260K);
const haveModel = existsSync(modelFile);
if (!haveModel)
  console.warn(`\n*** SKIPPING chat-settings.spec.ts model tests: ${modelFile} is missing (set LONGTAB_SHARED). ***\n`);

interface DebugWindow {
  longtabDebug?: {
    lastRequest: Array<{ role: string; content: string }> | null;
    lastSampling: Record<string, unknown> | null;
  };
}

/** Regenerates the last reply and returns the new one. */
async function regenerate(page: Page): Promise<string> {
  const replies = page.getByTestId('message-assistant');
  const last = (await replies.count()) - 1;
  await replies.nth(last).getByTestId('regenerate').click();
  await expect(replies.nth(last)).toHaveAttribute('data-status', 'streaming');
  return replyText(page, last);
}

/** The settings saved in the app's IndexedDB. */
function storedSettings(page: Page): Promise<Record<string, unknown> | null> {
  return page.evaluate(async () => {
    const db = await new Promise<IDBDatabase>((ok, fail) => {
      const open = indexedDB.open('longtab-settings');
      open.onsuccess = () => ok(open.result);
      open.onerror = () => fail(open.error);
    });
    const settings = await new Promise<Record<string, unknown> | undefined>((ok, fail) => {
      const request = db.transaction('settings').objectStore('settings').get('settings');
      request.onsuccess = () => ok(request.result);
      request.onerror = () => fail(request.error);
    });
    db.close();
    return settings ?? null;
  });
}

/** The messages of every conversation in the app's IndexedDB, newest first (what a reload would show). */
function storedConversations(page: Page): Promise<Array<{ title: string; messages: string[] }>> {
  return page.evaluate(async () => {
    const db = await new Promise<IDBDatabase>((ok, fail) => {
      const open = indexedDB.open('longtab-chat');
      open.onsuccess = () => ok(open.result);
      open.onerror = () => fail(open.error);
    });
    const all = await new Promise<
      Array<{ title: string; updatedAt: number; messages: Array<{ content: string; status: string }> }>
    >((ok, fail) => {
      const request = db.transaction('conversations').objectStore('conversations').getAll();
      request.onsuccess = () => ok(request.result);
      request.onerror = () => fail(request.error);
    });
    db.close();
    return all
      .sort((a, b) => b.updatedAt - a.updatedAt)
      .map((c) => ({ title: c.title, messages: c.messages.map((m) => `${m.status}:${m.content}`) }));
  });
}

function bodyBackground(page: Page): Promise<string> {
  return page.evaluate(() => getComputedStyle(document.body).backgroundColor);
}

const LIGHT_BG = 'rgb(247, 247, 248)';
const DARK_BG = 'rgb(21, 22, 26)';

test.describe('chat settings', () => {
  test('a stop sequence cuts the greedy reply where it appears; a seed repeats a sampled reply and another seed changes it; out-of-range input is refused; all of it is sent and survives a reload', async ({
    page,
  }) => {
    test.skip(!haveModel, 'stories260K is missing');
    // Five replies of 12 tokens on SwiftShader.
    test.setTimeout(480_000);
    const errors = collectPageErrors(page);
    await page.goto('/?debug=1');
    await pickModelFile(page, modelFile);
    await setSettings(page, { temperature: '0', maxTokens: '12' });

    const greedy = await chat(page, 'Once upon a time');
    // A word of the reply past its first: the stop sequence must cut the reply there, dropping itself.
    const stopWord = greedy
      .split(/\s+/)
      .slice(1)
      .find((w) => w.length >= 3);
    expect(stopWord, `a word to stop at in "${greedy}"`).toBeDefined();
    const cut = greedy.slice(0, greedy.indexOf(stopWord!)).trimEnd();
    await setSettings(page, { stop: stopWord! });
    const stopped = await regenerate(page);
    expect(stopped).toBe(cut);
    expect(stopped.length).toBeLessThan(greedy.length);
    const sentStop = await page.evaluate(() => (window as DebugWindow).longtabDebug?.lastSampling);
    expect(sentStop).toMatchObject({ temperature: 0, max_tokens: 12, stop: [stopWord] });

    // Out-of-range values get their rule beside the field and are not saved; the valid ones before them stay.
    await page.getByTestId('open-settings').click();
    await page.getByTestId('setting-topK').fill('-1');
    await expect(page.getByTestId('setting-topK-error')).toHaveText(
      'Top-k must be a whole number, 0 or more (0 = off); -1 is not.',
    );
    await page.getByTestId('setting-minP').fill('1.5');
    await expect(page.getByTestId('setting-minP-error')).toHaveText(
      'Min-p must be a number from 0 (off) to 1; 1.5 is not.',
    );
    await page.getByTestId('setting-seed').fill('1.5');
    await expect(page.getByTestId('setting-seed-error')).toContainText('Seed must be a whole number');
    await page.getByTestId('setting-stop').fill('a\nb\nc\nd\ne');
    await expect(page.getByTestId('setting-stop-error')).toHaveText(
      'Use at most 4 stop sequences (one a line); there are 5.',
    );
    await expect.poll(() => storedSettings(page)).toMatchObject({ topK: 0, minP: 0, seed: null, stop: [stopWord] });
    await page.keyboard.press('Escape');

    // Temperature 1.5 with a fixed seed: the same reply twice; with another seed, another reply.
    await setSettings(page, {
      temperature: '1.5',
      topK: '40',
      minP: '0.01',
      repetitionPenalty: '1.1',
      seed: '1234',
      stop: '',
    });
    const seeded = await regenerate(page);
    expect(await page.evaluate(() => (window as DebugWindow).longtabDebug?.lastSampling)).toEqual({
      max_tokens: 12,
      temperature: 1.5,
      top_p: 0.9,
      top_k: 40,
      min_p: 0.01,
      repetition_penalty: 1.1,
      seed: 1234,
    });
    const again = await regenerate(page);
    expect(again).toBe(seeded);
    await setSettings(page, { seed: '98765' });
    const otherSeed = await regenerate(page);
    expect(otherSeed).not.toBe(seeded);

    // Saved with the other settings: a reload shows them in their fields.
    await expect
      .poll(() => storedSettings(page))
      .toMatchObject({ temperature: 1.5, topK: 40, minP: 0.01, repetitionPenalty: 1.1, seed: 98765, stop: [] });
    await page.reload();
    await page.getByTestId('open-settings').click();
    await expect(page.getByTestId('setting-temperature')).toHaveValue('1.5');
    await expect(page.getByTestId('setting-topK')).toHaveValue('40');
    await expect(page.getByTestId('setting-minP')).toHaveValue('0.01');
    await expect(page.getByTestId('setting-repetitionPenalty')).toHaveValue('1.1');
    await expect(page.getByTestId('setting-seed')).toHaveValue('98765');
    await expect(page.getByTestId('setting-stop')).toHaveValue('');
    expect(errors).toEqual([]);
  });

  test('the theme toggle changes the page colours, survives a reload, and System follows the browser', async ({
    page,
  }) => {
    const errors = collectPageErrors(page);
    await page.emulateMedia({ colorScheme: 'light' });
    await page.goto('/');
    await page.getByTestId('open-settings').click();
    await expect(page.getByTestId('theme-system')).toBeChecked();
    expect(await bodyBackground(page)).toBe(LIGHT_BG);

    await page.getByTestId('theme-dark').check();
    await expect(page.locator('html')).toHaveAttribute('data-theme', 'dark');
    await expect.poll(() => bodyBackground(page)).toBe(DARK_BG);
    await expect.poll(async () => (await storedSettings(page))?.theme).toBe('dark');
    await page.reload();
    await expect(page.locator('html')).toHaveAttribute('data-theme', 'dark');
    await expect.poll(() => bodyBackground(page)).toBe(DARK_BG);

    // Light wins over a dark system preference; System follows it.
    await page.emulateMedia({ colorScheme: 'dark' });
    await page.getByTestId('open-settings').click();
    await expect(page.getByTestId('theme-dark')).toBeChecked();
    await page.getByTestId('theme-light').check();
    await expect.poll(() => bodyBackground(page)).toBe(LIGHT_BG);
    await page.getByTestId('theme-system').check();
    await expect.poll(() => bodyBackground(page)).toBe(DARK_BG);
    await page.emulateMedia({ colorScheme: 'light' });
    await expect.poll(() => bodyBackground(page)).toBe(LIGHT_BG);
    await expect.poll(async () => (await storedSettings(page))?.theme).toBe('system');
    expect(errors).toEqual([]);
  });

  test('editing the first message drops the turns after it and gets a new reply, the one a fresh chat gets; a reload keeps the edit', async ({
    page,
  }) => {
    test.skip(!haveModel, 'stories260K is missing');
    // Four replies of 8 tokens on SwiftShader, and a reload.
    test.setTimeout(420_000);
    const errors = collectPageErrors(page);
    await page.goto('/?debug=1');
    await pickModelFile(page, modelFile);
    await setSettings(page, { temperature: '0', maxTokens: '8' });

    const first = await chat(page, 'Once upon a time');
    const second = await chat(page, 'The dog');
    const users = page.getByTestId('message-user');
    await expect(users).toHaveCount(2);

    // Cancel keeps the message as it was.
    await page.getByTestId('edit-message').first().click();
    await expect(page.getByTestId('edit-input')).toHaveValue('Once upon a time');
    await page.getByTestId('edit-cancel').click();
    await expect(users).toHaveText(['Once upon a time', 'The dog']);

    await page.getByTestId('edit-message').first().click();
    await page.getByTestId('edit-input').fill('The cat');
    await page.getByTestId('edit-send').click();
    await expect(users).toHaveText(['The cat']);
    await expect(page.getByTestId('message-assistant')).toHaveCount(1);
    const edited = await replyText(page, 0);
    expect([first, second]).not.toContain(edited);
    await expect(page.getByTestId('messages')).not.toContainText(second);
    await expect(page.getByTestId('conversation-title')).toHaveText('The cat');
    const sent = await page.evaluate(() => (window as DebugWindow).longtabDebug?.lastRequest);
    expect(sent?.filter((m) => m.role !== 'system')).toEqual([{ role: 'user', content: 'The cat' }]);

    await expect
      .poll(async () => (await storedConversations(page))[0])
      .toEqual({ title: 'The cat', messages: ['done:The cat', `done:${edited}`] });
    await page.reload();
    await expect(page.getByTestId('conversation-title')).toHaveText('The cat');
    await expect(page.getByTestId('message-user')).toHaveText(['The cat']);
    await expect(page.getByTestId('message-assistant')).toHaveCount(1);
    await expect(page.getByTestId('message-assistant').locator('.bubble')).toHaveText(edited);

    // A new chat with the same message, prefilled from nothing, gets the same greedy reply.
    await expect(page.getByTestId('model-chip')).toHaveAttribute('data-status', 'ready', { timeout: 120_000 });
    await page
      .getByRole('button', { name: /new chat/i })
      .first()
      .click();
    await expect(page.getByTestId('message-user')).toHaveCount(0);
    expect(await chat(page, 'The cat')).toBe(edited);
    expect(errors).toEqual([]);
  });
});
