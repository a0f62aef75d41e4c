import { describe, expect, it } from 'vitest';
import { CorruptModelFileError, InvalidRequestError, UnsupportedModelError } from '../../core/errors.ts';
import type { GgufMetadata } from '../../core/gguf-types.ts';
import { GgufTokenizer } from './tokenizer.ts';

/** A tiny SentencePiece vocabulary: control tokens, byte fallback for 'a'/'b'/'\n', and a few scored pieces. */
function spmMetadata(overrides: GgufMetadata = {}): GgufMetadata {
  const tokens = ['<unk>', '<s>', '</s>', '<0x0A>', '<0x61>', '<0x62>', '▁', 'a', 'b', '▁a', 'ab', '▁ab'];
  return {
    'tokenizer.ggml.model': 'llama',
    'tokenizer.ggml.tokens': tokens,
    'tokenizer.ggml.scores': [0, 0, 0, 0, 0, 0, -1, -2, -3, -4, -5, -6],
    'tokenizer.ggml.token_type': [2, 3, 3, 6, 6, 6, 1, 1, 1, 1, 1, 1],
    ...overrides,
  };
}

describe('GgufTokenizer metadata handling', () => {
  it('merges by score with byte fallback on a hand-made vocabulary', () => {
    const tokenizer = GgufTokenizer.fromMetadata(spmMetadata());
    // '▁ab' is reachable and scores higher than stopping at '▁a' + 'b'.
    expect(tokenizer.encode('ab', { addSpecial: false })).toEqual([11]);
    expect(tokenizer.encode('ab\nb')).toEqual([1, 11, 3, 8]);
    // 'c' is not in the vocabulary and has no byte token: it becomes <unk>.
    expect(tokenizer.encode('c', { addSpecial: false })).toEqual([6, 0]);
    expect(tokenizer.decode([11, 3, 8])).toBe('ab\nb');
  });

  it('honours add_bos_token, add_eos_token and add_space_prefix', () => {
    const tokenizer = GgufTokenizer.fromMetadata(
      spmMetadata({
        'tokenizer.ggml.add_bos_token': false,
        'tokenizer.ggml.add_eos_token': true,
        'tokenizer.ggml.add_space_prefix': false,
      }),
    );
    expect(tokenizer.encode('ab')).toEqual([10, 2]);
    expect(tokenizer.decode([9])).toBe(' a');
  });

  it('rejects tokenizers it does not implement and damaged arrays with typed errors', () => {
    expect(() => GgufTokenizer.fromMetadata(spmMetadata({ 'tokenizer.ggml.model': 'bert' }))).toThrow(
      UnsupportedModelError,
    );
    expect(() =>
      GgufTokenizer.fromMetadata({
        'tokenizer.ggml.model': 'gpt2',
        'tokenizer.ggml.pre': 'no-such-pre',
        'tokenizer.ggml.tokens': ['a'],
        'tokenizer.ggml.merges': [],
      }),
    ).toThrow(UnsupportedModelError);
    expect(() => GgufTokenizer.fromMetadata({ 'tokenizer.ggml.tokens': ['a'] })).toThrow(CorruptModelFileError);
    expect(() => GgufTokenizer.fromMetadata(spmMetadata({ 'tokenizer.ggml.tokens': 'abc' }))).toThrow(
      CorruptModelFileError,
    );
    expect(() => GgufTokenizer.fromMetadata(spmMetadata({ 'tokenizer.ggml.tokens': ['a', 7] }))).toThrow(
      CorruptModelFileError,
    );
    expect(() => GgufTokenizer.fromMetadata(spmMetadata({ 'tokenizer.ggml.scores': [0, 1] }))).toThrow(
      CorruptModelFileError,
    );
    expect(() => GgufTokenizer.fromMetadata(spmMetadata({ 'tokenizer.ggml.token_type': ['x'] }))).toThrow(
      CorruptModelFileError,
    );
    expect(() =>
      GgufTokenizer.fromMetadata(spmMetadata({ 'tokenizer.ggml.tokens': ['a', 'a', ...Array(10).fill('z')] })),
    ).toThrow(CorruptModelFileError);
    expect(() =>
      GgufTokenizer.fromMetadata({
        'tokenizer.ggml.model': 'gpt2',
        'tokenizer.ggml.pre': 'qwen2',
        'tokenizer.ggml.tokens': ['a', 'b', 'ab'],
        'tokenizer.ggml.merges': ['ab'],
      }),
    ).toThrow(CorruptModelFileError);
  });

  it('ignores out-of-range special ids as llama.cpp does and checks ids it decodes', () => {
    const tokenizer = GgufTokenizer.fromMetadata(spmMetadata({ 'tokenizer.ggml.padding_token_id': 4294967295 }));
    expect(tokenizer.padId).toBeUndefined();
    expect(() => tokenizer.decode([12])).toThrow(InvalidRequestError);
    expect(() => tokenizer.tokenText(-1)).toThrow(InvalidRequestError);
  });
});
