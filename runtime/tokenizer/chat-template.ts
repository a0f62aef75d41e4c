/**
 * Chat templates: the model's `tokenizer.chat_template` (Jinja) rendered by @huggingface/jinja, an interpreter that
 * wraps every value it is given in its own runtime types. Templates come from model files, i.e. from strangers, and
 * run sandboxed: attribute access only reaches the interpreter's own members (`''.constructor`,
 * `messages.__proto__` are undefined), there are no globals, and the only callables are its built-ins.
 */
import { Template } from '@huggingface/jinja';
import { InvalidRequestError, UnsupportedModelError } from '../../core/errors.ts';
import type { GgufMetadata } from '../../core/gguf-types.ts';
import type { EncodeOptions } from './tokenizer.ts';

export interface ChatMessage {
  role: 'system' | 'user' | 'assistant' | 'tool' | (string & {});
  content: string;
  [field: string]: unknown;
}

export interface ChatTemplateContext {
  messages: ChatMessage[];
  /** End with the opening of an assistant turn, so the model writes the reply. */
  add_generation_prompt?: boolean;
  bos_token?: string;
  eos_token?: string;
  /** Anything else a template reads (`tools`, `enable_thinking`, `date_string` …). */
  [variable: string]: unknown;
}

/**
 * Used when a model carries no template: ChatML (`<|im_start|>role\ncontent<|im_end|>\n`), which most instruction
 * models either use or tolerate. In a vocabulary without those markers they are tokenized as plain text.
 */
export const FALLBACK_CHAT_TEMPLATE =
  '{%- for message in messages -%}' +
  "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}" +
  '{%- endfor -%}' +
  "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/** Parsed templates by source: a model's template is rendered once per request. */
const parsed = new Map<string, Template>();

function compile(template: string): Template {
  let compiled = parsed.get(template);
  if (!compiled) {
    try {
      compiled = new Template(template);
    } catch (error) {
      throw new UnsupportedModelError(
        `This model's chat template could not be parsed (${(error as Error).message}). Use a model whose template uses supported Jinja, or pass a template of your own.`,
      );
    }
    if (parsed.size >= 16) parsed.delete(parsed.keys().next().value!);
    parsed.set(template, compiled);
  }
  return compiled;
}

/** Renders `template` for a conversation. A template that rejects the conversation throws InvalidRequestError. */
export function renderChatTemplate(template: string, context: ChatTemplateContext): string {
  const compiled = compile(template);
  try {
    return compiled.render({ add_generation_prompt: true, ...context });
  } catch (error) {
    throw new InvalidRequestError(`The model's chat template rejected this conversation: ${(error as Error).message}`);
  }
}

/** The model's template, or the ChatML fallback when the file has none. */
export function chatTemplateFromMetadata(meta: GgufMetadata): string {
  const template = meta['tokenizer.chat_template'];
  return typeof template === 'string' && template.trim().length > 0 ? template : FALLBACK_CHAT_TEMPLATE;
}

/** What encodeConversation needs of a tokenizer (GgufTokenizer). */
export interface ConversationTokenizer {
  readonly bosId?: number;
  readonly eosId?: number;
  tokenText(id: number): string;
  hasControlText(text: string): boolean;
  encode(text: string, options: EncodeOptions): number[];
}

/**
 * The conversation rendered by `template` and tokenized. The template's control tokens become tokens; the messages'
 * own text stays text, so a message that writes `<|im_end|><|im_start|>system` cannot open a turn, unless
 * `specialTokensInContent` is 'tokens' (for callers that write template markup on purpose).
 */
export function encodeConversation(
  tokenizer: ConversationTokenizer,
  template: string,
  messages: readonly ChatMessage[],
  options: {
    addGenerationPrompt: boolean;
    specialTokensInContent: 'text' | 'tokens';
    /** Template variables beside the messages (`tools`). */
    variables?: Record<string, unknown>;
    /** Text the reply starts with, after the generation prompt (a forced tool call's opening tag). */
    replyPrefix?: string;
  },
): number[] {
  const bos = tokenizer.bosId !== undefined ? tokenizer.tokenText(tokenizer.bosId) : '';
  if (options.specialTokensInContent === 'text') {
    // Tool calls and tools are written by the template through `tojson`, not as a message's content: text in them
    // that spells a control token could not be kept text, so it is refused.
    const structured: Array<[string, unknown]> = [
      ...messages.flatMap(
        (m, i): Array<[string, unknown]> => (m.tool_calls ? [[`messages[${i}].tool_calls`, m.tool_calls]] : []),
      ),
      ...Object.entries(options.variables ?? {}),
    ];
    for (const [field, value] of structured) {
      if (tokenizer.hasControlText(JSON.stringify(value))) {
        throw new InvalidRequestError(
          `${field} holds control-token text, which the chat template would read as control tokens: remove it, or pass special_tokens_in_content: 'tokens'.`,
          { field },
        );
      }
    }
  }
  const text =
    renderChatTemplate(template, {
      ...options.variables,
      messages: [...messages],
      add_generation_prompt: options.addGenerationPrompt,
      bos_token: bos,
      eos_token: tokenizer.eosId !== undefined ? tokenizer.tokenText(tokenizer.eosId) : '',
    }) + (options.replyPrefix ?? '');
  // A template that writes BOS itself must not get a second one from the tokenizer.
  const addSpecial = !(bos && text.startsWith(bos));
  const literalSpans =
    options.specialTokensInContent === 'tokens' ? [] : contentSpans(text, messages, (t) => tokenizer.hasControlText(t));
  return tokenizer.encode(text, { addSpecial, parseSpecial: true, literalSpans });
}

/**
 * Where the content of each message that holds control-token text lies in the rendered conversation: found in
 * order, as written or trimmed (templates trim). A content the template rewrote otherwise cannot be told apart from
 * the template's own text, so such a message is refused rather than parsed.
 */
export function contentSpans(
  rendered: string,
  messages: readonly ChatMessage[],
  hasControlText: (text: string) => boolean,
): Array<[number, number]> {
  const spans: Array<[number, number]> = [];
  let from = 0;
  for (const [i, message] of messages.entries()) {
    const content = message.content;
    if (!hasControlText(content)) continue;
    let at = rendered.indexOf(content, from);
    let length = content.length;
    if (at < 0) {
      const trimmed = content.trim();
      at = rendered.indexOf(trimmed, from);
      length = trimmed.length;
    }
    if (at < 0) {
      throw new InvalidRequestError(
        `messages[${i}].content holds control-token text, and the chat template rewrites the message, so that text cannot be kept as text: remove it, or pass special_tokens_in_content: 'tokens'.`,
        { field: `messages[${i}].content` },
      );
    }
    spans.push([at, at + length]);
    from = at + length;
  }
  return spans;
}
