/**
 * The chat page's conversations as data, and the model picker's fit labels, in Chromium (SwiftShader WebGPU) with
 * stories260K from the shared data folder: every conversation exports as one JSON file and the open one as Markdown;
 * an invalid file is refused with the field that is wrong and changes nothing; Delete all (after its confirmation)
 * empties the list, the store and the engine's cache; importing the exported file brings every conversation and
 * message back, across a reload, and importing it again adds copies under new ids. The model picker says the loaded
 * stories260K fits, and that a preset far larger than anything the GPU has held may not.
 */
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { type Download, expect, type Page, test } from '@playwright/test';
import { STORIES260K, sharedRoot } from '../test/shared.ts';
import { chat, collectPageErrors, pickModelFile, setSettings } from './fixtures/chat-page.ts';

const modelFile = join(sharedRoot, STORIES260K);
const haveModel = existsSync(modelFile);
if (!haveModel) {
  console.warn(`\n*** SKIPPING chat-data.spec.ts model tests: ${modelFile} is missing (set LONGTAB_SHARED). ***\n`);
}

interface ExportedFile {
  format: string;
  version: number;
  conversations: Array<{
    id: string;
    title: string;
    systemPrompt: string;
    messages: Array<{ role: string; content: string }>;
  }>;
}

/** Every conversation in the app's IndexedDB as "title | system prompt | role:content …", sorted (what a reload shows). */
function storedConversations(page: Page): Promise<string[]> {
  return page.evaluate(async () => {
    const db = await new Promise<IDBDatabase>((ok, fail) => {
      const open = indexedDB.open('longtab-chat');
      open.onsuccess = () => ok(open.result);
      open.onerror = () => fail(open.error);
    });
    const all = await new Promise<
      Array<{ title: string; systemPrompt: string; messages: Array<{ role: string; content: string }> }>
    >((ok, fail) => {
      const request = db.transaction('conversations').objectStore('conversations').getAll();
      request.onsuccess = () => ok(request.result);
      request.onerror = () => fail(request.error);
    });
    db.close();
    return all
      .map((c) => [c.title, c.systemPrompt, ...c.messages.map((m) => `${m.role}:${m.content}`)].join(' | '))
      .sort();
  });
}

/** Clicks a Settings button that downloads a file; returns the download and its text. */
async function downloadFrom(page: Page, testId: string): Promise<{ download: Download; text: string }> {
  const downloading = page.waitForEvent('download');
  await page.getByTestId(testId).click();
  const download = await downloading;
  const path = await download.path();
  return { download, text: readFileSync(path, 'utf8') };
}

