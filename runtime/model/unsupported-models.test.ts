/**
 * Models longtab cannot run are refused from the metadata (issue 43, point 3): heads the attention kernels do not take
 * (wider than 256 dims, or not a multiple of 8), mixtures of experts (Mixtral in llama files, Qwen3-MoE) and
 * hyperparameters that differ per layer fail with an UnsupportedModelError naming why, never as "damaged" and before a
 * byte of tensor data is read, from memory or over HTTP. A per-layer array whose layers all agree loads and answers as
 * the scalar does.
 */
import { afterEach, describe, expect, it } from 'vitest';
import { UnsupportedModelError } from '../../core/errors.ts';
import { type ByteSource, GgmlType, type GgufFile } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { type FileServer, startFileServer } from '../../test/http-file-server.ts';
import { describeRefusal, faultLog, isRefusal, rejectionOf } from '../../test/regressions/fault-log.ts';
import { type ModelFixtureSpec, modelFixtureGguf } from '../../tools/fixtures/model-fixtures.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { createNodeEngine } from '../engine/node.ts';
import { parseGguf } from '../gguf/parse.ts';
import { sourceFromBytes, sourceFromUrl } from '../gguf/sources.ts';
import { type GgufMetadataEntry, type GgufTensorInput, metadataEntriesOf, writeGguf } from '../gguf/writer.ts';
import { readModelConfig } from './config.ts';
import { validateTensors } from './weights.ts';

const ctx = withTestGpu();
const log = faultLog('unsupported-models');

const base: ModelFixtureSpec = {
  architecture: 'llama',
  weightType: GgmlType.Q8_0,
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
  seed: 4303,
};

interface Rewrite {
  /** New metadata from the fixture's entries. */
  metadata?: (entries: GgufMetadataEntry[]) => GgufMetadataEntry[];
  /** New tensors from the fixture's (with their bytes). */
  tensors?: (tensors: GgufTensorInput[]) => GgufTensorInput[];
}

/** The fixture of `spec`, optionally rewritten, as bytes and parsed. */
async function fixture(spec: ModelFixtureSpec, change: Rewrite = {}): Promise<{ bytes: Uint8Array; file: GgufFile }> {
  const plain = modelFixtureGguf(spec);
  const file = await parseGguf(sourceFromBytes(plain));
  if (!change.metadata && !change.tensors) return { bytes: plain, file };
  const tensors = file.tensors.map((t) => ({
    name: t.name,
    shape: t.shape,
    type: t.type,
    data: plain.subarray(t.offset, t.offset + t.byteLength),
  }));
  const bytes = writeGguf({
    metadata: (change.metadata ?? ((e) => e))(metadataEntriesOf(file)),
    tensors: (change.tensors ?? ((t) => t))(tensors),
    alignment: file.alignment,
  });
  return { bytes, file: await parseGguf(sourceFromBytes(bytes)) };
}

const setArray = (key: string, values: number[]) => (entries: GgufMetadataEntry[]) =>
  entries.map((e) => (e.key === key ? { key, value: values, type: 'u32[]' as const } : e));
const f32Tensor = (name: string, shape: number[]): GgufTensorInput => ({
  name,
  shape,
  type: GgmlType.F32,
  data: new Uint8Array(shape.reduce((a, b) => a * b, 4)),
});

/**
 * A dense fixture made a mixture of `experts` experts as llama.cpp lays one out: a router (`ffn_gate_inp`) and the
 * experts' FFN matrices stacked (`ffn_gate_exps` …) in place of the dense ones, the architecture renamed to `arch`.
 */
function mixtureOfExperts(spec: ModelFixtureSpec, arch: string, experts: number): Rewrite {
  const from = `${spec.architecture}.`;
  return {
    metadata: (entries) => [
      ...entries.map((e) =>
        e.key === 'general.architecture'
          ? { ...e, value: arch }
          : e.key.startsWith(from)
            ? { ...e, key: `${arch}.${e.key.slice(from.length)}` }
            : e,
      ),
      { key: `${arch}.expert_count`, value: experts, type: 'u32' },
      { key: `${arch}.expert_used_count`, value: 2, type: 'u32' },
    ],
    tensors: (tensors) =>
      tensors.flatMap((t) => {
        const ffn = /^blk\.(\d+)\.ffn_(gate|up|down)\.weight$/.exec(t.name);
        if (!ffn) return [t];
        const stacked = f32Tensor(`blk.${ffn[1]}.ffn_${ffn[2]}_exps.weight`, [...t.shape, experts]);
        return ffn[2] === 'gate'
          ? [f32Tensor(`blk.${ffn[1]}.ffn_gate_inp.weight`, [spec.dim, experts]), stacked]
          : [stacked];
      }),
  };
}

