/**
 * GgufTokenizer: encode/decode with the vocabulary stored in a GGUF file, matching llama.cpp's tokenization.
 *
 * One path per tokenizer model:
 * - `llama` (SentencePiece): spaces → `▁`, a dummy-prefix space per text fragment (add_space_prefix), score-driven
 *   merges and `<0xNN>` byte fallback (sentencepiece.ts).
 * - `gpt2` (byte-level BPE): the pre-tokenizer regexes of `tokenizer.ggml.pre` (pretokenizer.ts), then rank-ordered
 *   merges run by @huggingface/tokenizers' BPE model (its leftmost-on-equal-rank rule matches llama.cpp's).
 *
 * Special tokens are split out before either path, as llama.cpp's `tokenizer_st_partition` does: user-defined tokens
 * always, control and unknown tokens only with `parseSpecial`.
 */

import { BPE } from '@huggingface/tokenizers';
import { InvalidRequestError } from '../../core/errors.ts';
import type { GgufMetadata } from '../../core/gguf-types.ts';
import type { GrammarVocabulary } from '../grammar/constraint.ts';
import { BytePreTokenizer, CHAR_TO_BYTE } from './pretokenizer.ts';
import { type SentencePieceVocab, sentencePieceEncode } from './sentencepiece.ts';
import { type GgufVocab, readVocab, TokenType } from './vocab.ts';

export interface EncodeOptions {
  /** Add BOS (per `add_bos_token`) and EOS (per `add_eos_token`). Default true. */
  addSpecial?: boolean;
  /** Recognise control tokens written in the text (e.g. `<|im_end|>`) as single tokens. Default false. */
  parseSpecial?: boolean;
  /**
   * With parseSpecial: spans [start, end) of the text (UTF-16 offsets) where control-token text stays text, e.g. the
   * messages' content inside a rendered chat template, so a message cannot write `<|im_start|>system` as a token.
   */
  literalSpans?: ReadonlyArray<readonly [number, number]>;
}

export interface DecodeOptions {
  /** Leave out control and unknown tokens (BOS, EOS, `<|im_end|>` …). Default true, as llama.cpp's detokenizer. */
  skipSpecial?: boolean;
}

export interface StreamDecoder {
  /** Text completed by this token: bytes of an unfinished UTF-8 character are held until it completes. */
  push(id: number): string;
  /** Whatever is still held (an incomplete character becomes U+FFFD). */
  flush(): string;
}

/** A run of raw text (with its offset in the encoded text) or a special token's id. */
type Fragment = { text: string; at: number } | number;

const utf8 = new TextEncoder();
const EMPTY = new Uint8Array(0);

export class GgufTokenizer {
  readonly vocabSize: number;
  readonly bosId?: number;
  readonly eosId?: number;
  readonly eotId?: number;
  readonly padId?: number;
  readonly model: 'llama' | 'gpt2';

  private readonly vocab: GgufVocab;
  private readonly idByText: ReadonlyMap<string, number>;
  /** Special tokens in llama.cpp's partition order (longest text first). */
  private readonly specialIds: number[];
  private readonly spm?: SentencePieceVocab;
  private readonly bpe?: BPE;
  private readonly preTokenizer?: BytePreTokenizer;
  private readonly pieces: (Uint8Array | undefined)[];

  private constructor(vocab: GgufVocab) {
    this.vocab = vocab;
    this.model = vocab.model;
    this.vocabSize = vocab.tokens.length;
    this.bosId = vocab.bosId;
    this.eosId = vocab.eosId;
    this.eotId = vocab.eotId;
    this.padId = vocab.padId;
    this.idByText = vocab.idByText;
    this.pieces = new Array(this.vocabSize);

    const special = (t: TokenType) => t === TokenType.Control || t === TokenType.UserDefined || t === TokenType.Unknown;
    this.specialIds = [];
    vocab.types.forEach((t, id) => {
      if (special(t) && vocab.tokens[id].length > 0) this.specialIds.push(id);
    });
    this.specialIds.sort((a, b) => vocab.tokens[b].length - vocab.tokens[a].length || a - b);

    if (vocab.model === 'llama') {
      const byteIds = new Int32Array(256).fill(-1);
      for (let b = 0; b < 256; b++) {
        const hex = b.toString(16).toUpperCase().padStart(2, '0');
        // llama.cpp falls back to the plain one-character piece when a `<0xNN>` piece is missing.
        byteIds[b] =
          this.idByText.get(`<0x${hex}>`) ?? (b < 0x80 ? (this.idByText.get(String.fromCharCode(b)) ?? -1) : -1);
      }
      this.spm = { idByText: this.idByText, scores: vocab.scores!, byteIds, unkId: vocab.unkId };
    } else {
      this.preTokenizer = new BytePreTokenizer(vocab.pre);
      const bpeVocab: Record<string, number> = Object.create(null);
      vocab.tokens.forEach((text, id) => {
        bpeVocab[text] = id;
      });
      this.bpe = new BPE({
        type: 'BPE',
        vocab: bpeVocab,
        merges: vocab.merges,
        ignore_merges: vocab.ignoreMerges,
        byte_fallback: false,
      } as ConstructorParameters<typeof BPE>[0]);
    }
  }

