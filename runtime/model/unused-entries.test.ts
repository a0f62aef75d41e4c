/**
 * No silent wrong answers (issue 43): every metadata key and tensor a file holds is one the forward pass reads, or one
 * that changes nothing, or the load fails with an UnsupportedModelError naming it — from the file's header, before a
 * byte of tensor data is read. The walk covers every name llama.cpp defines (test/llama-cpp-names.ts) on each
 * supported architecture, and the keys real files of Llama 3.2, Qwen2.5, Qwen3, TinyLlama, SmolLM and Mistral carry.
 */
import { describe, expect, it } from 'vitest';
import { UnsupportedModelError } from '../../core/errors.ts';
import { type ByteSource, GgmlType, type GgufFile, type GgufValue } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { LLAMA_CPP_ARCH_KEYS, LLAMA_CPP_OTHER_KEYS, LLAMA_CPP_TENSOR_NAMES } from '../../test/llama-cpp-names.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { type FixtureBias, type ModelFixtureSpec, modelFixtureGguf } from '../../tools/fixtures/model-fixtures.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { parseGguf } from '../gguf/parse.ts';
import { sourceFromBytes } from '../gguf/sources.ts';
import { type GgufMetadataEntry, metadataEntriesOf, writeGguf } from '../gguf/writer.ts';
import {
  type Architecture,
  layerUsesRope,
  longRopeFactorTensor,
  readModelConfig,
  SUPPORTED_ARCHITECTURES,
} from './config.ts';
import { expectedTensorShapes, validateTensors } from './weights.ts';

/** Every optional bias llama.cpp's loader reads for the architecture (qwen2's q/k/v ones the fixture always has). */
const BIASES: Record<Architecture, FixtureBias[]> = {
  llama: ['q', 'k', 'v', 'o', 'gate', 'up', 'down'],
  qwen2: ['output'],
  qwen3: ['q', 'k', 'v'],
  gemma3: ['q', 'k', 'v'],
  smollm3: ['q', 'k', 'v'],
  // The fixture's q, k and v are fused (as in Phi-3.5/Phi-4-mini files), beside which llama.cpp reads no bias.
  phi3: [],
};

/**
 * A tiny fixture with every optional feature of its architecture: YaRN scaling, biases, Llama 3's rope_freqs, gemma3's
 * sliding window with its pattern and local RoPE base, phi3's fused matrices, partial rotary, LongRoPE factors and the
 * sliding-window key llama.cpp ignores for it.
 */
function richSpec(architecture: Architecture): ModelFixtureSpec {
  return {
    architecture,
    weightType: GgmlType.F32,
    dim: 128,
    layers: 2,
    heads: 2,
    kvHeads: 1,
    headDim: 64,
    ffnDim: 64,
    vocab: 300,
    tiedOutput: false,
    ropeFreqBase: 10000,
    llama3RopeFreqs: architecture === 'llama',
    seed: 43,
    ropeScaling:
      architecture === 'phi3'
        ? { type: 'yarn', factor: 4 }
        : { type: 'yarn', factor: 4, originalContext: 128, attnFactor: 1.1 },
    biases: BIASES[architecture],
    slidingWindow:
      architecture === 'gemma3'
        ? { size: 16, period: 2, ropeBase: 20000 }
        : architecture === 'phi3'
          ? { size: 2047 }
          : undefined,
    ...(architecture === 'phi3' ? { ropeDim: 32, longRope: { originalContext: 128, attnFactor: 1.1 } } : {}),
  };
}

/**
 * Keys real files carry beyond the fixture's, as llama.cpp's load logs list them (public issue threads: Qwen2.5 0.5B
 * and 32B Instruct, Qwen2.5-Coder, Llama 3.2 1B, TinyLlama, Mistral-Small with an imatrix; Qwen3 files add key and
 * value lengths; older llama converters wrote tensor_data_layout).
 */