/** A llama file with heads of 512 dims, twice Falcon3's (heads × 512 = dim, so no key_length key). */
const wideHeads: ModelFixtureSpec = { ...base, dim: 1024, heads: 2, kvHeads: 1, headDim: 512, ffnDim: 256 };

interface Refusal {
  name: string;
  build: () => Promise<{ bytes: Uint8Array; file: GgufFile }>;
  message: RegExp;
}

const REFUSALS: Refusal[] = [
  {
    name: 'a llama file with 512-dim heads',
    build: () => fixture(wideHeads),
    message: /heads have 512 dims \(llama\.embedding_length ÷ llama\.attention\.head_count\).*up to 256 dims/,
  },
  {
    name: 'a qwen3 file with 512-dim heads (key_length)',
    build: () => fixture({ ...base, architecture: 'qwen3', dim: 256, headDim: 512, ffnDim: 256 }),
    message: /heads have 512 dims \(qwen3\.attention\.key_length\).*up to 256 dims/,
  },
  {
    name: 'heads of 20 dims (not a multiple of 8)',
    build: () => fixture({ ...base, weightType: GgmlType.F32, dim: 80, heads: 4, kvHeads: 2, headDim: 20 }),
    message: /heads have 20 dims \(llama\.embedding_length ÷ llama\.attention\.head_count\).*multiples of 8/,
  },
  {
    name: 'a Mixtral-style llama file (expert_count 4, stacked experts and a router)',
    build: () => fixture(base, mixtureOfExperts(base, 'llama', 4)),
    message: /mixture-of-experts model \(llama, llama\.expert_count = 4\).*dense models only/,
  },
  {
    name: 'a llama file with expert tensors and no expert_count',
    build: () =>
      fixture(base, {
        tensors: (tensors) => [...tensors, f32Tensor('blk.0.ffn_gate.0.weight', [base.dim, base.ffnDim])],
      }),
    message: /mixture-of-experts model \(llama, it has tensor 'blk\.0\.ffn_gate\.0\.weight'\)/,
  },
  {
    name: 'a Qwen3-MoE file',
    build: () =>
      fixture({ ...base, architecture: 'qwen3' }, mixtureOfExperts({ ...base, architecture: 'qwen3' }, 'qwen3moe', 8)),
    message: /mixture-of-experts model \(qwen3moe, qwen3moe\.expert_count = 8\).*dense models only/,
  },
  {
    name: 'KV heads per layer, not all the same',
    build: () => fixture(base, { metadata: setArray('llama.attention.head_count_kv', [1, 2]) }),
    message: /llama\.attention\.head_count_kv per layer \(1, 2\).*layers all have the same shape/,
  },
  {
    name: 'FFN width per layer, not all the same',
    build: () => fixture(base, { metadata: setArray('llama.feed_forward_length', [256, 512]) }),
    message: /llama\.feed_forward_length per layer \(256, 512\)/,
  },
];

/** A source that logs every read as "offset+length". */
function tracked(bytes: Uint8Array): { source: ByteSource; reads: string[] } {
  const inner = sourceFromBytes(bytes);
  const reads: string[] = [];
  return {
    source: {
      name: inner.name,
      size: inner.size,
      read: (offset, length) => {
        reads.push(`${offset}+${length}`);
        return inner.read(offset, length);
      },
    },
    reads,
  };
}

