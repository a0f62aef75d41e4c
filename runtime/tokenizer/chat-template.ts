/**
 * Chat templates: the model's `tokenizer.chat_template` (Jinja) rendered by @huggingface/jinja, an interpreter that
 * wraps every value it is given in its own runtime types. Templates come from model files, i.e. from strangers, and
 * run sandboxed: attribute access only reaches the interpreter's own members (`''.constructor`,
 * `messages.__proto__` are undefined), there are no globals, and the only callables are its built-ins.
 */
import { Environment, Interpreter, Template } from '@huggingface/jinja';
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

/**
 * What a template may spend on one conversation. A template is a program from a model file: a loop over
 * `range(2147483647)` ran the process out of memory, past any `try`, and `range(10**6)` took seconds on every
 * request. Steps are the interpreter's evaluations and blocks (a loop's every iteration is one), at most a floor plus
 * a number per message (Qwen3's template takes about 55 a message); a `range` holds at most `rangeItems` items; any
 * value, and everything the template writes counted at every level it passes through, at most a floor plus a
 * multiple of the conversation's own size.
 */
export const CHAT_TEMPLATE_LIMITS = {
  stepsFloor: 1_000_000,
  stepsPerMessage: 1_000,
  rangeItems: 65_536,
  outputFloorChars: 16 << 20,
} as const;

/** A render that went past CHAT_TEMPLATE_LIMITS. */
class TemplateLimitExceeded extends Error {}

/** The interpreter's own evaluation methods, reached to count them (the library declares them private). */
interface InterpreterInternals {
  evaluate(statement: unknown, environment: unknown): { value: unknown };
  evaluateBlock(statements: unknown, environment: unknown): { value: string };
}

/** Python's range, refusing more than CHAT_TEMPLATE_LIMITS.rangeItems items before it makes any. */
function limitedRange(start: number, stop?: number, step = 1): number[] {
  const [from, to] = stop === undefined ? [0, start] : [start, stop];
  if (step === 0) throw new Error('range() step must not be zero');
  const count = Math.max(0, Math.ceil((to - from) / step));
  if (!(count <= CHAT_TEMPLATE_LIMITS.rangeItems)) {
    throw new TemplateLimitExceeded(`range() of ${count} items (at most ${CHAT_TEMPLATE_LIMITS.rangeItems})`);
  }
  return Array.from({ length: count }, (_, i) => from + i * step);
}

const MONTHS = [
  'January',
  'February',
  'March',
  'April',
  'May',
  'June',
  'July',
  'August',
  'September',
  'October',
  'November',
  'December',
];

/** The current date in a strftime format (%Y %m %d %b %B %H %M %S %%), as Llama 3.1's template asks for it. */
function strftimeNow(format: string): string {
  const now = new Date();
  const two = (n: number) => String(n).padStart(2, '0');
  const fields: Record<string, string> = {
    Y: String(now.getFullYear()),
    m: two(now.getMonth() + 1),
    d: two(now.getDate()),
    b: MONTHS[now.getMonth()].slice(0, 3),
    B: MONTHS[now.getMonth()],
    H: two(now.getHours()),
    M: two(now.getMinutes()),
    S: two(now.getSeconds()),
    '%': '%',
  };
  return format.replace(/%([YmdbBHMS%])/g, (_, field: string) => fields[field]);
}

/**
 * `compiled` rendered with `items` under CHAT_TEMPLATE_LIMITS, with the globals a template expects (those of
 * @huggingface/jinja's own render; `range` limited). The limits are counted on this render's interpreter alone.
 */
function renderLimited(compiled: Template, items: Record<string, unknown>): string {
  const environment = new Environment();
  const globals: Record<string, unknown> = {
    false: false,
    true: true,
    none: null,
    False: false,
    True: true,
    None: null,
    raise_exception: (message: unknown) => {
      throw new Error(String(message));
    },
    range: limitedRange,
    strftime_now: strftimeNow,
  };
  for (const [name, value] of Object.entries({ ...globals, ...items })) environment.set(name, value);
  const interpreter = new Interpreter(environment);
  const internals = interpreter as unknown as InterpreterInternals;
  const proto = Object.getPrototypeOf(interpreter) as InterpreterInternals;
  const outputChars = CHAT_TEMPLATE_LIMITS.outputFloorChars + 8 * JSON.stringify(items).length;
  const messages = Array.isArray(items.messages) ? items.messages.length : 0;
  const maxSteps = CHAT_TEMPLATE_LIMITS.stepsFloor + CHAT_TEMPLATE_LIMITS.stepsPerMessage * messages;
  let steps = 0;
  let written = 0;
  const step = () => {
    if (++steps > maxSteps) throw new TemplateLimitExceeded(`more than ${maxSteps} steps`);
  };
  internals.evaluate = (statement, scope) => {
    step();
    const result = proto.evaluate.call(interpreter, statement, scope);
    const value = result.value;
    if ((typeof value === 'string' || Array.isArray(value)) && value.length > outputChars) {
      throw new TemplateLimitExceeded(`a value of ${value.length} items (at most ${outputChars})`);
    }
    return result;
  };
  internals.evaluateBlock = (statements, scope) => {
    // A loop's iterations are blocks, empty ones too: each counts.
    step();
    const result = proto.evaluateBlock.call(interpreter, statements, scope);
    written += result.value.length;
    if (written > outputChars) throw new TemplateLimitExceeded(`output past ${outputChars} characters`);
    return result;
  };
  return String(interpreter.run(compiled.parsed).value);
}

/**
 * Renders `template` for a conversation, under CHAT_TEMPLATE_LIMITS. A template that rejects the conversation, or
 * goes past a limit, throws InvalidRequestError.
 */
export function renderChatTemplate(template: string, context: ChatTemplateContext): string {
  const compiled = compile(template);
  try {
    return renderLimited(compiled, { add_generation_prompt: true, ...context });
  } catch (error) {
    // A RangeError is V8's own limit (a string past its longest): the same kind of failure, caught one step later.
    if (error instanceof TemplateLimitExceeded || error instanceof RangeError) {
      throw new InvalidRequestError(
        `The model's chat template went past its limits rendering this conversation (${error.message}): a template that needs that much is broken or hostile.`,
        { limit: error.message },
      );
    }
    throw new InvalidRequestError(`The model's chat template rejected this conversation: ${(error as Error).message}`);
  }
}

/**
 * A model's template checked when the model loads: a short conversation (system, user, assistant, user) must render
 * within CHAT_TEMPLATE_LIMITS, or the model is refused. A template that refuses that conversation itself (some reject
 * a system message), or that the Jinja library cannot parse, is left to the chat requests: the model still serves
 * raw completions.
 */
export function probeChatTemplate(template: string): void {
  try {
    renderChatTemplate(template, {
      messages: [
        { role: 'system', content: 'You are a helpful assistant.' },
        { role: 'user', content: 'Hello.' },
        { role: 'assistant', content: 'Hello! How can I help?' },
        { role: 'user', content: 'What is 2 + 2?' },
      ],
    });
  } catch (error) {
    if (error instanceof InvalidRequestError && error.details.limit !== undefined) {
      throw new UnsupportedModelError(
        `This model's chat template went past its limits on a four-message conversation (${String(error.details.limit)}): it is broken or hostile, so the model is refused.`,
      );
    }
    if (!(error instanceof InvalidRequestError || error instanceof UnsupportedModelError)) throw error;
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
