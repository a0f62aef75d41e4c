import { CorruptModelFileError, UnsupportedModelError } from '../../core/errors.ts';
import type { GgufFile, GgufTensorInfo } from '../../core/gguf-types.ts';
import type { RopeLayout } from '../../kernels/rope.ts';
import { metaNumber, metaOptionalNumber, metaString } from '../gguf/metadata.ts';

export type Architecture = 'llama' | 'qwen2' | 'qwen3';
export const SUPPORTED_ARCHITECTURES: readonly Architecture[] = ['llama', 'qwen2', 'qwen3'];

/** Everything the forward pass needs to know about a model's shape, read once from GGUF metadata. */
export interface ModelConfig {
  architecture: Architecture;
  name: string;
  layers: number;
  dim: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  ffnDim: number;
  vocab: number;
  contextLength: number;
  rmsEps: number;
  ropeBase: number;
  ropeDim: number;
  ropeLayout: RopeLayout;
  /** qwen2: biases on the q, k and v projections. */
  qkvBias: boolean;
  /** qwen3: RMSNorm over each head of q and k before RoPE. */
  qkNorm: boolean;
  /** The output projection reuses the token embedding when the file has no `output.weight`. */
  tiedOutput: boolean;
  /** Llama 3 frequency scaling: `rope_freqs.weight` is present. */
  ropeFreqFactors: boolean;
}

/** llama.cpp's rope type per architecture: Llama keeps adjacent pairs, Qwen rotates halves. */
const ROPE_LAYOUT: Record<Architecture, RopeLayout> = { llama: 'normal', qwen2: 'neox', qwen3: 'neox' };

export function readModelConfig(file: GgufFile): ModelConfig {
  const meta = file.metadata;
  const arch = metaString(meta, 'general.architecture');
  if (!SUPPORTED_ARCHITECTURES.includes(arch as Architecture)) {
    throw new UnsupportedModelError(
      `Architecture '${arch}' is not supported; longtab runs ${SUPPORTED_ARCHITECTURES.join(', ')} (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2/2.5, Qwen3).`,
      { architecture: arch },
    );
  }
  const architecture = arch as Architecture;
  const tensors = new Map<string, GgufTensorInfo>(file.tensors.map((t) => [t.name, t]));
  const dim = metaNumber(meta, `${arch}.embedding_length`);
  const heads = metaNumber(meta, `${arch}.attention.head_count`);
  const headDim = metaOptionalNumber(meta, `${arch}.attention.key_length`) ?? dim / heads;
  const embedding = tensors.get('token_embd.weight');
  const tokens = meta['tokenizer.ggml.tokens'];
  const vocab =
    metaOptionalNumber(meta, `${arch}.vocab_size`) ??
    embedding?.shape[1] ??
    (Array.isArray(tokens) ? tokens.length : 0);
  const config: ModelConfig = {
    architecture,
    name: typeof meta['general.name'] === 'string' ? (meta['general.name'] as string) : architecture,
    layers: metaNumber(meta, `${arch}.block_count`),
    dim,
    heads,
    kvHeads: metaOptionalNumber(meta, `${arch}.attention.head_count_kv`) ?? heads,
    headDim,
    ffnDim: metaNumber(meta, `${arch}.feed_forward_length`),
    vocab,
    contextLength: metaOptionalNumber(meta, `${arch}.context_length`) ?? 2048,
    rmsEps: metaOptionalNumber(meta, `${arch}.attention.layer_norm_rms_epsilon`) ?? 1e-5,
    ropeBase: metaOptionalNumber(meta, `${arch}.rope.freq_base`) ?? 10000,
    ropeDim: metaOptionalNumber(meta, `${arch}.rope.dimension_count`) ?? headDim,
    ropeLayout: ROPE_LAYOUT[architecture],
    qkvBias: tensors.has('blk.0.attn_q.bias'),
    qkNorm: tensors.has('blk.0.attn_q_norm.weight'),
    tiedOutput: !tensors.has('output.weight'),
    ropeFreqFactors: tensors.has('rope_freqs.weight'),
  };
  checkShape(config, file.tensors.length);
  return config;
}

/**
 * Hyperparameters that no tensor table could back (found by fuzzing the loader): a block count of 10^9 would build a
 * 10^10-entry list of expected tensors before any shape check ran. Each layer needs at least 9 tensors.
 */
function checkShape(c: ModelConfig, tensorCount: number): void {
  const sizes: Array<[string, number, number]> = [
    ['block_count', c.layers, Math.floor(tensorCount / 9)],
    ['embedding_length', c.dim, 1 << 20],
    ['attention.head_count', c.heads, 1 << 16],
    ['attention.head_count_kv', c.kvHeads, c.heads],
    ['head dimension', c.headDim, 1 << 16],
    ['feed_forward_length', c.ffnDim, 1 << 24],
    ['vocab size', c.vocab, 1 << 24],
    ['context_length', c.contextLength, 2 ** 40],
    // rope_freqs.ones has ropeDim/2 floats: a fuzzed 10^9 allocated gigabytes.
    ['rope.dimension_count', c.ropeDim, c.headDim],
  ];
  for (const [name, value, max] of sizes) {
    if (!Number.isInteger(value) || value < 1 || value > max) {
      throw new CorruptModelFileError(
        `The model's ${name} is ${value}, which its ${tensorCount} tensors cannot back (expected an integer in 1..${max}): the file is damaged. Download it again.`,
        { field: name, value },
      );
    }
  }
}