describe('models longtab cannot run are refused from the metadata, as unsupported', () => {
  it.each(REFUSALS)('$name: readModelConfig or validateTensors refuses it naming why', async ({ build, message }) => {
    const { file } = await build();
    const error = await rejectionOf(Promise.resolve().then(() => validateTensors(file, readModelConfig(file))));
    expect(error).toBeInstanceOf(UnsupportedModelError);
    expect((error as Error).message).toMatch(message);
  });

  it.each(REFUSALS)(
    '$name: the engine refuses it having read only the header, with no GPU buffer made',
    async ({ name, build, message }) => {
      const { bytes } = await build();
      // The reads of parsing the header alone: the load must read nothing more.
      const header = tracked(bytes);
      await parseGguf(header.source);
      const { source, reads } = tracked(bytes);
      const baseline = ctx.gpu.allocator.snapshot();
      const error = await rejectionOf(new ModelRunner(ctx.gpu).load(source, { kv: 'f16' }));
      const after = ctx.gpu.allocator.snapshot();
      const extraReads = reads.filter((r) => !header.reads.includes(r));
      log.record({
        area: 'model',
        fault: name,
        expected: 'UnsupportedModelError saying why, from the header (no tensor read), 0 GPU buffers',
        outcome: `${describeRefusal(error, message)}; ${extraReads.length} reads past the header; ${after.totalBuffers - baseline.totalBuffers} buffers`,
        ok:
          isRefusal(error, UnsupportedModelError, message) &&
          extraReads.length === 0 &&
          after.totalBuffers === baseline.totalBuffers,
      });
      expect(error).toBeInstanceOf(UnsupportedModelError);
      expect((error as Error).message).toMatch(message);
      expect(reads).toEqual(header.reads);
      expect(after.totalBuffers).toBe(baseline.totalBuffers);
      expect(after.totalBytes).toBe(baseline.totalBytes);
    },
  );

  describe('over HTTP', () => {
    let server: FileServer | null = null;
    afterEach(async () => {
      await server?.close();
      server = null;
    });

    it('engine.load(url) of a 512-dim-head model asks for the header ranges only, not its 10 MB of weights', async () => {
      const { bytes, file } = await fixture({ ...wideHeads, weightType: GgmlType.F32 });
      server = await startFileServer({ bytes, etag: '"f3"', lastModified: null });
      // The requests of parsing the header alone (after the probe).
      await parseGguf(await sourceFromUrl(server.url));
      const headerRanges = server.requests.slice(1).map((h) => h.range);
      server.requests.length = 0;
      const engine = createNodeEngine({ gpu: ctx.gpu });
      try {
        const error = await rejectionOf(engine.load(server.url, { kv: 'f16' }));
        const ranges = server.requests.slice(1).map((h) => h.range);
        const firstTensor = Math.min(...file.tensors.map((t) => t.offset));
        expect(bytes.byteLength - firstTensor).toBeGreaterThan(10e6);
        expect(error).toBeInstanceOf(UnsupportedModelError);
        expect((error as Error).message).toMatch(/heads have 512 dims/);
        expect(ranges).toEqual(headerRanges);
        expect(headerRanges.length).toBeGreaterThan(0);
      } finally {
        engine.destroy();
      }
    });
  });

  it('KV heads, heads and FFN width written per layer, all alike, load and answer as the scalars do', async () => {
    const spec = { ...base, kvHeads: 2 };
    const scalar = await fixture(spec);
    const perLayer = await fixture(spec, {
      metadata: (entries) =>
        ['llama.attention.head_count_kv', 'llama.attention.head_count', 'llama.feed_forward_length'].reduce(
          (e, key) => setArray(key, [Number(scalar.file.metadata[key]), Number(scalar.file.metadata[key])])(e),
          entries,
        ),
    });
    expect(Array.isArray(perLayer.file.metadata['llama.attention.head_count_kv'])).toBe(true);
    expect(readModelConfig(perLayer.file)).toEqual(readModelConfig(scalar.file));
    const runner = new ModelRunner(ctx.gpu);
    const answers: number[][] = [];
    for (const { bytes } of [scalar, perLayer]) {
      await runner.load(sourceFromBytes(bytes), { kv: 'f16' });
      answers.push((await runner.generate({ promptIds: [1, 70, 80], maxTokens: 8, stopAtEog: false })).ids);
    }
    runner.unload();
    expect(answers[0].length).toBe(8);
    expect(answers[1]).toEqual(answers[0]);
  });
});
