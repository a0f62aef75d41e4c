/**
 * The tokenizer half of a GGUF file (`tokenizer.ggml.*`), read once into plain arrays, with the defaults llama.cpp
 * applies (llama-vocab.cpp, `llama_vocab::impl::load`) so our tokenization matches it.
 */
import { CorruptModelFileError, UnsupportedModelError } from '../../core/errors.ts';
import type { GgufMetadata, GgufValue } from '../../core/gguf-types.ts';

/** `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`). */
export enum TokenType {
  Undefined = 0,
  Normal = 1,
  Unknown = 2,
  Control = 3,
  UserDefined = 4,
  Unused = 5,
  Byte = 6,
}

export type VocabModel = 'llama' | 'gpt2';

export interface GgufVocab {
  /** `llama` = SentencePiece (scores, byte fallback); `gpt2` = byte-level BPE with merges. */
  model: VocabModel;
  /** `tokenizer.ggml.pre` (gpt2 only; '' when absent, which llama.cpp treats as 'default'). */
  pre: string;
  tokens: string[];
  /** Token text → id (texts are unique; llama.cpp refuses duplicates too). */
  idByText: Map<string, number>;
  types: TokenType[];
  /** SentencePiece piece scores (llama only). */
  scores: Float32Array | null;
  /** BPE merges as [left, right] (gpt2 only), rank = index. */
  merges: [string, string][];
  bosId?: number;
  eosId?: number;
  eotId?: number;
  unkId?: number;
  padId?: number;
  addBos: boolean;
  addEos: boolean;
  addSpacePrefix: boolean;
  /** Pre-tokenizers whose HF config sets `ignore_merges` (a whole word in the vocab is one token). */
  ignoreMerges: boolean;
  /** Ids that end generation: EOS, EOT and the end-of-turn tokens llama.cpp recognises by text. */
  eogIds: Set<number>;
}

const KEY = 'tokenizer.ggml.';

/** Token texts llama.cpp treats as end-of-turn when `eot_token_id` is absent (first match wins). */
const EOT_TEXTS = [
  '<|eot_id|>',
  '<|im_end|>',
  '<|end|>',
  '<end_of_turn>',
  '<|endoftext|>',
  '<|end_of_text|>',
  '<EOT>',
  '_<EOT>',
  '<｜end▁of▁sentence｜>',
  '<end_of_utterance>',
];
/** Fill-in-the-middle pad / repo / file-separator tokens: llama.cpp ends generation on them. */
const FIM_EOG_TEXTS = ['<|fim_pad|>', '<fim-pad>', '<fim_pad>', '<PAD>', '[PAD]', '<|fim_repo|>', '<|repo_name|>'];
/** Token texts llama.cpp adds to its end-of-generation set. */
const EOG_TEXTS = new Set([
  ...EOT_TEXTS,
  ...FIM_EOG_TEXTS,
  '<fim-repo>',
  '<REPO>',
  '<reponame>',
  '<|file_sep|>',
  '<|eom_id|>',
  '<|return|>',
  '<|call|>',
  '</s>',
  '<eos>',
]);
/** Fill-in-the-middle prefix / suffix / middle tokens, which llama.cpp also forces to control type. */
const FIM_TEXTS = [
  '<|fim_prefix|>',
  '<fim-prefix>',
  '<fim_prefix>',
  '<｜fim▁begin｜>',
  '<PRE>',
  '▁<PRE>',
  '<|code_prefix|>',
  '<|fim_suffix|>',
  '<fim-suffix>',
  '<fim_suffix>',
  '<｜fim▁hole｜>',
  '<SUF>',
  '▁<SUF>',
  '<|code_suffix|>',
  '<|fim_middle|>',
  '<fim-middle>',
  '<fim_middle>',
  '<｜fim▁end｜>',
  '<MID>',
  '▁<MID>',
  '<|code_middle|>',
];
/** gpt-oss tokens llama.cpp always renders (treated as user-defined whatever the file says). */
const ALWAYS_RENDERED_TEXTS = ['<|channel|>', '<|message|>', '<|start|>', '<|constrain|>'];

/** Pre-tokenizer names llama.cpp maps to its LLAMA3 regex (these also set ignore_merges and add_bos). */
export const LLAMA3_PRE = new Set(['llama3', 'llama-v3', 'llama-bpe', 'falcon3', 'pixtral']);

function corrupt(key: string, what: string): never {
  throw new CorruptModelFileError(
    `GGUF metadata ${key} ${what}; the file is damaged or was written by a broken converter.`,
    {
      key,
    },
  );
}

function stringArray(meta: GgufMetadata, key: string): string[] {
  const value = meta[key];
  if (!Array.isArray(value)) corrupt(key, 'is missing or not an array');
  for (const item of value) if (typeof item !== 'string') corrupt(key, 'holds a non-string entry');
  return value as string[];
}

function numberArray(meta: GgufMetadata, key: string, length: number): number[] | null {
  const value = meta[key];
  if (value === undefined) return null;
  if (!Array.isArray(value)) corrupt(key, 'is not an array');
  if (value.length < length) corrupt(key, `has ${value.length} entries for ${length} tokens`);
  const out = new Array<number>(length);
  for (let i = 0; i < length; i++) {
    const item: GgufValue = value[i];
    const n = typeof item === 'bigint' ? Number(item) : item;
    if (typeof n !== 'number') corrupt(key, `holds a non-numeric entry at ${i}`);
    out[i] = n;
  }
  return out;
}

