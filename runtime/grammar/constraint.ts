/**
 * Constrained decoding: a request's `response_format` (JSON, a JSON schema, or an EBNF grammar) becomes a token
 * constraint that, before each sampled step, gives the bitmask of the tokens the format allows next (the GPU
 * sampler applies it: kernels/sample.ts `setMask`) and then accepts the token drawn. The grammar engine is xgrammar
 * (runtime/grammar/xgrammar.ts); nothing here parses JSON schemas or grammars itself.
 */
import type { CompiledGrammar, GrammarCompiler, GrammarMatcher, TokenizerInfo } from '@mlc-ai/web-xgrammar';
import { InvalidRequestError } from '../../core/errors.ts';
import type { ResponseFormat } from '../engine/api-types.ts';
import { loadXgrammar, type XgrammarModule } from './xgrammar.ts';

/** The vocabulary as the grammar engine reads it (GgufTokenizer.grammarVocabulary). */
export interface GrammarVocabulary {
  /** Token texts as the GGUF spells them; control tokens as '' (never allowed inside the format's text). */
  tokens: readonly string[];
  /** 'byte_level': GPT-2 byte-to-unicode spelling; 'byte_fallback': SentencePiece with <0xNN> pieces. */
  kind: 'byte_level' | 'byte_fallback';
  /** Whether the tokenizer puts a space before the text (SentencePiece's dummy prefix). */
  prependSpace: boolean;
  /** The ids that end a reply: allowed once the format is complete. */
  stopIds: readonly number[];
  /** Logits per step (the model's vocabulary, which may exceed the tokenizer's). */
  vocabSize: number;
}

/** One request's constraint: the allowed next tokens, step by step. */
export interface TokenConstraint {
  /** Bit id % 32 of word id / 32 allows id: ceil(vocabSize / 32) words. */
  nextMask(): Promise<Uint32Array>;
  /** Advances past the sampled id; an id the mask did not allow throws. */
  accept(id: number): void;
  /** True once a stop token ended the format. */
  readonly terminated: boolean;
  dispose(): void;
}

/** Compiles the formats of one model's requests (the tokenizer's tables are built once). */
export class ResponseFormatCompiler {
  private constructor(
    private readonly xgrammar: XgrammarModule,
    private readonly info: TokenizerInfo,
    private readonly compiler: GrammarCompiler,
  ) {}

  static async create(vocab: GrammarVocabulary): Promise<ResponseFormatCompiler> {
    const xgrammar = await loadXgrammar();
    const info = await xgrammar.TokenizerInfo.createTokenizerInfo(
      [...vocab.tokens],
      vocab.kind,
      vocab.prependSpace,
      vocab.vocabSize,
      [...vocab.stopIds],
    );
    const compiler = await xgrammar.GrammarCompiler.createGrammarCompiler(info, true);
    return new ResponseFormatCompiler(xgrammar, info, compiler);
  }

  /**
   * The constraint of `format`; null for plain text. An invalid schema or grammar is an InvalidRequestError naming
   * `options.field` (default: where the format puts it in `response_format`). JSON is indented by 2 spaces, or on
   * one line with `options.oneLine` (`{"a": 1, "b": 2}`: how chat templates write a tool call).
   */
  async constraint(
    format: ResponseFormat,
    options: { field?: string; oneLine?: boolean } = {},
  ): Promise<TokenConstraint | null> {
    const { field } = options;
    // xgrammar's indent: -1 for one line.
    const indent = options.oneLine ? -1 : 2;
    if (format.type === 'text') return null;
    let compiled: CompiledGrammar;
    try {
      // JSON in one fixed layout (no free whitespace): a small model can otherwise spend its tokens on blank lines.
      if (format.type === 'json_object') {
        compiled = await this.compiler.compileJSONSchema('{"type":"object"}', false, indent);
      } else if (format.type === 'json_schema') {
        const schema = JSON.stringify(format.json_schema.schema ?? { type: 'object' });
        compiled = await this.compiler.compileJSONSchema(
          schema,
          false,
          indent,
          undefined,
          format.json_schema.strict ?? true,
        );
      } else compiled = await this.compiler.compileGrammar(format.grammar, 'root');
    } catch (error) {
      const at =
        field ?? (format.type === 'grammar' ? 'response_format.grammar' : 'response_format.json_schema.schema');
      throw new InvalidRequestError(`${at}: the grammar engine cannot compile it: ${errorText(error)}`, { field: at });
    }
    const matcher = await this.xgrammar.GrammarMatcher.createGrammarMatcher(compiled);
    compiled.dispose();
    return new MatcherConstraint(matcher);
  }

  dispose(): void {
    this.compiler.dispose();
    this.info.dispose();
  }
}

class MatcherConstraint implements TokenConstraint {
  constructor(private readonly matcher: GrammarMatcher) {}

  async nextMask(): Promise<Uint32Array> {
    // Asked past its end, xgrammar's WebAssembly aborts, and an aborted module fails every later call.
    if (this.terminated) throw new Error('The response format has ended: there is no next token to constrain.');
    const mask = await this.matcher.getNextTokenBitmask();
    return new Uint32Array(mask.buffer, mask.byteOffset, mask.length);
  }

  accept(id: number): void {
    if (!this.matcher.acceptToken(id)) {
      throw new Error(`Token ${id} does not continue the response format, though the mask allowed it.`);
    }
  }

  get terminated(): boolean {
    return this.matcher.isTerminated();
  }

  dispose(): void {
    this.matcher.dispose();
  }
}

/** An error's message as xgrammar throws it (an Error, or a bare string from its WebAssembly side). */
function errorText(error: unknown): string {
  const text = error instanceof Error ? error.message : String(error);
  return text.length > 400 ? `${text.slice(0, 400)}…` : text;
}
