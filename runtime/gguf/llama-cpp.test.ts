/**
 * Cross-check of the writer against llama.cpp itself (through node-llama-cpp): a tiny llama written by writeGguf must
 * load, report the hyperparameters we wrote, tokenize with the vocabulary we wrote, and run a forward pass that reads
 * the weights from the offsets we wrote.
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { getLlama, type Llama, LlamaLogLevel } from 'node-llama-cpp';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { GgmlType } from '../../core/gguf-types.ts';
import { seededRandom } from '../../test/random.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { sentencePieceVocabularyMetadata } from '../../tools/fixtures/vocabulary.ts';
import { sourceFromPath } from './node-source.ts';
import { parseGguf } from './parse.ts';
import { type GgufMetadataEntry, type GgufTensorInput, metadataEntriesOf, writeGguf } from './writer.ts';

const EMBED = 32;
const HEADS = 4;
const KV_HEADS = 2;
const FFN = 64;
const CONTEXT = 64;
const KV_WIDTH = (EMBED / HEADS) * KV_HEADS;

/** A minimal SentencePiece vocabulary: specials, 256 byte-fallback tokens, and the prefixes that merge into words. */
function sentencePieceVocabulary(): GgufMetadataEntry[] {
  return sentencePieceVocabularyMetadata([
    '▁',
    'h',
    'e',
    'l',
    'o',
    'a',
    'b',
    '▁a',
    '▁b',
    '▁h',
    '▁he',
    '▁hel',
    '▁hell',
    '▁hello',
  ]);
}

/** Q8_0 blocks (f16 scale + 32 int8) whose scale is the power of two `2^scaleExponent`, exact in f16. */
function q8_0Tensor(name: string, shape: number[], scaleExponent: number, random: () => number): GgufTensorInput {
  const blocks = (shape[0] / 32) * shape.slice(1).reduce((a, b) => a * b, 1);
  const data = new Uint8Array(blocks * 34);
  const view = new DataView(data.buffer);
  for (let block = 0; block < blocks; block++) {
    view.setUint16(block * 34, (scaleExponent + 15) << 10, true);
    for (let i = 0; i < 32; i++) view.setInt8(block * 34 + 2 + i, Math.round((random() * 2 - 1) * 127));
  }
  return { name, shape, type: GgmlType.Q8_0, data };
}

/** F16 values of magnitude in [2^-7, 2^-6) with random signs: small enough to perturb, never to dominate. */
function smallF16Tensor(name: string, shape: number[], random: () => number): GgufTensorInput {
  const count = shape.reduce((a, b) => a * b, 1);
  const halves = new Uint16Array(count);
  for (let i = 0; i < count; i++) {
    halves[i] = (random() < 0.5 ? 0x8000 : 0) | ((-7 + 15) << 10) | Math.floor(random() * 1024);
  }
  return { name, shape, type: GgmlType.F16, data: new Uint8Array(halves.buffer) };
}

function f32Tensor(name: string, shape: number[], value: (i: number) => number): GgufTensorInput {
  const count = shape.reduce((a, b) => a * b, 1);
  const floats = Float32Array.from({ length: count }, (_, i) => value(i));
  return { name, shape, type: GgmlType.F32, data: new Uint8Array(floats.buffer) };
}

/**
 * A two-layer llama whose output matrix equals its embedding and whose layers only nudge the residual stream, so its
 * greedy next token is the input token: a check that llama.cpp read every tensor from where the writer put it.
 * Layer 0 is F16/F32, layer 1 Q8_0, the embedding Q8_0.
 */