function optionalId(
  meta: GgufMetadata,
  name: string,
  vocabSize: number,
  fallback: number | undefined,
): number | undefined {
  const value = meta[`${KEY}${name}_token_id`];
  if (value === undefined) return fallback;
  const id = typeof value === 'bigint' ? Number(value) : value;
  if (typeof id !== 'number' || !Number.isInteger(id)) corrupt(`${KEY}${name}_token_id`, 'is not an integer');
  // llama.cpp ignores out-of-range ids (converters write 0xFFFFFFFF for "none") and keeps its default.
  if (id < 0 || id >= vocabSize) return fallback !== undefined && fallback < vocabSize ? fallback : undefined;
  return id;
}

function optionalBool(meta: GgufMetadata, key: string, fallback: boolean): boolean {
  const value = meta[key];
  if (value === undefined) return fallback;
  if (typeof value !== 'boolean') corrupt(key, 'is not a boolean');
  return value;
}

function splitMerge(merge: string): [string, string] {
  // llama.cpp splits at the first space after the first character, so a merge may start with a space.
  const at = merge.indexOf(' ', 1);
  if (at < 0) corrupt(`${KEY}merges`, `holds "${merge}", which is not "left right"`);
  return [merge.slice(0, at), merge.slice(at + 1)];
}

export function readVocab(meta: GgufMetadata): GgufVocab {
  const modelValue = meta[`${KEY}model`];
  if (typeof modelValue !== 'string') corrupt(`${KEY}model`, 'is missing');
  if (modelValue !== 'llama' && modelValue !== 'gpt2') {
    throw new UnsupportedModelError(
      `This model uses the "${modelValue}" tokenizer; longtab supports "llama" (SentencePiece) and "gpt2" (byte-level BPE). Pick a model with one of those.`,
      { tokenizer: modelValue },
    );
  }
  const model: VocabModel = modelValue;
  const tokens = stringArray(meta, `${KEY}tokens`);
  const n = tokens.length;
  if (n === 0) corrupt(`${KEY}tokens`, 'is empty');
  const rawTypes = numberArray(meta, `${KEY}token_type`, n);
  const types: TokenType[] = rawTypes
    ? rawTypes.map((t) => (t >= 0 && t <= 6 ? t : TokenType.Undefined))
    : new Array(n).fill(TokenType.Normal);
  const rawScores = model === 'llama' ? numberArray(meta, `${KEY}scores`, n) : null;
  const scores = model === 'llama' ? Float32Array.from(rawScores ?? new Array<number>(n).fill(0)) : null;

  const preValue = meta[`${KEY}pre`];
  const pre = typeof preValue === 'string' ? preValue : '';
  const merges = model === 'gpt2' ? stringArray(meta, `${KEY}merges`).map(splitMerge) : [];

  const isLlama3 = model === 'gpt2' && LLAMA3_PRE.has(pre);
  const bosId = optionalId(meta, 'bos', n, model === 'llama' ? 1 : 11);
  const eosId = optionalId(meta, 'eos', n, model === 'llama' ? 2 : 11);
  const unkId = optionalId(meta, 'unknown', n, model === 'llama' ? 0 : undefined);
  const padId = optionalId(meta, 'padding', n, undefined);
  let eotId = optionalId(meta, 'eot', n, undefined);

  const idByText = new Map<string, number>();
  for (let i = 0; i < n; i++) idByText.set(tokens[i], i);
  if (idByText.size !== n) corrupt(`${KEY}tokens`, 'holds duplicate token texts');
  if (eotId === undefined) {
    for (const text of EOT_TEXTS) {
      const id = idByText.get(text);
      if (id !== undefined) {
        eotId = id;
        break;
      }
    }
  }
  const eogIds = new Set<number>();
  for (const text of EOG_TEXTS) {
    const id = idByText.get(text);
    if (id === undefined) continue;
    eogIds.add(id);
    // llama.cpp forces end-of-turn tokens it recognises by text to behave as control tokens.
    types[id] = TokenType.Control;
  }
  for (const text of FIM_TEXTS) {
    const id = idByText.get(text);
    if (id !== undefined) types[id] = TokenType.Control;
  }
  for (const text of ALWAYS_RENDERED_TEXTS) {
    const id = idByText.get(text);
    if (id !== undefined) types[id] = TokenType.UserDefined;
  }
  for (const id of [eosId, eotId]) if (id !== undefined) eogIds.add(id);

  return {
    model,
    pre,
    tokens,
    idByText,
    types,
    scores,
    merges,
    bosId,
    eosId,
    eotId,
    unkId,
    padId,
    addBos: optionalBool(meta, `${KEY}add_bos_token`, model === 'llama' || isLlama3),
    addEos: optionalBool(meta, `${KEY}add_eos_token`, false),
    addSpacePrefix: optionalBool(meta, `${KEY}add_space_prefix`, model === 'llama'),
    ignoreMerges: isLlama3,
    eogIds,
  };
}
