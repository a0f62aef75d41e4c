/**
 * Chat templates: the model's `tokenizer.chat_template` (Jinja) rendered by @huggingface/jinja, an interpreter that
 * wraps every value it is given in its own runtime types. Templates come from model files, i.e. from strangers, and
 * run sandboxed: attribute access only reaches the interpreter's own members (`''.constructor`,
 * `messages.__proto__` are undefined), there are no globals, and the only callables are its built-ins.
 */
import { Template } from '@huggingface/jinja';
import { InvalidRequestError, UnsupportedModelError } from '../../core/errors.ts';
import type { GgufMetadata } from '../../core/gguf-types.ts';

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
