import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { CorruptModelFileError } from '../../core/errors.ts';
import { type ByteSource, GgmlType, type GgufFile } from '../../core/gguf-types.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import {
  metaArchitecture,
  metaCount,
  metaNumber,
  metaNumberArray,
  metaOptionalNumber,
  metaString,
  metaStringArray,
} from './metadata.ts';
import { sourceFromPath } from './node-source.ts';
import { parseGguf } from './parse.ts';
import { streamTensorBytes } from './read-tensor.ts';

const modelPath = sharedPath(STORIES260K);

describe.skipIf(modelPath === null)('stories260K.gguf (a real llama.cpp-converted model)', () => {
  let source: ByteSource;
  let file: GgufFile;
  const reads: { offset: number; length: number }[] = [];

  beforeAll(async () => {
    source = await sourceFromPath(modelPath!);
    const counted: ByteSource = {
      name: source.name,
      size: source.size,
      read: (offset, length) => {
        reads.push({ offset, length });
        return source.read(offset, length);
      },
    };
    file = await parseGguf(counted, { windowBytes: 4096 });
  });
  afterAll(() => source?.close?.());

  it('has the llama hyperparameters and vocabulary it was trained with', () => {
    const meta = file.metadata;
    expect(file.version).toBe(3);
    expect(metaArchitecture(meta)).toBe('llama');
    expect(metaCount(meta, 'llama.embedding_length')).toBe(64);
    expect(metaCount(meta, 'llama.block_count')).toBe(5);
    expect(metaCount(meta, 'llama.attention.head_count')).toBe(8);
    expect(metaCount(meta, 'llama.attention.head_count_kv')).toBe(4);
    expect(metaCount(meta, 'llama.context_length')).toBe(2048);
    expect(metaNumber(meta, 'llama.attention.layer_norm_rms_epsilon')).toBeCloseTo(1e-5, 9);
    expect(metaOptionalNumber(meta, 'llama.rope.freq_base')).toBeUndefined();
    expect(metaString(meta, 'tokenizer.ggml.model')).toBe('llama');
    const tokens = metaStringArray(meta, 'tokenizer.ggml.tokens');
    expect(tokens).toHaveLength(512);
    expect(tokens.slice(0, 4)).toEqual(['<unk>', '<s>', '</s>', '<0x00>']);
    expect(metaNumberArray(meta, 'tokenizer.ggml.scores')).toHaveLength(512);
    expect(metaNumberArray(meta, 'tokenizer.ggml.token_type')).toHaveLength(512);
    expect(file.metadataTypes?.['tokenizer.ggml.token_type']).toBe('i32[]');
    expect(() => metaString(meta, 'llama.block_count')).toThrow(CorruptModelFileError);
    expect(() => metaNumber(meta, 'llama.missing_key')).toThrow(/llama.missing_key/);
  });

  it('lists F32 tensors with the shapes of a 5-layer, 64-wide GQA llama', () => {
    const embed = 64;
    const kvWidth = (64 / 8) * 4;
    const vocab = 512;
    const byName = new Map(file.tensors.map((t) => [t.name, t]));
    expect(file.tensors).toHaveLength(3 + 5 * 9);
    expect(file.tensors.every((t) => t.type === GgmlType.F32)).toBe(true);
    expect(byName.get('token_embd.weight')?.shape).toEqual([embed, vocab]);
    expect(byName.get('output.weight')?.shape).toEqual([embed, vocab]);
    expect(byName.get('output_norm.weight')?.shape).toEqual([embed]);
    const ffn = byName.get('blk.0.ffn_up.weight')!.shape[1];
    for (let layer = 0; layer < 5; layer++) {
      const shape = (role: string) => byName.get(`blk.${layer}.${role}.weight`)?.shape;
      expect(shape('attn_norm')).toEqual([embed]);
      expect(shape('attn_q')).toEqual([embed, embed]);
      expect(shape('attn_k')).toEqual([embed, kvWidth]);
      expect(shape('attn_v')).toEqual([embed, kvWidth]);
      expect(shape('attn_output')).toEqual([embed, embed]);
      expect(shape('ffn_norm')).toEqual([embed]);
      expect(shape('ffn_gate')).toEqual([embed, ffn]);
      expect(shape('ffn_up')).toEqual([embed, ffn]);
      expect(shape('ffn_down')).toEqual([ffn, embed]);
    }
    for (const tensor of file.tensors) {
      expect(tensor.byteLength).toBe(tensor.shape.reduce((a, b) => a * b, 4));
      expect(tensor.offset % file.alignment).toBe(0);
      expect(tensor.offset + tensor.byteLength).toBeLessThanOrEqual(file.fileSize);
    }
  });

  it('read only the header, in windows of the requested size', () => {
    expect(Math.max(...reads.map((r) => r.length))).toBeLessThanOrEqual(4096);
    const end = Math.max(...reads.map((r) => r.offset + r.length));
    expect(end).toBeLessThanOrEqual(file.dataOffset + 4096);
    expect(end).toBeLessThan(file.fileSize / 10);
  });

  it('streams a weight whose values are finite and not all zero', async () => {
    const embedding = file.tensors.find((t) => t.name === 'token_embd.weight')!;
    let sumOfSquares = 0;
    let chunks = 0;
    await streamTensorBytes(source, embedding, 10_000, (bytes) => {
      chunks++;
      const values = new Float32Array(bytes.slice().buffer);
      for (const value of values) {
        expect(Number.isFinite(value)).toBe(true);
        sumOfSquares += value * value;
      }
    });
    expect(chunks).toBe(Math.ceil(embedding.byteLength / 10_000));
    expect(sumOfSquares).toBeGreaterThan(0);
  });
});
