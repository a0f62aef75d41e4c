/**
 * Split GGUF models (issue 43, point 3): a model split as llama.cpp's gguf-split splits it (tools/fixtures/gguf-split.ts)
 * loads from its shards, from a path in Node and from the first shard's URL, and answers as the whole file does, and
 * as llama.cpp answers from the same shards. One shard alone (a picked File) is refused saying how to load the model,
 * a missing shard fails naming it, and shards that do not belong together are called so; none of it is "damaged.
 * Download it again" (what a split file got before).
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { CorruptModelFileError, DownloadFailedError, InvalidRequestError } from '../../core/errors.ts';
import { type ByteSource, GgmlType } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { describeRefusal, faultLog, isRefusal, rejectionOf } from '../../test/regressions/fault-log.ts';
import { type GgufShard, type GgufSplitOptions, splitGguf } from '../../tools/fixtures/gguf-split.ts';
import { LlamaReference } from '../../tools/fixtures/llama-reference.ts';
import { type ModelFixtureSpec, modelFixtureGguf } from '../../tools/fixtures/model-fixtures.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { createNodeEngine } from '../engine/node.ts';
import { sourceFromPath } from './node-source.ts';
import { parseGguf } from './parse.ts';
import { joinSources, sourceFromBlob, sourceFromBytes, sourceFromUrl } from './sources.ts';
import { parseShardName, shardName } from './split.ts';
import { type GgufMetadataEntry, type GgufTensorInput, writeGguf } from './writer.ts';

const ctx = withTestGpu();
const log = faultLog('split-gguf');

const spec: ModelFixtureSpec = {
  architecture: 'llama',
  weightType: GgmlType.F32,
  dim: 128,
  layers: 2,
  heads: 2,
  kvHeads: 1,
  headDim: 64,
  ffnDim: 256,
  vocab: 300,
  tiedOutput: false,
  ropeFreqBase: 10000,
  llama3RopeFreqs: false,
  seed: 4377,
};
const whole = modelFixtureGguf(spec);
const PROMPT = [1, 40, 120, 7, 260, 33];

/** Three shards of 8, 8 and 5 tensors; and two, the first with the metadata only (--no-tensor-first-split). */
const LAYOUTS: Array<{ name: string; options: GgufSplitOptions; count: number }> = [
  { name: '3 shards of at most 8 tensors', options: { maxTensors: 8 }, count: 3 },
  { name: '2 shards, the first without tensors', options: { maxTensors: 64, firstWithoutTensors: true }, count: 2 },
];

async function shardsOf(options: GgufSplitOptions, prefix = 'model'): Promise<GgufShard[]> {
  return splitGguf(whole, await parseGguf(sourceFromBytes(whole)), prefix, options);
}

/** The shards joined in memory, as sourceFromPath and sourceFromUrl join them. */
function joined(shards: GgufShard[]): ByteSource {
  return joinSources(shards.map((s) => sourceFromBytes(s.bytes, s.name)));
}

/** Greedy ids and teacher-forced logits of the model in `source` (closed afterwards). */
async function answers(source: ByteSource): Promise<{ ids: number[]; logits: Float32Array }> {
  const runner = new ModelRunner(ctx.gpu);
  try {
    await runner.load(source, { kv: 'f16', kvBudgetBytes: 1 << 20 });
    const { ids } = await runner.generate({ promptIds: PROMPT, maxTokens: 12, stopAtEog: false });
    return { ids, logits: await runner.teacherForcedLogits([...PROMPT, ...ids]) };
  } finally {
    runner.unload();
    await source.close?.();
  }
}

function logSoftmaxRows(logits: Float32Array, vocab: number): Float64Array {
  const out = new Float64Array(logits.length);
  for (let r = 0; r < logits.length / vocab; r++) {
    const row = logits.subarray(r * vocab, (r + 1) * vocab);
    const max = Math.max(...row);
    const lse = max + Math.log(row.reduce((sum, v) => sum + Math.exp(v - max), 0));
    for (let i = 0; i < vocab; i++) out[r * vocab + i] = row[i] - lse;
  }
  return out;
}