function realFileKeys(arch: string): GgufMetadataEntry[] {
  return [
    { key: 'general.type', value: 'model' },
    { key: 'general.finetune', value: 'Instruct' },
    { key: 'general.basename', value: 'Qwen2.5' },
    { key: 'general.size_label', value: '0.5B' },
    { key: 'general.license', value: 'apache-2.0' },
    { key: 'general.license.link', value: 'https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/main/LICENSE' },
    { key: 'general.base_model.count', value: 1, type: 'u32' },
    { key: 'general.base_model.0.name', value: 'Qwen2.5 0.5B' },
    { key: 'general.base_model.0.organization', value: 'Qwen' },
    { key: 'general.base_model.0.repo_url', value: 'https://huggingface.co/Qwen/Qwen2.5-0.5B' },
    { key: 'general.tags', value: ['chat', 'text-generation'] },
    { key: 'general.languages', value: ['en'] },
    { key: 'general.file_type', value: 15, type: 'u32' },
    { key: 'general.quantization_version', value: 2, type: 'u32' },
    { key: 'quantize.imatrix.file', value: '/models/imatrix.dat' },
    { key: 'quantize.imatrix.dataset', value: '/training_dir/calibration_datav3.txt' },
    { key: 'quantize.imatrix.entries_count', value: 280, type: 'i32' },
    { key: 'quantize.imatrix.chunks_count', value: 128, type: 'i32' },
    { key: 'tokenizer.ggml.pre', value: 'qwen2' },
    { key: 'tokenizer.ggml.padding_token_id', value: 0, type: 'u32' },
    { key: 'tokenizer.ggml.add_bos_token', value: false },
    { key: 'tokenizer.chat_template', value: "{%- for message in messages %}{{ message['content'] }}{% endfor %}" },
    { key: `${arch}.vocab_size`, value: 300, type: 'u32' },
    { key: `${arch}.attention.key_length`, value: 64, type: 'u32' },
    { key: `${arch}.attention.value_length`, value: 64, type: 'u32' },
    { key: `${arch}.rope.scaling.finetuned`, value: false },
    { key: `${arch}.tensor_data_layout`, value: 'Meta AI original pth' },
    { key: `${arch}.expert_count`, value: 0, type: 'u32' },
    { key: `${arch}.expert_used_count`, value: 0, type: 'u32' },
  ];
}

/** The rich fixture of `arch` with the real-file keys, as bytes and parsed. */
async function richFile(arch: Architecture): Promise<{ bytes: Uint8Array; file: GgufFile }> {
  const plain = modelFixtureGguf(richSpec(arch));
  const fixture = await parseGguf(sourceFromBytes(plain));
  const extra = realFileKeys(arch);
  const kept = metadataEntriesOf(fixture, (key) => !extra.some((e) => e.key === key));
  const bytes = rewrite(fixture, plain, [...kept, ...extra]);
  return { bytes, file: await parseGguf(sourceFromBytes(bytes)) };
}

/** `file` (whose bytes are `bytes`) with new metadata and optionally one more tensor. */
function rewrite(
  file: GgufFile,
  bytes: Uint8Array,
  metadata: GgufMetadataEntry[],
  extraTensor?: string,
): Uint8Array<ArrayBuffer> {
  const tensors = file.tensors.map((t) => ({
    name: t.name,
    shape: t.shape,
    type: t.type,
    data: bytes.subarray(t.offset, t.offset + t.byteLength),
  }));
  if (extraTensor) tensors.push({ name: extraTensor, shape: [64], type: GgmlType.F32, data: new Uint8Array(256) });
  return writeGguf({ metadata, tensors, alignment: file.alignment });
}

/** `file` with one more metadata key (in memory: readModelConfig reads nothing else). */
function withKey(file: GgufFile, key: string, value: GgufValue): GgufFile {
  return { ...file, metadata: { ...file.metadata, [key]: value } };
}

/** `file` with one more (F32 [64]) tensor. */
function withTensor(file: GgufFile, name: string): GgufFile {
  const t = { name, shape: [64], type: GgmlType.F32, offset: file.dataOffset, byteLength: 256 };
  return { ...file, tensors: [...file.tensors, t] };
}