  /** Builds the tokenizer from GGUF metadata (`tokenizer.ggml.*`). */
  static fromMetadata(meta: GgufMetadata): GgufTokenizer {
    return new GgufTokenizer(readVocab(meta));
  }

  /**
   * The most UTF-16 code units of input one token can stand for: its text's length (a byte-level BPE token spells each
   * byte as one character, SentencePiece spells a space as one '▁'). A text of n units takes at least
   * ceil(n / maxTokenChars) tokens, which bounds a prompt's length without tokenizing it.
   */
  get maxTokenChars(): number {
    if (this.longestToken === 0) {
      for (const text of this.vocab.tokens) this.longestToken = Math.max(this.longestToken, text.length);
      // An unknown character (up to 2 units) may become one <unk> token whatever its text.
      this.longestToken = Math.max(this.longestToken, 2);
    }
    return this.longestToken;
  }
  private longestToken = 0;

  get addBos(): boolean {
    return this.vocab.addBos;
  }

  /** Whether `text` holds the text of a control or unknown token (what parseSpecial would turn into one). */
  hasControlText(text: string): boolean {
    return this.specialIds.some(
      (id) => this.vocab.types[id] !== TokenType.UserDefined && text.includes(this.vocab.tokens[id]),
    );
  }

  encode(text: string, options: EncodeOptions = {}): number[] {
    const addSpecial = options.addSpecial ?? true;
    // Lone surrogates become U+FFFD, as they do on their way into llama.cpp (and in TextEncoder).
    text = text.replace(/\p{Cs}/gu, '\uFFFD');
    const out: number[] = [];
    if (addSpecial && this.vocab.addBos && this.bosId !== undefined) out.push(this.bosId);
    for (const piece of this.partition(text, options.parseSpecial ?? false, options.literalSpans ?? [])) {
      if (typeof piece === 'number') {
        out.push(piece);
        continue;
      }
      const fragment = piece.text;
      if (this.spm) {
        // Every raw fragment follows a special token or the start, so each gets the dummy prefix (llama.cpp).
        const escaped = (this.vocab.addSpacePrefix ? ' ' : '') + fragment;
        sentencePieceEncode(this.spm, escaped.replaceAll(' ', '▁'), out);
      } else {
        for (const token of this.bpe!.encode(this.preTokenizer!.words(fragment))) {
          const id = this.idByText.get(token);
          if (id !== undefined) out.push(id);
        }
      }
    }
    if (addSpecial && this.vocab.addEos && this.eosId !== undefined) out.push(this.eosId);
    return out;
  }

  decode(ids: number[], options: DecodeOptions = {}): string {
    const skipSpecial = options.skipSpecial ?? true;
    const chunks: Uint8Array[] = [];
    let total = 0;
    // llama.cpp strips the dummy-prefix space from the first piece; we also do so after a skipped leading BOS.
    let stripSpace = this.vocab.addSpacePrefix;
    for (const id of ids) {
      let piece = this.piece(id, skipSpecial);
      if (stripSpace && piece.length === 0 && id === this.bosId) continue;
      if (stripSpace && piece[0] === 0x20) piece = piece.subarray(1);
      stripSpace = false;
      chunks.push(piece);
      total += piece.length;
    }
    const bytes = new Uint8Array(total);
    let offset = 0;
    for (const chunk of chunks) {
      bytes.set(chunk, offset);
      offset += chunk.length;
    }
    return new TextDecoder().decode(bytes);
  }

  /** The token's text as stored in the vocabulary (`▁` / byte-level characters not decoded). */
  tokenText(id: number): string {
    this.checkId(id);
    return this.vocab.tokens[id];
  }

  /** The token's type (control, user-defined, byte …). */
  tokenType(id: number): TokenType {
    this.checkId(id);
    return this.vocab.types[id];
  }

  isEndOfGeneration(id: number): boolean {
    return this.vocab.eogIds.has(id);
  }