describe('shard names as gguf-split writes them', () => {
  it('are told from other names, and derived for every part', () => {
    expect(parseShardName('Qwen2.5-7B-Instruct-Q4_K_M-00002-of-00003.gguf')).toEqual({
      prefix: 'Qwen2.5-7B-Instruct-Q4_K_M',
      index: 2,
      count: 3,
    });
    expect(shardName('Qwen2.5-7B-Instruct-Q4_K_M', 1, 3)).toBe('Qwen2.5-7B-Instruct-Q4_K_M-00001-of-00003.gguf');
    for (const single of [
      'model.gguf',
      'model-00001-of-00001.gguf',
      'model-00004-of-00003.gguf',
      'model-1-of-3.gguf',
    ]) {
      expect(parseShardName(single), single).toBeNull();
    }
  });
});

describe('a split model parses as the whole file', () => {
  it.each(LAYOUTS)('$name: the same metadata, tensors and tensor bytes', async ({ options, count }) => {
    const shards = await shardsOf(options);
    expect(shards.map((s) => s.name)).toEqual(
      Array.from({ length: count }, (_, i) => shardName('model', i + 1, count)),
    );
    const one = await parseGguf(sourceFromBytes(whole));
    const source = joined(shards);
    const split = await parseGguf(source);
    expect(split.metadata).toEqual({
      ...one.metadata,
      'split.no': 0,
      'split.count': count,
      'split.tensors.count': one.tensors.length,
    });
    expect(split.fileSize).toBe(source.size);
    expect(split.tensors.map(({ name, shape, type }) => ({ name, shape, type }))).toEqual(
      one.tensors.map(({ name, shape, type }) => ({ name, shape, type })),
    );
    for (const [i, t] of split.tensors.entries()) {
      const u = one.tensors[i];
      const bytes = Buffer.from(await source.read(t.offset, t.byteLength));
      expect(bytes.equals(whole.subarray(u.offset, u.offset + u.byteLength)), t.name).toBe(true);
    }
  });

  it('a read across shards is put together from each', async () => {
    const shards = await shardsOf({ maxTensors: 8 });
    const source = joined(shards);
    const at = shards[0].bytes.byteLength - 10;
    const expected = new Uint8Array([...shards[0].bytes.subarray(at), ...shards[1].bytes.subarray(0, 30)]);
    expect(await source.read(at, 40)).toEqual(expected);
  });
});

describe('one shard, missing shards and shards that do not belong together', () => {
  it('one shard alone (a picked File) is refused: load all the parts, merge them or pick a single file', async () => {
    const shards = await shardsOf({ maxTensors: 8 });
    for (const [i, shard] of shards.entries()) {
      const error = await rejectionOf(parseGguf(sourceFromBlob(new Blob([shard.bytes]), shard.name)));
      expect(error, shard.name).toBeInstanceOf(InvalidRequestError);
      expect((error as Error).message).toMatch(
        new RegExp(`part ${i + 1} of 3 of a split GGUF model.*llama-gguf-split --merge.*single-file GGUF`),
      );
    }
    // Through the engine, as the chat page loads a picked file.
    const engine = createNodeEngine({ gpu: ctx.gpu });
    const message = /part 1 of 3 of a split GGUF model/;
    try {
      const error = await rejectionOf(engine.load(new Blob([shards[0].bytes]), { kv: 'f16' }));
      log.record({
        area: 'load',
        fault: 'engine.load(File) of the first shard of a model split in 3 by gguf-split',
        expected: 'InvalidRequestError saying to load all its parts, merge them or pick a single-file GGUF',
        outcome: describeRefusal(error, message),
        ok: isRefusal(error, InvalidRequestError, message),
      });
      expect(error).toBeInstanceOf(InvalidRequestError);
      expect((error as Error).message).toMatch(message);
    } finally {
      engine.destroy();
    }
  });

  it('shards of another split, renamed, or short of a tensor are refused as not belonging together', async () => {
    const three = await shardsOf({ maxTensors: 8 });
    const two = await shardsOf({ maxTensors: 16 });
    const tensors = (await parseGguf(sourceFromBytes(whole))).tensors.map((t) => ({
      name: t.name,
      shape: t.shape,
      type: t.type,
      data: whole.subarray(t.offset, t.offset + t.byteLength),
    }));
    expect(tensors.length).toBe(21);
    const cases: Array<{ name: string; shards: GgufShard[]; message: RegExp }> = [
      {
        name: 'part 3 renamed as part 2',
        shards: [three[0], three[2], three[1]],
        message: /model-00003-of-00003\.gguf is part 3 of 3 by its metadata, but part 2 of 3 by its name/,
      },
      {
        name: 'a part of a 2-way split among a 3-way split',
        shards: [three[0], two[1], three[2]],
        message: /is part 2 of 2 by its metadata, but part 2 of 3 by its name/,
      },
      {
        name: 'a part holding a tensor of another part',
        shards: [three[0], three[1], laterShard(three[2].name, 2, 3, [...tensors.slice(16), tensors[8]])],
        message: /model-00003-of-00003\.gguf is part 3 of 3 by its metadata and holds tensor blk\.0\.\S+ again/,
      },
      {
        name: 'a part without its last tensor',
        shards: [three[0], three[1], laterShard(three[2].name, 2, 3, tensors.slice(16, 20))],
        message: /hold 20 tensors, but its metadata says 21 \(split\.tensors\.count\)/,
      },
    ];
    for (const c of cases) {
      const error = await rejectionOf(parseGguf(joined(c.shards)));
      log.record({
        area: 'load',
        fault: `split model: ${c.name}`,
        expected: 'CorruptModelFileError naming the part',
        outcome: describeRefusal(error, c.message),
        ok: isRefusal(error, CorruptModelFileError, c.message),
      });
      expect(error, c.name).toBeInstanceOf(CorruptModelFileError);
      expect((error as Error).message, c.name).toMatch(c.message);
    }
  });
});