test.describe('chat data', () => {
  test('conversations export as JSON and Markdown, an invalid import changes nothing, Delete all empties everything, and the export imports back across a reload', async ({
    page,
  }, testInfo) => {
    test.skip(!haveModel, 'stories260K is missing');
    // Two replies of 8 tokens on SwiftShader, two reloads.
    test.setTimeout(300_000);
    const errors = collectPageErrors(page);
    await page.goto('/');
    await pickModelFile(page, modelFile);
    await setSettings(page, { temperature: '0', maxTokens: '8' });

    const firstReply = await chat(page, 'Once upon a time');
    await page.getByTestId('new-chat').click();
    await page.getByTestId('toggle-system').click();
    await page.getByTestId('system-prompt').fill('You tell stories about dogs.');
    const secondReply = await chat(page, 'The dog');
    await expect(page.getByTestId('conversation-item')).toHaveCount(2);
    await expect.poll(() => storedConversations(page)).toHaveLength(2);
    const before = await storedConversations(page);
    expect(before.join('\n')).toContain(' | user:Once upon a time | assistant:');
    expect(before.join('\n')).toContain('The dog | You tell stories about dogs. | user:The dog | assistant:');

    // Export: every conversation as one versioned JSON file, the open one as Markdown.
    await page.getByTestId('open-settings').click();
    const exported = await downloadFrom(page, 'export-json');
    expect(exported.download.suggestedFilename()).toMatch(/^longtab-conversations-\d{4}-\d{2}-\d{2}\.json$/);
    const file = JSON.parse(exported.text) as ExportedFile;
    expect(file).toMatchObject({ format: 'longtab-conversations', version: 1 });
    expect(
      file.conversations
        .map((c) => [c.title, c.systemPrompt, ...c.messages.map((m) => `${m.role}:${m.content}`)].join(' | '))
        .sort(),
    ).toEqual(before);
    // The replies as stored are the ones the page showed (rendered as Markdown, hence the spaces compared loosely).
    const words = (text: string) => text.replace(/\s+/g, ' ').trim();
    const dogReply = file.conversations.find((c) => c.title === 'The dog')!.messages[1]!;
    expect(words(dogReply.content)).toBe(words(secondReply));
    expect(words(file.conversations.find((c) => c.title !== 'The dog')!.messages[1]!.content)).toBe(words(firstReply));
    const exportPath = testInfo.outputPath('conversations.json');
    await exported.download.saveAs(exportPath);

    const markdown = await downloadFrom(page, 'export-markdown');
    expect(markdown.download.suggestedFilename()).toBe('the-dog.md');
    expect(markdown.text).toMatch(
      /^# The dog\n\nSystem prompt:\n\n> You tell stories about dogs\.\n\n## You\n\nThe dog\n\n## Assistant\n\n/,
    );
    expect(markdown.text).toContain(`## Assistant\n\n${dogReply.content}`);

    // An invalid file: the message names the field; nothing is added or lost, and the page keeps working.
    const bad = structuredClone(file);
    (bad.conversations[0]!.messages[0] as { role: string }).role = 'bot';
    await page.getByTestId('import-conversations').setInputFiles({
      name: 'bad.json',
      mimeType: 'application/json',
      buffer: Buffer.from(JSON.stringify(bad)),
    });
    await expect(page.getByTestId('import-error')).toHaveText(
      'This is not a conversations file longtab can import: conversations[0].messages[0].role should be "user" or "assistant", but it is the text "bot".',
    );
    await page.getByTestId('import-conversations').setInputFiles({
      name: 'notes.json',
      mimeType: 'application/json',
      buffer: Buffer.from('{"format": "longtab-conversations",'),
    });
    await expect(page.getByTestId('import-error')).toContainText('This file is not JSON');
    await expect(page.getByTestId('conversation-item')).toHaveCount(2);
    expect(await storedConversations(page)).toEqual(before);

    // Delete all asks first; Cancel keeps everything.
    await page.getByTestId('delete-all').click();
    await expect(page.getByTestId('settings-panel')).toHaveCount(0);
    await expect(page.getByTestId('delete-all-dialog')).toContainText('All 2 conversations');
    await page.getByTestId('delete-all-cancel').click();
    await expect(page.getByTestId('delete-all-dialog')).toHaveCount(0);
    expect(await storedConversations(page)).toEqual(before);
    await expect(page.getByTestId('stat-context')).not.toContainText(/^0 \//);

    await page.getByTestId('open-settings').click();
    await page.getByTestId('delete-all').click();
    await page.getByTestId('delete-all-confirm').click();
    await expect(page.getByTestId('delete-all-dialog')).toHaveCount(0);
    await expect(page.getByTestId('conversation-item')).toHaveCount(1);
    await expect(page.getByTestId('conversation-title')).toHaveText('New chat');
    await expect(page.getByTestId('message-user')).toHaveCount(0);
    await expect.poll(() => storedConversations(page)).toHaveLength(1);
    const [emptyChat] = await storedConversations(page);
    expect(emptyChat).toMatch(/^New chat \| [^|]*$/);
    // The engine dropped the cached conversations: no tokens are held any more.
    await expect(page.getByTestId('stat-context')).toContainText(/^0 \//);
    await page.reload();
    await expect(page.getByTestId('conversation-item')).toHaveCount(1);
    expect(await storedConversations(page)).toEqual([emptyChat]);

    // Import the export: both conversations and their messages are back, beside the new chat, across a reload.
    await page.getByTestId('open-settings').click();
    await page.getByTestId('import-conversations').setInputFiles(exportPath);
    await expect(page.getByTestId('import-result')).toHaveText('Imported 2 conversations from conversations.json.');
    await expect(page.getByTestId('conversation-item')).toHaveCount(3);
    await page.reload();
    await expect(page.getByTestId('conversation-item')).toHaveCount(3);
    const restored = await storedConversations(page);
    expect(restored).toEqual([...before, emptyChat!].sort());
    await page.getByTestId('conversation-item').filter({ hasText: 'The dog' }).getByRole('button').first().click();
    await expect(page.getByTestId('message-assistant').locator('.bubble')).toHaveText(secondReply);

    // Importing the same file again loses nothing: the copies get new ids.
    await page.getByTestId('open-settings').click();
    await page.getByTestId('import-conversations').setInputFiles(exportPath);
    await expect(page.getByTestId('import-result')).toHaveText(
      'Imported 2 conversations from conversations.json (2 got a new id: one with the same id was already here).',
    );
    await expect(page.getByTestId('conversation-item')).toHaveCount(5);
    await expect.poll(() => storedConversations(page)).toEqual([...before, ...before, emptyChat!].sort());
    expect(errors).toEqual([]);
  });

  test('the model picker says the loaded stories260K fits and a far larger preset may not', async ({ page }) => {
    test.skip(!haveModel, 'stories260K is missing');
    const errors = collectPageErrors(page);
    await page.goto('/');
    await pickModelFile(page, modelFile);
    await page.getByTestId('model-chip').click();
    const stories = page.getByTestId('stored-model').filter({ hasText: 'stories260K' });
    await expect(stories.getByTestId('model-fit')).toHaveText('fits');
    await expect(stories.getByTestId('model-fit')).toHaveAttribute('title', 'loaded and running with this KV budget');
    const preset = page.getByTestId('preset-qwen2.5-0.5b-instruct-q4_k_m').getByTestId('model-fit');
    await expect(preset).toContainText(
      /^may not fit: needs about \d+ MiB \(weights 468 MiB \+ KV budget 64 MiB \+ scratch [\d.]+ [KM]iB\)/,
    );
    await expect(preset).toContainText("WebGPU does not report this GPU's memory");
    expect(errors).toEqual([]);
  });
});
