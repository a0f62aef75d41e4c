/**
 * Byte-level BPE (tokenizer.ggml.model = gpt2) with real vocabularies: Llama 3 (pre = llama-bpe) and Qwen 3
 * (pre = qwen2), written into tiny GGUF files so llama.cpp (node-llama-cpp) tokenizes the same vocabulary.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { getLlama, type Llama, type LlamaModel } from 'node-llama-cpp';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { seededRandom } from '../../test/random.ts';
import {
  type BpeFixtureName,
  bpeTokenizerMetadata,
  randomText,
  tinyLlamaGguf,
} from '../../tools/fixtures/tokenizer-fixtures.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { parseGguf } from '../gguf/parse.ts';
import { GgufTokenizer } from './tokenizer.ts';

const SAMPLES = [
  '',
  ' ',
  'Hello world',
  ' Hello world',
  'Hello  world   with    runs of     spaces',
  'trailing spaces   ',
  '   leading spaces',
  'line one\nline two\n\n\nline five\n',
  '\n\n',
  ' \n \n',
  'tabs\tand\r\nwindows\r\n newlines \t\n',
  '1 12 123 1234 12345 123456 1234567 3.14159 -42 1,000,000',
  "It's don't we'll they're I've I'm she'd",
  "IT'S DON'T WE'LL THEY'RE I'VE",
  'function add(a, b) {\n  return a + b; // sum\n}\n',
  'if (x <= 10 && y != 0) { console.log(`x=$\u{7b}x}`); }',
  '    indented code\n        more indent',
  'Emoji 😀🎉👍🏽 and 🇫🇷 flags, 👨‍👩‍👧 family',
  '中文字符和日本語のテキスト、한국어 텍스트',
  'Ünïcödé àccents çà et là, Привет мир, مرحبا',
  'unicode spaces:\u00a0nbsp\u3000ideographic\u2003em\u0085nel',
  'symbols ©®™ ±×÷ €£¥ →⇒ ∑∫√',
  'https://example.com/path?query=1&x=y#frag',
  'snake_case camelCase PascalCase kebab-case',
  '...!!!???,,,;;;\'\'\'"""',
  'The quick brown fox jumps over the lazy dog. '.repeat(6),
];

const SPECIAL_SAMPLES: Record<BpeFixtureName, string[]> = {
  llama3: [
    '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>',
    'text <|eot_id|> more text<|eot_id|><|eot_id|>',
    '<|reserved_special_token_5|>x',
  ],
  qwen3: [
    '<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n',
    '<think>\nreasoning\n</think>\n\nanswer<|im_end|>',
    '<|endoftext|><tool_call>{"a":1}</tool_call>',
    '<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>',
  ],
};

const SPECIAL_TOKENS: Record<BpeFixtureName, string[]> = {
  llama3: ['<|begin_of_text|>', '<|eot_id|>', '<|start_header_id|>', '<|end_header_id|>'],
  qwen3: ['<|im_start|>', '<|im_end|>', '<think>', '</think>', '<|endoftext|>', '<|fim_prefix|>', '</s>'],
};

let llama: Llama;
let dir: string;

beforeAll(async () => {
  llama = await getLlama({ gpu: false });
  dir = mkdtempSync(join(tmpdir(), 'longtab-tokenizer-'));
});

afterAll(() => {
  if (dir) rmSync(dir, { recursive: true, force: true });
});

describe.each(['llama3', 'qwen3'] as const)('%s byte-level BPE vs llama.cpp', (name) => {
  let tokenizer: GgufTokenizer;
  let model: LlamaModel;

  beforeAll(async () => {
    const path = join(dir, `${name}.gguf`);
    writeFileSync(path, tinyLlamaGguf(bpeTokenizerMetadata(name)));
    const source = await sourceFromPath(path);
    try {
      tokenizer = GgufTokenizer.fromMetadata((await parseGguf(source)).metadata);
    } finally {
      await source.close?.();
    }
    model = await llama.loadModel({ modelPath: path });
  });

  afterAll(async () => {
    await model?.dispose();
  });

  it('encodes plain text like llama.cpp and round trips', () => {
    for (const text of SAMPLES) {
      for (const parseSpecial of [false, true]) {
        const ours = tokenizer.encode(text, { addSpecial: false, parseSpecial });
        const theirs = Array.from(model.tokenize(text, parseSpecial), Number);
        expect(ours, JSON.stringify(text)).toEqual(theirs);
      }
      expect(tokenizer.decode(tokenizer.encode(text, { addSpecial: false }))).toBe(text);
    }
  });

  it('splits special tokens like llama.cpp with and without parseSpecial', () => {
    for (const text of SPECIAL_SAMPLES[name]) {
      for (const parseSpecial of [false, true]) {
        const ours = tokenizer.encode(text, { addSpecial: false, parseSpecial });
        const theirs = Array.from(model.tokenize(text, parseSpecial), Number);
        expect(ours, `${JSON.stringify(text)} parseSpecial=${parseSpecial}`).toEqual(theirs);
      }
      const ids = tokenizer.encode(text, { addSpecial: false, parseSpecial: true });
      expect(tokenizer.decode(ids, { skipSpecial: false })).toBe(text);
      expect(tokenizer.decode(ids, { skipSpecial: false })).toBe(model.detokenize(ids as never, true));
    }
  });

  it('matches llama.cpp on 500 seeded random texts', () => {
    const random = seededRandom(name === 'llama3' ? 3 : 33);
    for (let i = 0; i < 500; i++) {
      const text = randomText(random, SPECIAL_TOKENS[name]);
      for (const parseSpecial of [false, true]) {
        const ours = tokenizer.encode(text, { addSpecial: false, parseSpecial });
        expect(ours, JSON.stringify(text)).toEqual(Array.from(model.tokenize(text, parseSpecial), Number));
      }
      expect(tokenizer.decode(tokenizer.encode(text, { addSpecial: false }))).toBe(text);
    }
  });

  it('splits digits as the pre-tokenizer says', () => {
    const pieces = tokenizer.encode('1234567', { addSpecial: false }).map((id) => tokenizer.decode([id]));
    expect(pieces).toEqual(name === 'llama3' ? ['123', '456', '7'] : ['1', '2', '3', '4', '5', '6', '7']);
  });

  it('adds BOS only where the model asks for it and knows its end-of-turn tokens', () => {
    const withSpecial = tokenizer.encode('Hi');
    if (name === 'llama3') {
      expect(withSpecial[0]).toBe(tokenizer.bosId);
      expect(tokenizer.tokenText(tokenizer.eotId!)).toBe('<|eot_id|>');
      expect(tokenizer.isEndOfGeneration(tokenizer.eotId!)).toBe(true);
      expect(tokenizer.isEndOfGeneration(tokenizer.eosId!)).toBe(true);
    } else {
      expect(withSpecial).toEqual(tokenizer.encode('Hi', { addSpecial: false }));
      expect(tokenizer.tokenText(tokenizer.eosId!)).toBe('<|im_end|>');
      const endOfText = tokenizer.encode('<|endoftext|>', { addSpecial: false, parseSpecial: true });
      expect(tokenizer.isEndOfGeneration(endOfText[0])).toBe(true);
    }
    expect(tokenizer.isEndOfGeneration(tokenizer.encode('Hi', { addSpecial: false })[0])).toBe(false);
  });

  it('streams UTF-8 characters split across byte-level tokens without replacement characters', () => {
    const text = '😀🎉 中文 👨‍👩‍👧 done';
    const ids = tokenizer.encode(text, { addSpecial: false });
    const stream = tokenizer.createStreamDecoder();
    const parts = ids.map((id) => stream.push(id));
    parts.push(stream.flush());
    for (const part of parts) expect(part).not.toContain('\uFFFD');
    expect(parts.join('')).toBe(text);
  });
});