function refusal(run: () => unknown): UnsupportedModelError {
  try {
    run();
  } catch (error) {
    if (error instanceof UnsupportedModelError) return error;
    throw error;
  }
  throw new Error('expected an UnsupportedModelError, and the file was accepted');
}

/**
 * The `<arch>.` keys the loader reads (present in the rich fixture with values it checks), and the neutral ones with
 * the value the forward pass assumes for the rich fixture and one it does not.
 */
const COMMON_READ = [
  'vocab_size',
  'context_length',
  'embedding_length',
  'block_count',
  'feed_forward_length',
  'attention.head_count',
  'attention.head_count_kv',
  'attention.key_length',
  'attention.layer_norm_rms_epsilon',
  'rope.dimension_count',
  'rope.freq_base',
  'rope.scaling.type',
  'rope.scaling.factor',
  'rope.scale_linear',
  'rope.scaling.attn_factor',
  'rope.scaling.original_context_length',
];
/** Keys only an architecture's own loader reads. */
const ARCH_READ: Partial<Record<Architecture, string[]>> = {
  gemma3: ['attention.sliding_window', 'attention.sliding_window_pattern', 'rope.freq_base_swa'],
};
const readKeys = (arch: Architecture) => [...COMMON_READ, ...(ARCH_READ[arch] ?? [])];
type Neutral = Record<string, { assumed: GgufValue; other: GgufValue }>;
/** Neutral keys of one architecture: gemma3 has no logit soft-cap, and its local layers the global layers' sizes. */
const ARCH_NEUTRAL: Partial<Record<Architecture, Neutral>> = {
  gemma3: {
    final_logit_softcapping: { assumed: 0, other: 30 },
    'attention.key_length_swa': { assumed: 64, other: 32 },
    'attention.value_length_swa': { assumed: 64, other: 32 },
    'rope.dimension_count_swa': { assumed: 64, other: 32 },
  },
  // llama.cpp reads phi3's window and turns it off, whatever its value.
  phi3: { 'attention.sliding_window': { assumed: 4096, other: 4096 } },
};
const neutralKeys = (arch: Architecture): Neutral => ({ ...COMMON_NEUTRAL, ...(ARCH_NEUTRAL[arch] ?? {}) });
const COMMON_NEUTRAL: Neutral = {
  tensor_data_layout: { assumed: 'Meta AI original pth', other: 'Meta AI original pth' },
  'rope.scaling.finetuned': { assumed: true, other: true },
  'attention.value_length': { assumed: 64, other: 32 },
  'attention.causal': { assumed: true, other: false },
  expert_count: { assumed: 0, other: 8 },
  expert_used_count: { assumed: 0, other: 2 },
  pooling_type: { assumed: 0, other: 1 },
  'rope.scaling.yarn_beta_fast': { assumed: 32, other: 16 },
  'rope.scaling.yarn_beta_slow': { assumed: 1, other: 2 },
  'rope.scaling.yarn_ext_factor': { assumed: 1, other: 0.5 },
  'rope.scaling.yarn_attn_factor': { assumed: Math.fround(1 + 0.1 * Math.log(4)), other: 1 },
  'rope.scaling.yarn_log_multiplier': { assumed: 0, other: 0.1 },
  'rope.scaling.alpha': { assumed: 0, other: 1000 },
};

