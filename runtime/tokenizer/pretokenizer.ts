/**
 * Byte-level BPE pre-tokenization: split text into words with the regex sequence llama.cpp picks for the GGUF's
 * `tokenizer.ggml.pre`, then map each word's UTF-8 bytes to GPT-2's printable byte alphabet.
 *
 * The patterns follow llama.cpp's (llama-vocab.cpp) rather than the tokenizer.json originals: `(?i:'s|…)` is spelled
 * with character classes and `\s` is llama.cpp's whitespace set (it includes U+0085 and excludes U+FEFF, unlike
 * JavaScript's `\s`).
 */
import { UnsupportedModelError } from '../../core/errors.ts';
import { LLAMA3_PRE } from './vocab.ts';

const WS = '\\t\\n\\v\\f\\r \\x85\\xA0\\u1680\\u2000-\\u200A\\u2028\\u2029\\u202F\\u205F\\u3000';
const S = `[${WS}]`;
const NOT_S = `[^${WS}]`;
const CONTRACTIONS_ANY_CASE = "'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]";

const GPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^${WS}\\p{L}\\p{N}]+|${S}+(?!${NOT_S})|${S}+`;
const LLAMA3 =
  `${CONTRACTIONS_ANY_CASE}|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^${WS}\\p{L}\\p{N}]+[\\r\\n]*` +
  `|${S}*[\\r\\n]+|${S}+(?!${NOT_S})|${S}+`;
const QWEN2 =
  `${CONTRACTIONS_ANY_CASE}|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^${WS}\\p{L}\\p{N}]+[\\r\\n]*` +
  `|${S}*[\\r\\n]+|${S}+(?!${NOT_S})|${S}+`;

/** Each regex splits every piece the previous one produced; unmatched gaps are kept as pieces of their own. */
const PRE_TOKENIZERS: Record<string, string[]> = {
  default: ['[\\p{P}\\$\\+<=>\\^~\\|]+', GPT2, '\\p{N}+', '[0-9][0-9][0-9]'],
  llama3: [LLAMA3],
  qwen2: [QWEN2],
  gpt2: [GPT2],
  digitsThenGpt2: ['\\p{N}', GPT2],
};

const PRE_ALIASES: Record<string, string> = {
  '': 'default',
  default: 'default',
  'gpt-2': 'gpt2',
  'phi-2': 'gpt2',
  mpt: 'gpt2',
  olmo: 'gpt2',
  jais: 'gpt2',
  qwen2: 'qwen2',
  'deepseek-r1-qwen': 'qwen2',
  stablelm2: 'qwen2',
  smollm: 'digitsThenGpt2',
  starcoder: 'digitsThenGpt2',
  refact: 'digitsThenGpt2',
  'command-r': 'digitsThenGpt2',
  codeshell: 'digitsThenGpt2',
  exaone: 'digitsThenGpt2',
  minerva: 'digitsThenGpt2',
  dbrx: 'llama3',
  'smaug-bpe': 'llama3',
};

/** A compiled pre-tokenizer: text → byte-level-encoded words. */
export class BytePreTokenizer {
  private readonly regexes: RegExp[];
  constructor(pre: string) {
    const kind = LLAMA3_PRE.has(pre) ? 'llama3' : PRE_ALIASES[pre];
    if (kind === undefined) {
      throw new UnsupportedModelError(
        `This model's byte-level BPE pre-tokenizer "${pre}" is not supported (known: ${[...LLAMA3_PRE, ...Object.keys(PRE_ALIASES).filter(Boolean)].join(', ')}).`,
        { pre },
      );
    }
    this.regexes = PRE_TOKENIZERS[kind].map((source) => new RegExp(source, 'gu'));
  }

  /** Splits raw text into words (still plain text). */
  split(text: string): string[] {
    let pieces = [text];
    for (const regex of this.regexes) {
      const next: string[] = [];
      for (const piece of pieces) {
        let last = 0;
        for (const match of piece.matchAll(regex)) {
          if (match[0].length === 0) continue;
          if (match.index > last) next.push(piece.slice(last, match.index));
          next.push(match[0]);
          last = match.index + match[0].length;
        }
        if (last < piece.length) next.push(piece.slice(last));
      }
      pieces = next;
    }
    return pieces;
  }

  /** Splits and byte-encodes, ready for the BPE merges. */
  words(text: string): string[] {
    return this.split(text).map(byteLevelEncode);
  }
}

/** GPT-2's byte ↔ printable character table: printable Latin-1 bytes map to themselves, the rest to U+0100… */
const BYTE_TO_CHAR: string[] = [];
export const CHAR_TO_BYTE = new Map<string, number>();
{
  let extra = 0;
  for (let b = 0; b < 256; b++) {
    const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    const ch = String.fromCharCode(printable ? b : 256 + extra++);
    BYTE_TO_CHAR[b] = ch;
    CHAR_TO_BYTE.set(ch, b);
  }
}

const utf8 = new TextEncoder();

export function byteLevelEncode(text: string): string {
  let out = '';
  for (const b of utf8.encode(text)) out += BYTE_TO_CHAR[b];
  return out;
}
