/**
 * Conversations' KV in the KV store (a directory here; OPFS in the browser, e2e/kv-persist.spec.ts): on the demo model,
 * a conversation that persists resumes in a new engine (a reload) with its whole history cached and the same reply as
 * in an engine that never ended, its stored pages read back bit for bit; only the pages a turn changed are written
 * again; a damaged, foreign or cut-short record is refused with a note and the history re-prefilled; a full store
 * leaves a note and the conversation going; a conversation evicted past the host budget spills to the store and comes
 * back from it; deleting a conversation deletes its record, even in an engine that never saw it.
 */
import { mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import type {
  ChatCompletion,
  ChatCompletionRequest,
  ChatMessageParam,
  EngineLoadOptions,
  LongtabEngine,
} from './api.ts';
import type { ConversationCache } from './conversations.ts';
import type { KvFileStore } from './kv-file-store.ts';
import { nodeKvFileStore } from './kv-file-store-node.ts';
import { createNodeEngine } from './node.ts';
import { storedRecordName } from './stored-kv.ts';

const ctx = withTestGpu();
const DEMO = 'public/models/longtab-demo.gguf';

const OPENING =
  'It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered as the rightful property of some one or other of their daughters. My dear Mr. Bennet, said his lady to him one day, have you heard that Netherfield Park is let at last?';

const KV_MODES: ReadonlyArray<readonly [string, EngineLoadOptions]> = [
  ['f16', { kv: 'f16' }],
  // A short sink and window, so that most of the history is in 2-bit pages.
  ['int2', { kv: 'int2', rotation: 'hadamard', experimental: { sink: 16, window: 32 } }],
];

let dir = '';
beforeAll(async () => {
  dir = await mkdtemp(join(tmpdir(), 'longtab-kv-store-'));
});
afterAll(async () => {
  await rm(dir, { recursive: true, force: true });
});

/** A store in a directory of its own, counting the bytes written to it (the directory is real). */
function countingStore(name: string, failAfterBytes = Number.POSITIVE_INFINITY) {
  const inner = nodeKvFileStore(join(dir, name));
  const counts = { written: 0 };
  const store: KvFileStore = {
    ...inner,
    async write(record, file, bytes, at) {
      if (counts.written + bytes.byteLength > failAfterBytes) {
        // What Node says on a full disk (OPFS says QuotaExceededError: e2e/kv-persist.spec.ts).
        throw Object.assign(new Error('ENOSPC: no space left on device, write'), { code: 'ENOSPC' });
      }
      counts.written += bytes.byteLength;
      return inner.write(record, file, bytes, at);
    },
  };
  return { store, counts, path: join(dir, name) };
}

async function chat(engine: LongtabEngine, request: ChatCompletionRequest): Promise<ChatCompletion> {
  return (await engine.chat.completions.create({
    temperature: 0,
    max_tokens: 24,
    ...request,
    stream: false,
  })) as ChatCompletion;
}

const turn1: ChatMessageParam[] = [{ role: 'user', content: OPENING }];
const turn2 = (reply: ChatCompletion): ChatMessageParam[] => [
  ...turn1,
  { role: 'assistant', content: reply.choices[0].message.content ?? '' },
  { role: 'user', content: 'And what did Mrs. Bennet say?' },
];

/** Both turns in one engine that never ends: what every resume must reproduce. */
async function neverEnded(options: EngineLoadOptions) {
  const engine = createNodeEngine({ gpu: ctx.gpu });
  try {
    await engine.load(DEMO, { kvBudgetBytes: 8 << 20, ...options, persist: false });
    const first = await chat(engine, { messages: turn1, conversation_id: 'p' });
    const second = await chat(engine, { messages: turn2(first), conversation_id: 'p' });
    return { first, second };
  } finally {
    engine.destroy();
  }
}

/** Runs `work` in an engine on `store`, then unloads it (which waits for the queued save). */
async function inEngine<T>(
  store: KvFileStore,
  options: EngineLoadOptions,
  work: (engine: LongtabEngine) => Promise<T>,
): Promise<T> {
  const engine = createNodeEngine({ gpu: ctx.gpu, kvStore: store });
  try {
    await engine.load(DEMO, { kvBudgetBytes: 8 << 20, ...options });
    const result = await work(engine);
    await engine.unload();
    return result;
  } finally {
    engine.destroy();
  }
}

const cacheOf = (engine: LongtabEngine) => (engine as unknown as { cache: ConversationCache }).cache;

describe('conversations kept in the KV store', () => {
  it.each(KV_MODES)(
    'kv %s: a persisted conversation resumes in a new engine, its pages bit for bit, and answers as if never ended',
    async (_, options) => {
      const expected = await neverEnded(options);
      const { store, counts, path } = countingStore(`resume-${options.kv}`);
      const first = await inEngine(store, { ...options, persist: true }, async (engine) => {
        const reply = await chat(engine, { messages: turn1, conversation_id: 'p' });
        expect(reply.choices[0].message.content).toBe(expected.first.choices[0].message.content);
        return reply;
      });
      const firstWrite = counts.written;
      expect(firstWrite).toBeGreaterThan(0);
      const record = await storedRecordName('p');
      const storedPages = await readFile(join(path, record, 'pages'));
      await inEngine(store, options, async (engine) => {
        // The request opts in (the load option is off here).
        const second = await chat(engine, { messages: turn2(first), conversation_id: 'p', persist: true });
        expect(second.usage.longtab?.kv_from).toBe('storage');
        expect(second.usage.longtab?.kv_note).toBeUndefined();
        expect(second.usage.prompt_tokens_details?.cached_tokens).toBe(
          expected.second.usage.prompt_tokens_details?.cached_tokens,
        );
        expect(second.usage.prompt_tokens_details?.cached_tokens).toBeGreaterThan(100);
        expect(second.choices[0].message.content).toBe(expected.second.choices[0].message.content);
        const stats = await engine.stats();
        expect(stats.stored?.restores).toBe(1);
        expect(stats.stored?.refused).toBe(0);
      });
      // The second save wrote the pages the turn changed (and its header), not the whole history again.
      const secondWrite = counts.written - firstWrite;
      expect(secondWrite).toBeGreaterThan(0);
      expect(secondWrite).toBeLessThan(storedPages.byteLength);
      // Resumed once more, with the same prompt and one token: the pool holds the stored pages, byte for byte, but
      // the last (which the turn rewrites).
      await inEngine(store, options, async (engine) => {
        await chat(engine, { messages: turn2(first), conversation_id: 'p', persist: true, max_tokens: 1 });
        await engine.deleteConversation('none'); // queued after the save: the record is settled
        const entry = cacheOf(engine).peek('p')!;
        const pool = engine.runner!.pool;
        const image = await pool.saveSequence(entry.seq!);
        const stored = await cacheOf(engine)['storedKv']()!.load(pool, 'p', engine.runner!.config.vocab);
        expect(stored).not.toBeNull();
        const pages = stored!.copy.header.pages.length;
        let at = 0;
        for (let page = 0; page < pages - 1; page++) {
          const size = pool.pageBytesByKind[image.kinds[page] === 1 ? 'quant' : 'f16'];
          expect(image.kinds[page]).toBe(stored!.image.kinds[page]);
          const same = Buffer.from(image.bytes.subarray(at, at + size)).equals(
            Buffer.from(stored!.image.bytes.subarray(at, at + size)),
          );
          expect(same, `page ${page}`).toBe(true);
          at += size;
        }
        if (options.kv === 'int2') expect([...image.kinds].filter((k) => k === 1).length).toBeGreaterThan(3);
      });
    },
    600_000,
  );

  it('a damaged, cut-short or foreign record is refused with a note, removed, and the history re-prefilled', async () => {
    const options: EngineLoadOptions = { kv: 'f16', persist: true };
    const expected = await neverEnded(options);
    const { store, path } = countingStore('refused');
    const record = await storedRecordName('p');
    const first = await inEngine(store, options, (engine) => chat(engine, { messages: turn1, conversation_id: 'p' }));
    const pages = await readFile(join(path, record, 'pages'));
    const header = await readFile(join(path, record, 'header'));
    const faults: Array<[string, () => Promise<void>, RegExp, EngineLoadOptions]> = [
      [
        'a flipped byte in the pages',
        async () => {
          const damaged = Buffer.from(pages);
          damaged[Math.floor(damaged.length / 2)] ^= 0x40;
          await writeFile(join(path, record, 'pages'), damaged);
        },
        /checksum/,
        options,
      ],
      [
        'pages cut short',
        () => writeFile(join(path, record, 'pages'), pages.subarray(0, pages.length >> 1)),
        /shorter/,
        options,
      ],
      ['a header cut short', () => writeFile(join(path, record, 'header'), header.subarray(0, 100)), /header/, options],
      // The same conversation in a 2-bit cache: the f16 pages mean nothing there.
      [
        'another KV format',
        async () => {},
        /another model, KV format/,
        { kv: 'int2', rotation: 'none', persist: true },
      ],
    ];
    for (const [what, damage, note, loadWith] of faults) {
      await writeFile(join(path, record, 'pages'), pages);
      await writeFile(join(path, record, 'header'), header);
      await damage();
      await inEngine(store, loadWith, async (engine) => {
        const second = await chat(engine, { messages: turn2(first), conversation_id: 'p' });
        expect(second.usage.longtab?.kv_from, what).toBe('none');
        expect(second.usage.longtab?.kv_note, what).toMatch(note);
        expect(second.usage.prompt_tokens_details?.cached_tokens, what).toBe(0);
        if (loadWith.kv === 'f16') {
          expect(second.choices[0].message.content, what).toBe(expected.second.choices[0].message.content);
        }
        const stats = await engine.stats();
        expect(stats.stored?.refused, what).toBe(1);
        expect(stats.stored?.note, what).toMatch(note);
      });
    }
  }, 600_000);

  it('a full store leaves a note and no record; the conversation goes on from the GPU', async () => {
    const { store, path } = countingStore('full', 4096);
    await inEngine(store, { kv: 'f16', persist: true }, async (engine) => {
      const first = await chat(engine, { messages: turn1, conversation_id: 'p' });
      // The save after the first turn failed; the second turn still finds the sequence on the GPU.
      const second = await chat(engine, { messages: turn2(first), conversation_id: 'p' });
      expect(second.usage.longtab?.kv_from).toBe('gpu');
      expect(second.usage.prompt_tokens_details?.cached_tokens).toBeGreaterThan(100);
      const stats = await engine.stats();
      expect(stats.stored?.note).toMatch(/storage for this site is full/);
      expect(stats.stored?.conversations).toBe(0);
    });
    expect(await readdir(path).catch(() => [])).toEqual([]);
  }, 300_000);

  it.each(KV_MODES)(
    'kv %s: past the host budget an evicted conversation spills to the store and comes back from it',
    async (_, options) => {
      const expected = await neverEnded(options);
      const { store, path } = countingStore(`spill-${options.kv}`);
      await inEngine(store, { ...options, maxSequences: 1, hostKvBudgetBytes: 0 }, async (engine) => {
        const first = await chat(engine, { messages: turn1, conversation_id: 'p' });
        await chat(engine, { messages: [{ role: 'user', content: `Of Mr. Darcy. ${OPENING}` }], conversation_id: 'q' });
        expect((await engine.stats()).stored?.conversations).toBe(1);
        const second = await chat(engine, { messages: turn2(first), conversation_id: 'p' });
        expect(second.usage.longtab?.kv_from).toBe('storage');
        expect(second.usage.prompt_tokens_details?.cached_tokens).toBe(
          expected.second.usage.prompt_tokens_details?.cached_tokens,
        );
        expect(second.choices[0].message.content).toBe(expected.second.choices[0].message.content);
        // p's spill was read once and removed; q, evicted by p, spilled in its turn.
        expect(await readdir(path)).toEqual([await storedRecordName('q')]);
      });
      // A spill does not outlive its engine.
      expect(await readdir(path)).toEqual([]);
    },
    600_000,
  );

  it('deleting a conversation deletes its record, in an engine that never saw it too; clearStoredKv empties the store', async () => {
    const { store, path } = countingStore('delete');
    await inEngine(store, { kv: 'f16', persist: true }, async (engine) => {
      await chat(engine, { messages: turn1, conversation_id: 'p' });
      await chat(engine, { messages: turn1, conversation_id: 'q' });
      await chat(engine, { messages: turn1, conversation_id: 'r' });
    });
    expect((await readdir(path)).length).toBe(3);
    const engine = createNodeEngine({ gpu: ctx.gpu, kvStore: store });
    try {
      const usage = await engine.storedKv();
      expect(usage?.records).toBe(3);
      expect(usage?.bytes).toBeGreaterThan(0);
      await engine.deleteConversation('p');
      expect((await readdir(path)).sort()).toEqual([await storedRecordName('q'), await storedRecordName('r')].sort());
      await engine.clearStoredKv();
      expect(await readdir(path)).toEqual([]);
      expect((await engine.storedKv())?.records).toBe(0);
    } finally {
      engine.destroy();
    }
  }, 300_000);

  it('persist needs a store and a conversation', async () => {
    const engine = createNodeEngine({ gpu: ctx.gpu });
    try {
      await expect(engine.load(DEMO, { persist: true })).rejects.toThrow(/no KV store/);
      await engine.load(DEMO, { kv: 'f16' });
      await expect(chat(engine, { messages: turn1, conversation_id: 'p', persist: true })).rejects.toThrow(
        /no KV store/,
      );
      await expect(chat(engine, { messages: turn1, persist: true })).rejects.toThrow(/conversation_id/);
    } finally {
      engine.destroy();
    }
  }, 120_000);
});