describe('every metadata key and tensor is read, neutral, or refused by name', () => {
  it.each(SUPPORTED_ARCHITECTURES)(
    '%s: the fixture with every optional feature and the keys real files carry loads',
    async (arch) => {
      const { file } = await richFile(arch);
      const config = readModelConfig(file);
      expect(() => validateTensors(file, config)).not.toThrow();
      expect(config.ropeScaling).toMatchObject({ type: 'yarn', factor: 4, originalContext: 128 });
      expect(config.ropeScaling.attnFactor).toBeCloseTo(1.1, 6);
      expect(config.biases).toEqual(
        {
          llama: ['q', 'k', 'v', 'o', 'gate', 'up', 'down'],
          qwen2: ['q', 'k', 'v', 'output'],
          qwen3: ['q', 'k', 'v'],
          gemma3: ['q', 'k', 'v'],
          smollm3: ['q', 'k', 'v'],
          phi3: [],
        }[arch],
      );
      // Every tensor of the file is one the forward pass reads.
      expect(file.tensors.map((t) => t.name).sort()).toEqual([...expectedTensorShapes(config).keys()].sort());
    },
  );

  it.each(SUPPORTED_ARCHITECTURES)(
    "%s: each of llama.cpp's architecture keys is read, neutral at the assumed value, or refused naming it",
    async (arch) => {
      const { file } = await richFile(arch);
      const READ = readKeys(arch);
      const NEUTRAL = neutralKeys(arch);
      let refused = 0;
      for (const suffix of LLAMA_CPP_ARCH_KEYS) {
        const key = `${arch}.${suffix}`;
        const neutral = Object.hasOwn(NEUTRAL, suffix) ? NEUTRAL[suffix] : undefined;
        if (READ.includes(suffix)) {
          // Read with the fixture's values (the older scale_linear is the fallback of rope.scaling.factor).
          if (suffix !== 'rope.scale_linear') expect(file.metadata[key], key).toBeDefined();
          continue;
        }
        if (neutral) {
          expect(() => readModelConfig(withKey(file, key, neutral.assumed)), key).not.toThrow();
          if (neutral.other === neutral.assumed) continue;
        }
        const error = refusal(() => readModelConfig(withKey(file, key, neutral ? neutral.other : 1)));
        expect(error.details.key, key).toBe(key);
        expect(error.message).toContain(key);
        refused++;
      }
      // Every key the loader reads or passes is one llama.cpp defines; all the others were refused.
      expect(READ.every((k) => LLAMA_CPP_ARCH_KEYS.includes(k))).toBe(true);
      expect(Object.keys(NEUTRAL).filter((k) => !LLAMA_CPP_ARCH_KEYS.includes(k))).toEqual([]);
      const alwaysNeutral = Object.values(NEUTRAL).filter((n) => n.other === n.assumed).length;
      expect(refused).toBe(LLAMA_CPP_ARCH_KEYS.length - READ.length - alwaysNeutral);
    },
  );

  it.each(SUPPORTED_ARCHITECTURES)(
    '%s: keys outside the neutral namespaces, and keys of another architecture, are refused naming them',
    async (arch) => {
      const { file } = await richFile(arch);
      const other = SUPPORTED_ARCHITECTURES.find((a) => a !== arch);
      const odd = [`${arch}.constructor`, `${arch}.toString`, `${arch}.__proto__`, 'unnamed'];
      for (const key of [...LLAMA_CPP_OTHER_KEYS, `${other}.context_length`, 'clip.has_vision_encoder', ...odd]) {
        expect(refusal(() => readModelConfig(withKey(file, key, 1))).details.key, key).toBe(key);
      }
      // A neutral value stored as a 64-bit integer is still that value.
      expect(() => readModelConfig(withKey(file, `${arch}.expert_count`, 0n))).not.toThrow();
      // Neutral namespaces: provenance, the tokenizer's own keys, shard bookkeeping (an incomplete shard fails the
      // tensor check), longtab's own.
      for (const key of [
        'general.anything',
        'tokenizer.ggml.anything',
        'quantize.anything',
        'split.count',
        'longtab.kv.plan',
      ]) {
        expect(() => readModelConfig(withKey(file, key, 1)), key).not.toThrow();
      }
    },
  );

  it.each(SUPPORTED_ARCHITECTURES)(
    "%s: each of llama.cpp's tensor names (weight and bias) the forward pass does not read is refused naming it",
    async (arch) => {
      const { file } = await richFile(arch);
      const config = readModelConfig(file);
      const expected = expectedTensorShapes(config);
      for (const pattern of LLAMA_CPP_TENSOR_NAMES) {
        for (const suffix of ['weight', 'bias']) {
          const name = `${pattern.replaceAll('%d', '0')}.${suffix}`;
          if (expected.has(name)) continue;
          const error = refusal(() => validateTensors(withTensor(file, name), config));
          expect(error.details.tensor, name).toBe(name);
          expect(error.message).toContain(name);
        }
      }
      // A block past block_count, and a duplicated rope_freqs per block, are refused too.
      for (const name of ['blk.2.attn_q.weight', 'blk.1.rope_freqs.weight']) {
        expect(refusal(() => validateTensors(withTensor(file, name), config)).details.tensor).toBe(name);
      }
    },
  );

  it('the shared stories260K model and the shipped demo model still load', async () => {
    const paths = [sharedPath(STORIES260K), 'public/models/longtab-demo.gguf'].filter((p): p is string => p !== null);
    if (paths.length < 2) console.warn(`*** SKIPPING stories260K: ${STORIES260K} not in LONGTAB_SHARED ***`);
    for (const path of paths) {
      const source = await sourceFromPath(path);
      try {
        const file = await parseGguf(source);
        expect(() => validateTensors(file, readModelConfig(file)), path).not.toThrow();
      } finally {
        await source.close?.();
      }
    }
  });
});