function tinyLlama(tokenizer: GgufMetadataEntry[], vocabularySize: number): Uint8Array {
  const random = seededRandom(20261129);
  const embedding = q8_0Tensor('token_embd.weight', [EMBED, vocabularySize], -7, random);
  const ones = (name: string) => f32Tensor(name, [EMBED], () => 1);
  const smallF32 = (name: string, shape: number[]) => f32Tensor(name, shape, () => (random() * 2 - 1) * 0.01);
  const tensors: GgufTensorInput[] = [
    embedding,
    ones('output_norm.weight'),
    { ...embedding, name: 'output.weight' },
    ones('blk.0.attn_norm.weight'),
    smallF16Tensor('blk.0.attn_q.weight', [EMBED, EMBED], random),
    smallF16Tensor('blk.0.attn_k.weight', [EMBED, KV_WIDTH], random),
    smallF16Tensor('blk.0.attn_v.weight', [EMBED, KV_WIDTH], random),
    smallF16Tensor('blk.0.attn_output.weight', [EMBED, EMBED], random),
    ones('blk.0.ffn_norm.weight'),
    smallF32('blk.0.ffn_gate.weight', [EMBED, FFN]),
    smallF32('blk.0.ffn_up.weight', [EMBED, FFN]),
    smallF32('blk.0.ffn_down.weight', [FFN, EMBED]),
    ones('blk.1.attn_norm.weight'),
    q8_0Tensor('blk.1.attn_q.weight', [EMBED, EMBED], -12, random),
    q8_0Tensor('blk.1.attn_k.weight', [EMBED, KV_WIDTH], -12, random),
    q8_0Tensor('blk.1.attn_v.weight', [EMBED, KV_WIDTH], -12, random),
    q8_0Tensor('blk.1.attn_output.weight', [EMBED, EMBED], -12, random),
    ones('blk.1.ffn_norm.weight'),
    q8_0Tensor('blk.1.ffn_gate.weight', [EMBED, FFN], -12, random),
    q8_0Tensor('blk.1.ffn_up.weight', [EMBED, FFN], -12, random),
    q8_0Tensor('blk.1.ffn_down.weight', [FFN, EMBED], -12, random),
  ];
  return writeGguf({
    metadata: [
      { key: 'general.architecture', value: 'llama' },
      { key: 'general.name', value: 'longtab writer cross-check' },
      { key: 'llama.context_length', type: 'u32', value: CONTEXT },
      { key: 'llama.embedding_length', type: 'u32', value: EMBED },
      { key: 'llama.feed_forward_length', type: 'u32', value: FFN },
      { key: 'llama.block_count', type: 'u32', value: 2 },
      { key: 'llama.attention.head_count', type: 'u32', value: HEADS },
      { key: 'llama.attention.head_count_kv', type: 'u32', value: KV_HEADS },
      { key: 'llama.attention.layer_norm_rms_epsilon', type: 'f32', value: 1e-5 },
      { key: 'llama.rope.dimension_count', type: 'u32', value: EMBED / HEADS },
      { key: 'llama.rope.freq_base', type: 'f32', value: 10000 },
      ...tokenizer,
    ],
    tensors,
  });
}

describe('llama.cpp accepts files from writeGguf', () => {
  let llama: Llama;
  let dir: string;
  const llamaErrors: string[] = [];

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'longtab-llama-cpp-'));
    llama = await getLlama({
      gpu: false,
      build: 'never',
      logLevel: LlamaLogLevel.error,
      logger: (level, message) => {
        if (level === LlamaLogLevel.error || level === LlamaLogLevel.fatal) llamaErrors.push(message);
      },
    });
  });
  afterAll(async () => {
    await llama?.dispose();
    if (dir) await rm(dir, { recursive: true });
  });

  /** Loads the file, checks what llama.cpp reports, and returns greedy next tokens for `text`. */
  async function loadAndRun(bytes: Uint8Array, text: string, vocabularySize: number) {
    const modelPath = join(dir, `model-${vocabularySize}.gguf`);
    await writeFile(modelPath, bytes);
    const model = await llama.loadModel({ modelPath });
    try {
      const params = model.fileInfo.metadata.llama as Record<string, unknown>;
      expect(params.embedding_length).toBe(EMBED);
      expect(params.block_count).toBe(2);
      expect(params.feed_forward_length).toBe(FFN);
      expect(model.trainContextSize).toBe(CONTEXT);
      expect(model.fileInsights.totalLayers).toBe(3); // two blocks plus the output layer
      expect(model.tokens.bos).toBe(1);
      expect(model.tokens.eos).toBe(2);

      const context = await model.createContext({ contextSize: CONTEXT, threads: 1 });
      try {
        const tokens = model.tokenize(text);
        const outputs = await context
          .getSequence()
          .controlledEvaluate(
            tokens.map((token) => [token, { generateNext: { token: true, options: { temperature: 0 } } }]),
          );
        return { tokens, nextTokens: outputs.map((output) => output?.next?.token) };
      } finally {
        await context.dispose();
      }
    } finally {
      await model.dispose();
    }
  }

  it('loads a tiny llama with a SentencePiece vocabulary and runs it', async () => {
    const tokenizer = sentencePieceVocabulary();
    const vocabularySize = (tokenizer[1].value as string[]).length;
    const bytes = tinyLlama(tokenizer, vocabularySize);
    const { tokens, nextTokens } = await loadAndRun(bytes, 'hello a b', vocabularySize);
    const vocabulary = tokenizer[1].value as string[];
    expect(tokens.map((token) => vocabulary[token])).toEqual(['▁hello', '▁a', '▁b']);
    // Output = embedding and small layers: each position's greedy next token is its own input token.
    expect(nextTokens).toEqual(tokens);
    expect(llamaErrors).toEqual([]);
  });

  const storiesPath = sharedPath(STORIES260K);
  it.skipIf(storiesPath === null)('loads a llama carrying the tokenizer copied from stories260K', async () => {
    const source = await sourceFromPath(storiesPath!);
    const stories = await parseGguf(source);
    await source.close?.();
    const tokenizer = metadataEntriesOf(
      stories,
      (key) => key.startsWith('tokenizer.') && !key.endsWith('seperator_token_id') && !key.endsWith('padding_token_id'),
    );
    const bytes = tinyLlama(tokenizer, 512);
    const { tokens, nextTokens } = await loadAndRun(bytes, 'Once upon a time', 512);
    // The ids llama.cpp gives with the original stories260K file.
    expect(tokens).toEqual([403, 407, 261, 378]);
    expect(nextTokens).toEqual(tokens);
    expect(llamaErrors).toEqual([]);
  });
});
