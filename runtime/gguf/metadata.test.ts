import { describe, expect, it } from 'vitest';
import { CorruptModelFileError, UnsupportedModelError } from '../../core/errors.ts';
import {
  metaArchitecture,
  metaArray,
  metaBoolean,
  metaCount,
  metaHas,
  metaNumber,
  metaNumberArray,
  metaOptionalBoolean,
  metaOptionalCount,
  metaOptionalNumber,
  metaOptionalString,
  metaOptionalStringArray,
  metaString,
  metaStringArray,
} from './metadata.ts';
import { parseGguf } from './parse.ts';
import { sourceFromBytes } from './sources.ts';
import { writeGguf } from './writer.ts';

const meta = (
  await parseGguf(
    sourceFromBytes(
      writeGguf({
        metadata: [
          { key: 'general.architecture', value: 'llama' },
          { key: 'llama.block_count', type: 'u32', value: 5 },
          { key: 'llama.rope.freq_base', type: 'f32', value: 10000 },
          { key: 'llama.attention.layer_norm_rms_epsilon', type: 'f32', value: 1e-5 },
          { key: 'llama.offset', type: 'i32', value: -3 },
          { key: 'general.huge', type: 'u64', value: 2n ** 60n },
          { key: 'general.sized', type: 'u64', value: 4096 },
          { key: 'tokenizer.ggml.add_bos_token', value: true },
          { key: 'tokenizer.ggml.tokens', value: ['<s>', 'a'] },
          { key: 'tokenizer.ggml.scores', type: 'f32[]', value: [0, -1] },
        ],
      }),
    ),
  )
).metadata;

describe('typed metadata accessors', () => {
  it('return values of the expected type', () => {
    expect(metaArchitecture(meta)).toBe('llama');
    expect(metaCount(meta, 'llama.block_count')).toBe(5);
    expect(metaCount(meta, 'general.sized')).toBe(4096);
    expect(metaNumber(meta, 'llama.rope.freq_base')).toBe(10000);
    expect(metaNumber(meta, 'llama.offset')).toBe(-3);
    expect(metaBoolean(meta, 'tokenizer.ggml.add_bos_token')).toBe(true);
    expect(metaStringArray(meta, 'tokenizer.ggml.tokens')).toEqual(['<s>', 'a']);
    expect(metaNumberArray(meta, 'tokenizer.ggml.scores')).toEqual([0, -1]);
    expect(metaArray(meta, 'tokenizer.ggml.tokens')).toHaveLength(2);
    expect(metaHas(meta, 'llama.block_count')).toBe(true);
  });

  it('return undefined for absent optional keys, including inherited object properties', () => {
    expect(metaOptionalNumber(meta, 'llama.rope.scaling.factor')).toBeUndefined();
    expect(metaOptionalString(meta, 'toString')).toBeUndefined();
    expect(metaOptionalBoolean(meta, 'constructor')).toBeUndefined();
    expect(metaOptionalStringArray(meta, 'tokenizer.ggml.merges')).toBeUndefined();
    expect(metaOptionalCount(meta, '__proto__')).toBeUndefined();
    expect(metaHas(meta, 'hasOwnProperty')).toBe(false);
  });

  it('name the key when it is missing or has the wrong type', () => {
    expect(() => metaNumber(meta, 'llama.embedding_length')).toThrow(CorruptModelFileError);
    expect(() => metaNumber(meta, 'llama.embedding_length')).toThrow(/"llama.embedding_length"/);
    expect(() => metaString(meta, 'llama.block_count')).toThrow(/"llama.block_count" metadata should be a string/);
    expect(() => metaNumber(meta, 'general.architecture')).toThrow(CorruptModelFileError);
    expect(() => metaBoolean(meta, 'llama.block_count')).toThrow(/a bool/);
    expect(() => metaStringArray(meta, 'tokenizer.ggml.scores')).toThrow(/an array of strings/);
    expect(() => metaNumberArray(meta, 'tokenizer.ggml.tokens')).toThrow(/"tokenizer.ggml.tokens"/);
    expect(() => metaArray(meta, 'general.architecture')).toThrow(/an array/);
    expect(() => metaCount(meta, 'llama.offset')).toThrow(/non-negative integer/);
    expect(() => metaCount(meta, 'llama.attention.layer_norm_rms_epsilon')).toThrow(/non-negative integer/);
  });

  it('refuse 64-bit values a JS number cannot hold exactly', () => {
    expect(() => metaNumber(meta, 'general.huge')).toThrow(UnsupportedModelError);
  });
});