/** A shard after the first, as gguf-split writes one (its split keys and tensors only), from `tensors`. */
function laterShard(name: string, no: number, count: number, tensors: GgufTensorInput[]): GgufShard {
  const metadata: GgufMetadataEntry[] = [
    { key: 'split.no', value: no, type: 'u16' },
    { key: 'split.count', value: count, type: 'u16' },
    { key: 'split.tensors.count', value: 21, type: 'i32' },
  ];
  return { name, bytes: writeGguf({ metadata, tensors }) };
}

describe('loading a split model', () => {
  let dir: string;
  let llamaCpp: LlamaReference;
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'longtab-split-'));
    llamaCpp = await LlamaReference.create();
  });
  afterAll(async () => {
    await llamaCpp?.dispose();
    if (dir) await rm(dir, { recursive: true });
  });

  it('in Node, from the path of any shard: the whole file’s greedy ids and logits, and llama.cpp’s log-probs from the same shards', async () => {
    const wholePath = join(dir, 'model.gguf');
    await writeFile(wholePath, whole);
    const shards = await shardsOf({ maxTensors: 8 });
    for (const shard of shards) await writeFile(join(dir, shard.name), shard.bytes);
    const reference = await answers(await sourceFromPath(wholePath));
    for (const shard of shards) {
      const fromShard = await answers(await sourceFromPath(join(dir, shard.name)));
      expect(fromShard.ids, shard.name).toEqual(reference.ids);
      expect(fromShard.logits, shard.name).toEqual(reference.logits);
    }
    // llama.cpp loads the same shards from the first one's path (as it finds them by name): the same log-probs as
    // from the whole file, and ours agree with them as on any F32 model (llama-oracle.test.ts: 0.02).
    const ids = [...PROMPT, ...reference.ids];
    const llamaWhole = await llamaCpp.teacherForced(wholePath, ids);
    const llamaSplit = await llamaCpp.teacherForced(join(dir, shards[0].name), ids);
    expect(llamaCpp.errors).toEqual([]);
    expect(llamaSplit.logProbs).toEqual(llamaWhole.logProbs);
    const ours = logSoftmaxRows(reference.logits, spec.vocab);
    let maxDiff = 0;
    for (let i = 0; i < ours.length; i++) maxDiff = Math.max(maxDiff, Math.abs(ours[i] - llamaSplit.logProbs[i]));
    expect(maxDiff).toBeLessThan(0.02);
  });

  it('in Node, a missing shard fails the open naming it', async () => {
    const shards = await shardsOf({ maxTensors: 8 }, 'gap');
    await writeFile(join(dir, shards[0].name), shards[0].bytes);
    await writeFile(join(dir, shards[2].name), shards[2].bytes);
    const error = await rejectionOf(sourceFromPath(join(dir, shards[0].name)));
    const message = /Part 2 of 3 of the split model could not be opened: .*gap-00002-of-00003\.gguf: there is no file/;
    log.record({
      area: 'load',
      fault: 'a model split in 3 with its second shard missing, opened from the first shard’s path',
      expected: 'InvalidRequestError naming the missing shard',
      outcome: describeRefusal(error, message),
      ok: isRefusal(error, InvalidRequestError, message),
    });
    expect(error).toBeInstanceOf(InvalidRequestError);
    expect((error as Error).message).toMatch(message);
  });

  describe('over HTTP', () => {
    let server: Server;
    let base: string;
    const files = new Map<string, Uint8Array>();
    const requested: string[] = [];
    beforeAll(async () => {
      server = createServer((req, res) => {
        const path = decodeURIComponent(new URL(req.url ?? '/', 'http://x').pathname);
        requested.push(path);
        const bytes = files.get(path);
        if (!bytes) {
          res.writeHead(404).end();
          return;
        }
        const range = /^bytes=(\d+)-(\d+)$/.exec(req.headers.range ?? '');
        if (!range) {
          res.writeHead(200, { 'Content-Length': bytes.byteLength }).end(bytes);
          return;
        }
        const start = Number(range[1]);
        const end = Math.min(Number(range[2]), bytes.byteLength - 1);
        res
          .writeHead(206, {
            'Content-Range': `bytes ${start}-${end}/${bytes.byteLength}`,
            'Content-Length': end - start + 1,
          })
          .end(bytes.subarray(start, end + 1));
      });
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
      base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    });
    afterAll(async () => {
      await new Promise<void>((resolve) => server?.close(() => resolve()));
    });

    it('loads from the first shard’s URL, every shard read by its own name, answering as the whole file', async () => {
      const shards = await shardsOf({ maxTensors: 8 }, 'Model Q8');
      for (const shard of shards) files.set(`/models/${shard.name}`, shard.bytes);
      files.set('/models/whole.gguf', whole);
      const reference = await answers(await sourceFromUrl(`${base}/models/whole.gguf`));
      requested.length = 0;
      const url = `${base}/models/${encodeURIComponent(shards[0].name)}?download=true`;
      const fromUrl = await answers(await sourceFromUrl(url));
      expect(fromUrl.ids).toEqual(reference.ids);
      expect(fromUrl.logits).toEqual(reference.logits);
      expect(new Set(requested)).toEqual(new Set(shards.map((s) => `/models/${s.name}`)));
      // And through the engine, as engine.load(url) opens it.
      const engine = createNodeEngine({ gpu: ctx.gpu });
      try {
        await engine.load(url, { kv: 'f16', kvBudgetBytes: 1 << 20 });
      } finally {
        engine.destroy();
      }
    });

    it('a shard missing on the server fails the load naming its URL', async () => {
      const shards = await shardsOf({ maxTensors: 8 }, 'holed');
      files.set(`/models/${shards[0].name}`, shards[0].bytes);
      files.set(`/models/${shards[1].name}`, shards[1].bytes);
      const engine = createNodeEngine({ gpu: ctx.gpu });
      const message =
        /Part 3 of 3 of the split model could not be opened: .*holed-00003-of-00003\.gguf answered HTTP 404/;
      try {
        const error = await rejectionOf(engine.load(`${base}/models/${shards[0].name}`, { kv: 'f16' }));
        log.record({
          area: 'load',
          fault: 'engine.load(url) of a model split in 3 whose third shard the server does not have',
          expected: 'DownloadFailedError naming the missing shard’s URL',
          outcome: describeRefusal(error, message),
          ok: isRefusal(error, DownloadFailedError, message),
        });
        expect(error).toBeInstanceOf(DownloadFailedError);
        expect((error as Error).message).toMatch(message);
      } finally {
        engine.destroy();
      }
    });
  });
});