  /**
   * The vocabulary as the grammar engine reads it (runtime/grammar/constraint.ts): control tokens as '' so that no
   * format's text can contain one, the end-of-generation ids as its stop tokens. `vocabSize` is the model's logits.
   */
  grammarVocabulary(vocabSize: number): GrammarVocabulary {
    return {
      tokens: this.vocab.tokens.map((text, id) => (this.vocab.types[id] === TokenType.Control ? '' : text)),
      kind: this.model === 'gpt2' ? 'byte_level' : 'byte_fallback',
      prependSpace: this.model === 'llama' && this.vocab.addSpacePrefix,
      stopIds: [...this.vocab.eogIds].sort((a, b) => a - b),
      vocabSize,
    };
  }

  /** Incremental decoding for generated tokens: pieces as llama.cpp's token_to_piece gives them, joined as UTF-8. */
  createStreamDecoder(options: DecodeOptions = {}): StreamDecoder {
    const skipSpecial = options.skipSpecial ?? true;
    const decoder = new TextDecoder('utf-8');
    return {
      push: (id: number) => decoder.decode(this.piece(id, skipSpecial), { stream: true }),
      flush: () => decoder.decode(),
    };
  }

  private checkId(id: number): void {
    if (!Number.isInteger(id) || id < 0 || id >= this.vocabSize) {
      throw new InvalidRequestError(`Token id ${id} is outside this model's vocabulary of ${this.vocabSize} tokens.`, {
        id,
      });
    }
  }

  /** The bytes a token contributes to decoded text (llama.cpp `token_to_piece`). */
  private piece(id: number, skipSpecial: boolean): Uint8Array {
    this.checkId(id);
    const type = this.vocab.types[id];
    if (type === TokenType.Control || type === TokenType.Unknown) {
      return skipSpecial ? EMPTY : utf8.encode(this.vocab.tokens[id]);
    }
    const cached = this.pieces[id];
    if (cached) return cached;
    const text = this.vocab.tokens[id];
    let bytes: Uint8Array;
    if (type === TokenType.UserDefined) bytes = utf8.encode(text);
    else if (type === TokenType.Byte) bytes = Uint8Array.of(Number.parseInt(text.slice(3, 5), 16));
    else if (type === TokenType.Normal) {
      if (this.model === 'llama') bytes = utf8.encode(text.replaceAll('▁', ' '));
      else {
        const chars = Array.from(text);
        bytes = new Uint8Array(chars.length);
        let n = 0;
        for (const ch of chars) {
          const b = CHAR_TO_BYTE.get(ch);
          // A character outside the byte alphabet cannot come from a valid byte-level vocabulary; keep its UTF-8.
          if (b === undefined) {
            bytes = utf8.encode(text);
            n = -1;
            break;
          }
          bytes[n++] = b;
        }
        if (n >= 0) bytes = bytes.subarray(0, n);
      }
    } else bytes = EMPTY; // unused / undefined tokens render as nothing, as in llama.cpp
    this.pieces[id] = bytes;
    return bytes;
  }

  /**
   * Splits text into raw-text fragments and special-token ids (llama.cpp `tokenizer_st_partition`); a control
   * token's text that overlaps a literal span stays in its fragment.
   */
  private partition(
    text: string,
    parseSpecial: boolean,
    literal: ReadonlyArray<readonly [number, number]>,
  ): Fragment[] {
    if (text.length === 0) return [];
    const isLiteral = (start: number, end: number) => literal.some(([a, b]) => start < b && a < end);
    let fragments: Fragment[] = [{ text, at: 0 }];
    for (const id of this.specialIds) {
      const type = this.vocab.types[id];
      if (!parseSpecial && type !== TokenType.UserDefined) continue;
      const special = this.vocab.tokens[id];
      const keepText = type !== TokenType.UserDefined && literal.length > 0;
      let changed = false;
      const next: Fragment[] = [];
      for (const fragment of fragments) {
        if (typeof fragment === 'number' || !fragment.text.includes(special)) {
          next.push(fragment);
          continue;
        }
        const { text: run, at: base } = fragment;
        let from = 0;
        let piece = 0; // start of the text not yet pushed
        for (let at = run.indexOf(special); at >= 0; at = run.indexOf(special, from)) {
          from = at + special.length;
          if (keepText && isLiteral(base + at, base + from)) continue;
          changed = true;
          if (at > piece) next.push({ text: run.slice(piece, at), at: base + piece });
          next.push(id);
          piece = from;
        }
        if (piece < run.length) next.push(piece === 0 ? fragment : { text: run.slice(piece), at: base + piece });
      }
      if (changed) fragments = next;
    }
    return fragments;
  }
}