const ctx = withTestGpu();

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

describe('RoPE scaling metadata is read as llama.cpp reads it', () => {
  const config = async (entries: GgufMetadataEntry[]) => {
    const plain = modelFixtureGguf({ ...richSpec('qwen2'), ropeScaling: undefined });
    const file = await parseGguf(sourceFromBytes(plain));
    return readModelConfig(
      await parseGguf(sourceFromBytes(rewrite(file, plain, [...metadataEntriesOf(file), ...entries]))),
    );
  };
  const f32 = (key: string, value: number): GgufMetadataEntry => ({ key: `qwen2.${key}`, value, type: 'f32' });
  const type = (value: string): GgufMetadataEntry => ({ key: 'qwen2.rope.scaling.type', value });

  it('a factor without a type is linear; the older scale_linear is its fallback; 0 or none is no scaling', async () => {
    expect((await config([f32('rope.scaling.factor', 4)])).ropeScaling).toMatchObject({ type: 'linear', factor: 4 });
    expect((await config([f32('rope.scale_linear', 2)])).ropeScaling).toMatchObject({ type: 'linear', factor: 2 });
    expect((await config([f32('rope.scaling.factor', 4), f32('rope.scale_linear', 2)])).ropeScaling.factor).toBe(4);
    expect((await config([f32('rope.scaling.factor', 0)])).ropeScaling.type).toBe('none');
    expect((await config([type('none'), f32('rope.scaling.factor', 4)])).ropeScaling).toMatchObject({
      type: 'none',
      factor: 1,
    });
    // attn_factor scales cos and sin in every mode, as llama.cpp's context does.
    expect((await config([type('none'), f32('rope.scaling.attn_factor', 0.5)])).ropeScaling.attnFactor).toBe(0.5);
  });

  it("YaRN's original context defaults to the context length; other scaling types are refused naming them", async () => {
    const yarn = await config([type('yarn'), f32('rope.scaling.factor', 4)]);
    expect(yarn.ropeScaling).toMatchObject({ type: 'yarn', factor: 4, originalContext: yarn.contextLength });
    for (const name of ['longrope', 'dynamic', 'su']) {
      const error = await config([type(name)]).then(
        () => null,
        (e: unknown) => e,
      );
      expect(error, name).toBeInstanceOf(UnsupportedModelError);
      expect((error as UnsupportedModelError).message).toContain(name);
    }
  });
});

describe("SmolLM3's no-RoPE layers are those of llama.cpp's smollm3 graph", () => {
  it('every 4th layer (3, 7, …) skips RoPE in smollm3, from no key (llama.cpp sets n_no_rope_layer_step = 4); every layer of the others rotates', async () => {
    for (const arch of SUPPORTED_ARCHITECTURES) {
      const config = readModelConfig(
        await parseGguf(sourceFromBytes(modelFixtureGguf({ ...richSpec(arch), layers: 9 }))),
      );
      const rotating = Array.from({ length: 9 }, (_, l) => layerUsesRope(config, l));
      expect(rotating, arch).toEqual(
        arch === 'smollm3' ? [true, true, true, false, true, true, true, false, true] : Array(9).fill(true),
      );
    }
  });
});

