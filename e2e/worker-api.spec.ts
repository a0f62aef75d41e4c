/**
 * The engine through its real module worker in Chromium (SwiftShader WebGPU), with stories260K served over HTTP
 * Range requests by a small server started here from ../shared (never copied into the repository).
 */
import { existsSync, readFileSync, statSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { join } from 'node:path';
import { expect, type Page, test } from '@playwright/test';
import { qwen3ChatTemplate, withChatTemplate } from '../test/chat-templates.ts';
import { STORIES260K, STORIES260K_GOLDEN, sharedRoot } from '../test/shared.ts';

const modelFile = join(sharedRoot, STORIES260K);
const haveModel = existsSync(modelFile);
if (!haveModel) console.warn(`\n*** SKIPPING worker-api.spec.ts: ${modelFile} is missing (set LONGTAB_SHARED). ***\n`);

let server: Server;
let modelUrl = '';
let toolsModelUrl = '';

/**
 * Serves the models (stories260K, and its copy with a tool template) with Range support and CORS (the page's origin
 * is the vite preview server).
 */
async function serveModel(): Promise<string> {
  const files: Record<string, Uint8Array> = {
    '/models/stories260K.gguf': new Uint8Array(readFileSync(modelFile)),
    // stories260K with Qwen3's chat template, whose tool format is the tagged one.
    '/models/stories260K-tools.gguf': await withChatTemplate(
      new Uint8Array(readFileSync(modelFile)),
      qwen3ChatTemplate(),
    ),
  };
  server = createServer((req, res) => {
    res.setHeader('Access-Control-Allow-Origin', '*');
    res.setHeader('Access-Control-Allow-Headers', 'Range');
    res.setHeader('Access-Control-Expose-Headers', 'Content-Range, Content-Length');
    if (req.method === 'OPTIONS') return void res.writeHead(204).end();
    const file = files[req.url ?? ''];
    if (!file) return void res.writeHead(404).end();
    const size = file.byteLength;
    const match = /^bytes=(\d+)-(\d+)?$/.exec(req.headers.range ?? '');
    if (!match) {
      res.writeHead(200, { 'Content-Length': size, 'Accept-Ranges': 'bytes' });
      return void res.end(req.method === 'HEAD' ? undefined : file);
    }
    const start = Number(match[1]);
    const end = Math.min(match[2] === undefined ? size - 1 : Number(match[2]), size - 1);
    res.writeHead(206, { 'Content-Range': `bytes ${start}-${end}/${size}`, 'Content-Length': end - start + 1 });
    res.end(file.subarray(start, end + 1));
  });
  return new Promise((resolve) =>
    server.listen(0, '127.0.0.1', () => resolve(`http://127.0.0.1:${(server.address() as AddressInfo).port}`)),
  );
}

test.describe('engine worker API (Chromium, real worker)', () => {
  test.skip(!haveModel, 'stories260K is not available');
  test.beforeAll(async () => {
    const base = await serveModel();
    modelUrl = `${base}/models/stories260K.gguf`;
    toolsModelUrl = `${base}/models/stories260K-tools.gguf`;
  });
  test.afterAll(() => new Promise<void>((resolve) => (server ? server.close(() => resolve()) : resolve())));

  async function open(page: Page): Promise<string[]> {
    // SwiftShader on two shared cores: a few hundred tokens take minutes when other jobs run.
    test.setTimeout(360_000);
    const pageErrors: string[] = [];
    page.on('pageerror', (error) => pageErrors.push(error.message));
    await page.goto('/e2e/harness/worker-api.html');
    await page.waitForFunction(() => window.harness !== undefined);
    return pageErrors;
  }

  test('load progress in order, streamed chunks equal to the non-streamed reply, stats, unload', async ({ page }) => {
    const pageErrors = await open(page);
    const result = await page.evaluate(async (url) => {
      const engine = window.harness!.createEngine();
      const progress: Array<{ phase: string; bytesDone: number; bytesTotal: number }> = [];
      const info = await engine.load(url, { kvBudgetBytes: 4 << 20, onProgress: (p) => progress.push(p) });
      const statsSeen: number[] = [];
      const unsubscribe = await engine.subscribeStats((s) => statsSeen.push(s.context.used));
      const messages = [
        { role: 'system' as const, content: 'You tell short stories about Lily and her red ball.' },
        { role: 'user' as const, content: 'Tell me about Lily.' },
      ];
      const whole = await engine.chat.completions.create({ messages, max_tokens: 12, temperature: 0 });
      const chunks = [];
      for await (const chunk of await engine.chat.completions.create({
        messages,
        max_tokens: 12,
        temperature: 0,
        stream: true,
      }))
        chunks.push(chunk);
      // Raw text: from BOS alone, stories260K's greedy continuation (the golden text's start).
      const text = await engine.completions.create({ prompt: '', max_tokens: 10, temperature: 0 });
      let textStreamed = '';
      for await (const c of await engine.completions.create({ prompt: '', max_tokens: 10, stream: true }))
        textStreamed += c.choices[0].text;
      const stats = await engine.stats();
      unsubscribe();
      await engine.unload();
      const unloaded = await engine.stats();
      engine.terminate();
      return {
        info,
        progress,
        whole,
        chunks,
        text: text.choices[0].text,
        textStreamed,
        stats,
        statsSeen,
        unloadedBytes: unloaded.memory.total,
      };
    }, modelUrl);

    // kv omitted: the 2-bit cache, which stories260K allows (rows of 4 × 8, in groups of 128 over four positions).
    expect(result.info).toMatchObject({ architecture: 'llama', layers: 5, vocab: 512, kv: 'int2' });
    // Progress: phases in order, bytes never going back within a phase, upload complete.
    const phases = result.progress.map((p) => p.phase).filter((p, i, all) => all[i - 1] !== p);
    expect(phases).toEqual(['download', 'parse', 'upload', 'calibrate']);
    for (let i = 1; i < result.progress.length; i++) {
      const [a, b] = [result.progress[i - 1], result.progress[i]];
      if (a.phase === b.phase) expect(b.bytesDone).toBeGreaterThanOrEqual(a.bytesDone);
    }
    const size = statSync(modelFile).size;
    expect(result.progress.find((p) => p.phase === 'download' && p.bytesTotal > 0)?.bytesTotal).toBe(size);
    const upload = result.progress.filter((p) => p.phase === 'upload').at(-1)!;
    expect(upload.bytesDone).toBe(upload.bytesTotal);
    expect(result.progress.at(-1)).toEqual({ phase: 'calibrate', bytesDone: 1, bytesTotal: 1 });

    // Streamed chunks (OpenAI shape) concatenate to the non-streamed reply.
    expect(result.whole.object).toBe('chat.completion');
    expect(result.chunks[0].choices[0].delta.role).toBe('assistant');
    for (const c of result.chunks) expect(c.object).toBe('chat.completion.chunk');
    const streamed = result.chunks.map((c) => c.choices[0].delta.content ?? '').join('');
    expect(streamed.length).toBeGreaterThan(0);
    expect(streamed).toBe(result.whole.choices[0].message.content);
    const last = result.chunks.at(-1)!;
    expect(last.choices[0].finish_reason).toBe(result.whole.choices[0].finish_reason);
    expect(last.usage?.completion_tokens).toBe(result.whole.usage.completion_tokens);
    expect(last.usage?.longtab.decode_tokens_per_second).toBeGreaterThan(0);
    expect(last.usage?.longtab.ttft_ms).toBeGreaterThan(0);

    const golden = JSON.parse(readFileSync(join(sharedRoot, STORIES260K_GOLDEN), 'utf8')) as { greedy_text: string };
    expect(result.text.length).toBeGreaterThan(10);
    expect(golden.greedy_text.startsWith(result.text)).toBe(true);
    expect(result.textStreamed).toBe(result.text);

    expect(result.stats.memory.weights).toBeGreaterThan(0);
    expect(result.stats.kv.pagesBudget).toBeGreaterThan(0);
    expect(result.stats.adapter?.isFallbackAdapter).toBe(true);
    expect(result.statsSeen.length).toBeGreaterThanOrEqual(3);
    expect(result.unloadedBytes).toBe(0);
    expect(pageErrors).toEqual([]);
  });

  test('conversations: interleaved equal alone, and a follow-up turn prefills only its new tokens', async ({
    page,
  }) => {
    const pageErrors = await open(page);
    const result = await page.evaluate(async (url) => {
      const engine = window.harness!.createEngine();
      await engine.load(url, { kvBudgetBytes: 4 << 20 });
      const system = { role: 'system' as const, content: 'You tell short stories about Lily and her red ball.' };
      type Turn = { role: 'user' | 'assistant' | 'system'; content: string };
      const usages: Array<{ prompt: number; cached: number; prefilled: number }> = [];
      async function play(order: string[]): Promise<Record<string, string[]>> {
        const history: Record<string, Turn[]> = {};
        const replies: Record<string, string[]> = {};
        for (const id of order) {
          history[id] ??= [system];
          history[id].push({ role: 'user', content: `What did ${id} do next?` });
          const r = await engine.chat.completions.create({
            messages: history[id],
            conversation_id: id,
            max_tokens: 6,
            temperature: 0,
          });
          history[id].push({ role: 'assistant', content: r.choices[0].message.content ?? '' });
          (replies[id] ??= []).push(r.choices[0].message.content ?? '');
          usages.push({
            prompt: r.usage.prompt_tokens,
            cached: r.usage.prompt_tokens_details.cached_tokens,
            prefilled: r.usage.longtab.prefill_tokens,
          });
        }
        return replies;
      }
      const alone = { ...(await play(['Lily', 'Lily'])), ...(await play(['Tom', 'Tom'])) };
      const followUp = usages.slice(0, 2);
      await engine.deleteConversation('Lily');
      await engine.deleteConversation('Tom');
      const interleaved = await play(['Lily', 'Tom', 'Lily', 'Tom']);
      const stats = await engine.stats();
      engine.terminate();
      return { alone, interleaved, followUp, conversations: stats.context.conversations };
    }, modelUrl);

    expect(result.interleaved).toEqual(result.alone);
    expect(result.alone.Lily).toHaveLength(2);
    // The second turn reused everything the first turn had cached, and prefilled only the rest.
    const [first, second] = result.followUp;
    expect(second.cached).toBeGreaterThanOrEqual(first.prompt);
    expect(second.prefilled).toBe(second.prompt - second.cached);
    expect(second.prefilled).toBeLessThan(second.prompt / 2);
    expect(result.conversations).toBe(2);
    expect(pageErrors).toEqual([]);
  });

  test('abort mid-stream ends with finish_reason "abort" and the engine stays consistent', async ({ page }) => {
    const pageErrors = await open(page);
    const result = await page.evaluate(async (url) => {
      const engine = window.harness!.createEngine();
      await engine.load(url, { kvBudgetBytes: 4 << 20 });
      const messages = [{ role: 'user' as const, content: 'Tell me about Lily.' }];
      const aborted = [];
      const stream = await engine.chat.completions.create({ messages, max_tokens: 300, temperature: 0, stream: true });
      for await (const chunk of stream) {
        aborted.push(chunk);
        if (aborted.length === 3) await engine.abort();
      }
      const afterAbort = await engine.chat.completions.create({ messages, max_tokens: 12, temperature: 0 });
      engine.terminate();
      return { aborted, afterAbort: afterAbort.choices[0].message.content ?? '' };
    }, modelUrl);

    const last = result.aborted.at(-1)!;
    expect(last.choices[0].finish_reason).toBe('abort');
    expect(last.usage!.completion_tokens).toBeLessThan(300);
    const partial = result.aborted.map((c) => c.choices[0].delta.content ?? '').join('');
    expect(result.afterAbort.startsWith(partial) || partial.startsWith(result.afterAbort)).toBe(true);
    expect(pageErrors).toEqual([]);
  });

  test('errors cross the worker boundary as typed errors with their messages', async ({ page }) => {
    const pageErrors = await open(page);
    const result = await page.evaluate(async (url) => {
      const { createEngine, errors } = window.harness!;
      const engine = createEngine();
      const summarize = (e: unknown) => ({
        name: (e as Error).name,
        code: (e as InstanceType<typeof errors.LongtabError>).code,
        message: (e as Error).message,
        details: (e as InstanceType<typeof errors.LongtabError>).details,
        isLongtab: e instanceof errors.LongtabError,
        isInvalid: e instanceof errors.InvalidRequestError,
        isNotLoaded: e instanceof errors.ModelNotLoadedError,
        isOverflow: e instanceof errors.ContextOverflowError,
        isDownload: e instanceof errors.DownloadFailedError,
      });
      const attempt = async (f: () => Promise<unknown>) => {
        try {
          await f();
          return null;
        } catch (error) {
          return summarize(error);
        }
      };
      const user = [{ role: 'user' as const, content: 'Hello' }];
      const notLoaded = await attempt(() => engine.chat.completions.create({ messages: user }));
      const badScheme = await attempt(() => engine.load('ftp://example.com/model.gguf'));
      const missing = await attempt(() => engine.load(url.replace('stories260K.gguf', 'missing.gguf')));
      const badKv = await attempt(() => engine.load(url, { kv: 'int4' as 'int2' }));
      // A Blob (as a File from a picker would be) crosses to the worker by structured clone.
      const blob = await (await fetch(url)).blob();
      // f16: the overflow below is checked against f16 arithmetic (8 pages of 16 positions).
      await engine.load(blob, { kv: 'f16', kvBudgetBytes: 8 * 10240 });
      const badTemperature = await attempt(() => engine.chat.completions.create({ messages: user, temperature: -1 }));
      const unknownField = await attempt(() =>
        engine.chat.completions.create({ messages: user, n: 2 } as unknown as Parameters<
          typeof engine.chat.completions.create
        >[0]),
      );
      const long = [{ role: 'user' as const, content: 'Lily and the ball went to the park. '.repeat(20) }];
      const overflow = await attempt(() => engine.chat.completions.create({ messages: long }));
      // A message that is not a call of the worker's API is answered with an error, and never reaches comlink.
      const rejected = await new Promise((resolve) => {
        engine.worker.addEventListener('message', function listen(event) {
          if (event.data?.id !== 'probe') return;
          engine.worker.removeEventListener('message', listen);
          resolve(event.data.value?.value);
        });
        engine.worker.postMessage({ id: 'probe', type: 'GET', path: ['constructor'] });
      });
      const stillWorks = await engine.chat.completions.create({ messages: user, max_tokens: 3, temperature: 0 });
      engine.terminate();
      return {
        notLoaded,
        badScheme,
        missing,
        badKv,
        badTemperature,
        unknownField,
        overflow,
        rejected,
        stillWorks: stillWorks.usage.completion_tokens,
      };
    }, modelUrl);

    expect(result.notLoaded).toMatchObject({
      code: 'model-not-loaded',
      name: 'ModelNotLoadedError',
      isNotLoaded: true,
    });
    expect(result.notLoaded!.message).toMatch(/call engine.load/);
    expect(result.badScheme).toMatchObject({ code: 'invalid-request', isInvalid: true, isLongtab: true });
    expect(result.badScheme!.message).toMatch(/http\(s\) only/);
    expect(result.missing).toMatchObject({ code: 'download-failed', isDownload: true, details: { status: 404 } });
    expect(result.missing!.message).toMatch(/HTTP 404/);
    expect(result.badKv).toMatchObject({ code: 'invalid-request', isInvalid: true, details: { field: 'kv' } });
    expect(result.badKv!.message).toMatch(/kv = "int4" is invalid/);
    expect(result.badTemperature).toMatchObject({ name: 'InvalidRequestError', isInvalid: true });
    expect(result.badTemperature!.message).toMatch(/temperature = -1/);
    expect(result.unknownField!.message).toMatch(/unknown field 'n'/);
    expect(result.overflow).toMatchObject({
      code: 'context-overflow',
      isOverflow: true,
      details: { tokensAvailable: 128 },
    });
    expect(result.overflow!.message).toMatch(/drop_oldest_turns/);
    expect(result.rejected).toMatchObject({ longtabError: true, code: 'invalid-request' });
    expect((result.rejected as { message: string }).message).toMatch(/only method calls/);
    expect(result.stillWorks).toBe(3);
    expect(pageErrors).toEqual([]);
  });

  test('response_format in the worker: the grammar engine loads there, replies meet their schema and grammar', async ({
    page,
  }) => {
    const pageErrors = await open(page);
    const result = await page.evaluate(async (url) => {
      const { createEngine } = window.harness!;
      const engine = createEngine();
      await engine.load(url, { kv: 'f16', kvBudgetBytes: 1 << 20 });
      const schema = {
        type: 'object',
        properties: { name: { type: 'string', maxLength: 12 }, age: { type: 'integer', minimum: 1, maximum: 9 } },
        required: ['name', 'age'],
        additionalProperties: false,
      };
      const json = await engine.completions.create({
        prompt: 'Lily',
        max_tokens: 48,
        temperature: 0.8,
        seed: 2,
        response_format: { type: 'json_schema', json_schema: { name: 'child', schema } },
      });
      const grammar = await engine.completions.create({
        prompt: 'Lily',
        max_tokens: 16,
        temperature: 1,
        seed: 4,
        response_format: { type: 'grammar', grammar: 'root ::= "The ball is " ("red" | "blue") "."' },
      });
      let bad: unknown = null;
      try {
        await engine.completions.create({
          prompt: 'Lily',
          response_format: { type: 'grammar', grammar: 'root ::= (' },
        });
      } catch (error) {
        bad = { code: (error as { code?: string }).code, details: (error as { details?: unknown }).details };
      }
      const after = await engine.completions.create({ prompt: 'Lily', max_tokens: 4 });
      engine.terminate();
      return {
        json: { text: json.choices[0].text, finish: json.choices[0].finish_reason },
        grammar: grammar.choices[0].text,
        bad,
        after: after.choices[0].text.length,
      };
    }, modelUrl);
    if (result.json.finish === 'stop') {
      const value = JSON.parse(result.json.text) as { name: unknown; age: unknown };
      expect(Object.keys(value).sort()).toEqual(['age', 'name']);
      expect(typeof value.name).toBe('string');
      expect(Number.isInteger(value.age) && (value.age as number) >= 1 && (value.age as number) <= 9).toBe(true);
    } else {
      expect(result.json.finish).toBe('length');
      expect(result.json.text.startsWith('{"name"')).toBe(true);
    }
    expect(result.grammar).toMatch(/^The ball is (red|blue)\.$/);
    expect(result.bad).toMatchObject({ code: 'invalid-request', details: { field: 'response_format.grammar' } });
    expect(result.after).toBeGreaterThan(0);
    expect(pageErrors).toEqual([]);
  });

  test('tools in the worker: a forced call comes back as tool_calls whose arguments meet its schema', async ({
    page,
  }) => {
    const pageErrors = await open(page);
    const result = await page.evaluate(async (url) => {
      const { createEngine } = window.harness!;
      const engine = createEngine();
      await engine.load(url, { kv: 'f16', kvBudgetBytes: 1 << 20 });
      const tools = [
        {
          type: 'function' as const,
          function: {
            name: 'find_toy',
            parameters: {
              type: 'object',
              properties: {
                toy: { enum: ['ball', 'doll', 'kite'] },
                room: { type: 'integer', minimum: 1, maximum: 4 },
              },
              required: ['toy', 'room'],
              additionalProperties: false,
            },
          },
        },
      ];
      const messages = [{ role: 'user' as const, content: 'Where is the ball?' }];
      const stream = await engine.chat.completions.create({
        messages,
        tools,
        tool_choice: { type: 'function', function: { name: 'find_toy' } },
        max_tokens: 96,
        stream: true,
      });
      const calls: unknown[] = [];
      let finish: string | null = null;
      for await (const chunk of stream) {
        calls.push(...(chunk.choices[0].delta.tool_calls ?? []));
        finish = chunk.choices[0].finish_reason ?? finish;
      }
      engine.terminate();
      return { calls, finish };
    }, toolsModelUrl);
    expect(result.finish).toBe('tool_calls');
    expect(result.calls).toHaveLength(1);
    const call = result.calls[0] as { index: number; type: string; function: { name: string; arguments: string } };
    expect(call).toMatchObject({ index: 0, type: 'function', function: { name: 'find_toy' } });
    const args = JSON.parse(call.function.arguments) as { toy: unknown; room: unknown };
    expect(['ball', 'doll', 'kite']).toContain(args.toy);
    expect(Number.isInteger(args.room) && (args.room as number) >= 1 && (args.room as number) <= 4).toBe(true);
    expect(pageErrors).toEqual([]);
  });
});