describe("Phi-3's fused matrices and LongRoPE sets are llama.cpp's phi3 loader's", () => {
  const phi3 = async (spec: Partial<ModelFixtureSpec>) =>
    readModelConfig(await parseGguf(sourceFromBytes(modelFixtureGguf({ ...richSpec('phi3'), ...spec }))));

  it('attn_qkv and ffn_up are read whole, split by rows; q/k/v and gate matrices beside them are refused', async () => {
    const config = await phi3({});
    expect(config).toMatchObject({ fusedQkv: true, fusedGateUp: true, ropeDim: 32, ropeLayout: 'neox' });
    const shapes = expectedTensorShapes(config);
    expect(shapes.get('blk.0.attn_qkv.weight')).toEqual([128, 2 * 64 + 2 * 64]);
    expect(shapes.get('blk.0.ffn_up.weight')).toEqual([128, 2 * 64]);
    expect(shapes.has('blk.0.ffn_gate.weight')).toBe(false);
    const file = await parseGguf(sourceFromBytes(modelFixtureGguf(richSpec('phi3'))));
    // llama.cpp reads attn_qkv.bias; longtab does not add it, so it refuses the file rather than drop it.
    for (const name of ['blk.0.attn_qkv.bias', 'blk.0.attn_q.weight', 'blk.0.attn_q.bias', 'blk.0.ffn_gate.weight']) {
      expect(refusal(() => validateTensors(withTensor(file, name), config)).details.tensor, name).toBe(name);
    }
  });

  it('the long set where the context exceeds the original one, else the short; an absent set is no factors', async () => {
    const config = await phi3({});
    expect(config.longRope).toEqual({ long: true, short: true, originalContext: 128 });
    expect(longRopeFactorTensor(config, 128)).toBe('rope_factors_short.weight');
    expect(longRopeFactorTensor(config, 129)).toBe('rope_factors_long.weight');
    expect(longRopeFactorTensor({ longRope: { ...config.longRope!, long: false } }, 4096)).toBeNull();
    expect((await phi3({ longRope: undefined })).longRope).toBeNull();
    // Without rope.scaling.original_context_length the training context chooses (llama.cpp's n_ctx_orig_yarn).
    const untuned = await phi3({ longRope: undefined, ropeScaling: undefined, contextLength: 512 });
    expect(untuned.longRope).toBeNull();
    for (const arch of SUPPORTED_ARCHITECTURES.filter((a) => a !== 'phi3')) {
      expect(readModelConfig(await parseGguf(sourceFromBytes(modelFixtureGguf(richSpec(arch))))).longRope).toBeNull();
    }
  });
});

describe('the engine refuses from the header, before reading tensor data or allocating', () => {
  it.each([
    ['an unused metadata key', 'llama.attention.sliding_window', undefined],
    ['a non-default YaRN beta', 'llama.rope.scaling.yarn_beta_fast', undefined],
    ['an unused tensor', undefined, 'blk.0.attn_qkv.weight'],
    ['a mixture-of-experts router', undefined, 'blk.0.ffn_gate_inp.weight'],
  ] as const)('%s', async (_what, key, tensor) => {
    const { bytes, file } = await richFile('llama');
    const metadata = metadataEntriesOf(file);
    if (key) metadata.push({ key, value: 16, type: 'u32' });
    const variant = rewrite(file, bytes, metadata, tensor);
    // The reads of parsing the header alone: the load must read nothing more.
    const header = tracked(variant);
    await parseGguf(header.source);
    const { source, reads } = tracked(variant);
    const baseline = ctx.gpu.allocator.snapshot().totalBuffers;
    const runner = new ModelRunner(ctx.gpu);
    const error = await runner.load(source).then(
      () => null,
      (e: unknown) => e,
    );
    expect(error).toBeInstanceOf(UnsupportedModelError);
    expect((error as UnsupportedModelError).message).toContain(key ?? tensor);
    expect(reads).toEqual(header.reads);
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline);
  });
});
