/**
 * Validation of the requests a caller hands the API (in-process, and in the worker for every message): types,
 * ranges and unknown fields, each failure an InvalidRequestError that names the field and what it accepts. The load
 * options have their own parser (load-options.ts), built on the helpers exported here.
 */
import { InvalidRequestError } from '../../core/errors.ts';
import type { SamplingParams } from '../sampling/params.ts';
import type { ChatMessage } from '../tokenizer/chat-template.ts';
import type {
  ChatTool,
  ChatToolChoice,
  ContextOverflowPolicy,
  ResponseFormat,
  SpecialTokensInContent,
} from './api-types.ts';

const MAX_MESSAGES = 10_000;
const MAX_TEXT_CHARS = 16 << 20;
/** Limits on a request's `stop`: strings, and characters of each (the chat page's settings check them too). */
export const MAX_STOP_STRINGS = 4;
export const MAX_STOP_CHARS = 256;
const MAX_ID_CHARS = 256;
const MAX_TOKENS_LIMIT = 1 << 20;

/** Throws the InvalidRequestError for a field's bad value: "field = value is invalid: rule." */
export function failField(field: string, value: unknown, rule: string): never {
  const shown =
    typeof value === 'string'
      ? JSON.stringify(value.slice(0, 40))
      : Array.isArray(value)
        ? `[${value.slice(0, 16).join(', ')}${value.length > 16 ? ', …' : ''}]`
        : String(value);
  throw new InvalidRequestError(`${field} = ${shown} is invalid: ${rule}.`, { field });
}

/** "'a', 'b' or 'c'": the values a field accepts, as its error message lists them. */
export function choiceList(choices: readonly string[]): string {
  const quoted = choices.map((c) => `'${c}'`);
  return quoted.length > 1 ? `${quoted.slice(0, -1).join(', ')} or ${quoted[quoted.length - 1]}` : quoted.join('');
}

export function isPlainObject(value: unknown): value is Record<string, unknown> {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) return false;
  const proto = Object.getPrototypeOf(value);
  return proto === Object.prototype || proto === null;
}

/**
 * `value` as a plain object whose fields are all `allowed`; else an InvalidRequestError listing them (`hint` may
 * add a sentence about an unknown field, e.g. where it belongs).
 */
export function checkObject(
  what: string,
  value: unknown,
  allowed: readonly string[],
  hint: (key: string) => string = () => '',
): Record<string, unknown> {
  if (!isPlainObject(value)) throw new InvalidRequestError(`${what} must be a plain object.`);
  for (const key of Object.keys(value)) {
    if (!allowed.includes(key)) {
      throw new InvalidRequestError(
        `${what}: unknown field '${key}'.${hint(key)} Supported fields: ${allowed.join(', ')}.`,
        { field: key },
      );
    }
  }
  return value;
}

function optionalNumber(
  field: string,
  value: unknown,
  test: (n: number) => boolean,
  rule: string,
  integer = false,
): number | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== 'number' || Number.isNaN(value) || (integer && !Number.isInteger(value)) || !test(value)) {
    failField(field, value, rule);
  }
  return value;
}

function optionalString(field: string, value: unknown, maxChars: number): string | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== 'string') failField(field, value, 'use a string');
  if (value.length > maxChars) failField(field, value, `use at most ${maxChars} characters`);
  return value;
}

function optionalBoolean(field: string, value: unknown): boolean | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== 'boolean') failField(field, value, 'use true or false');
  return value;
}

const SAMPLING_FIELDS = [
  'max_tokens',
  'temperature',
  'top_p',
  'top_k',
  'min_p',
  'repetition_penalty',
  'seed',
  'stop',
  'stream',
  'model',
  'response_format',
] as const;

export interface ValidatedSampling {
  maxTokens: number | undefined;
  sampling: Partial<SamplingParams>;
  stop: string[];
  stream: boolean;
  /** The reply's format; 'text' when none was given. */
  responseFormat: ResponseFormat;
}

/** OpenAI's rule for a json_schema's name: letters, digits, '_' and '-', at most 64. */
const SCHEMA_NAME = /^[A-Za-z0-9_-]{1,64}$/;

/** The request's `response_format`, checked for shape (the grammar engine checks the schema or grammar itself). */
function validateResponseFormat(value: unknown): ResponseFormat {
  if (value === undefined || value === null) return { type: 'text' };
  const f = checkObject('response_format', value, ['type', 'json_schema', 'grammar']);
  switch (f.type) {
    case 'text':
    case 'json_object':
      checkObject('response_format', value, ['type']);
      return { type: f.type };
    case 'json_schema': {
      checkObject('response_format', value, ['type', 'json_schema']);
      const j = checkObject('response_format.json_schema', f.json_schema, ['name', 'description', 'schema', 'strict']);
      if (typeof j.name !== 'string' || !SCHEMA_NAME.test(j.name)) {
        failField('response_format.json_schema.name', j.name, "use 1-64 letters, digits, '_' or '-'");
      }
      const description = optionalString('response_format.json_schema.description', j.description, MAX_TEXT_CHARS);
      if (j.schema !== undefined && !isPlainObject(j.schema)) {
        failField('response_format.json_schema.schema', j.schema, 'use a JSON Schema object');
      }
      const strict = optionalBoolean('response_format.json_schema.strict', j.strict);
      return {
        type: 'json_schema',
        json_schema: {
          name: j.name,
          ...(description !== undefined ? { description } : {}),
          ...(j.schema !== undefined ? { schema: j.schema as Record<string, unknown> } : {}),
          ...(strict !== undefined ? { strict } : {}),
        },
      };
    }
    case 'grammar':
      checkObject('response_format', value, ['type', 'grammar']);
      if (typeof f.grammar !== 'string' || f.grammar.trim().length === 0 || f.grammar.length > MAX_TEXT_CHARS) {
        failField('response_format.grammar', f.grammar, 'use a non-empty EBNF grammar whose start rule is `root`');
      }
      return { type: 'grammar', grammar: f.grammar };
    default:
      return failField('response_format.type', f.type, "use 'text', 'json_object', 'json_schema' or 'grammar'");
  }
}

function validateSampling(r: Record<string, unknown>): ValidatedSampling {
  const maxTokens = optionalNumber(
    'max_tokens',
    r.max_tokens,
    (n) => n >= 1 && n <= MAX_TOKENS_LIMIT,
    `use an integer in 1..${MAX_TOKENS_LIMIT} (the most tokens the reply may have)`,
    true,
  );
  const sampling: Partial<SamplingParams> = {
    temperature: optionalNumber(
      'temperature',
      r.temperature,
      (n) => n >= 0 && Number.isFinite(n),
      'use a finite number >= 0 (0 = greedy)',
    ),
    topP: optionalNumber('top_p', r.top_p, (n) => n > 0 && n <= 1, 'use a number in (0, 1] (1 = off)'),
    topK: optionalNumber('top_k', r.top_k, (n) => n >= 0 && n <= 0xffffffff, 'use an integer >= 0 (0 = off)', true),
    minP: optionalNumber('min_p', r.min_p, (n) => n >= 0 && n <= 1, 'use a number in [0, 1] (0 = off)'),
    repetitionPenalty: optionalNumber(
      'repetition_penalty',
      r.repetition_penalty,
      (n) => n > 0 && Number.isFinite(n),
      'use a finite number > 0 (1 = off)',
    ),
    seed: optionalNumber('seed', r.seed, (n) => Number.isSafeInteger(n), 'use a safe integer', true),
  };
  let stop: string[] = [];
  if (typeof r.stop === 'string') stop = [r.stop];
  else if (Array.isArray(r.stop)) stop = r.stop as string[];
  else if (r.stop !== undefined && r.stop !== null) failField('stop', r.stop, 'use a string or an array of strings');
  if (stop.length > MAX_STOP_STRINGS) failField('stop', `${stop.length} strings`, `use at most ${MAX_STOP_STRINGS}`);
  for (const s of stop) {
    if (typeof s !== 'string' || s.length === 0 || s.length > MAX_STOP_CHARS) {
      failField('stop', s, `each stop string must be a non-empty string of at most ${MAX_STOP_CHARS} characters`);
    }
  }
  optionalString('model', r.model, MAX_ID_CHARS);
  return {
    maxTokens,
    sampling,
    stop,
    stream: optionalBoolean('stream', r.stream) ?? false,
    responseFormat: validateResponseFormat(r.response_format),
  };
}

/**
 * A message's text: a string, or OpenAI's array of content parts, of which this runtime takes the text parts
 * (`{ type: 'text', text }`, joined by newlines as OpenAI-compatible servers join them); any other part (an image,
 * audio, a file) is refused by name, since the models served here read text only.
 */
function messageText(field: string, content: unknown): string {
  if (typeof content === 'string') return content;
  if (!Array.isArray(content) || content.length === 0) {
    failField(field, content, "use a string or a non-empty array of { type: 'text', text } parts");
  }
  if (content.length > MAX_MESSAGES) failField(field, `${content.length} parts`, `use at most ${MAX_MESSAGES}`);
  return content
    .map((part, j) => {
      const at = `${field}[${j}]`;
      if (!isPlainObject(part)) failField(at, part, "use { type: 'text', text }");
      if (part.type !== 'text') {
        failField(`${at}.type`, part.type, "only 'text' parts are supported: this runtime's models read text only");
      }
      checkObject(at, part, ['type', 'text']);
      if (typeof part.text !== 'string') failField(`${at}.text`, part.text, 'use a string');
      return part.text;
    })
    .join('\n');
}

export interface ValidatedChatRequest extends ValidatedSampling {
  messages: ChatMessage[];
  conversationId: string | undefined;
  /** Whether the conversation's KV is kept in the KV store (undefined: the load option's choice). */
  persist: boolean | undefined;
  overflow: ContextOverflowPolicy;
  specialTokensInContent: SpecialTokensInContent;
  /** The request's tools (empty without), and how the reply may call them ('none' without tools). */
  tools: ChatTool[];
  toolChoice: ChatToolChoice;
}

const MAX_TOOLS = 128;
/** OpenAI's rule for a function's name: letters, digits, '_' and '-', at most 64. */
const FUNCTION_NAME = /^[A-Za-z0-9_-]{1,64}$/;

function validateTools(value: unknown): ChatTool[] {
  if (value === undefined || value === null) return [];
  if (!Array.isArray(value) || value.length === 0 || value.length > MAX_TOOLS) {
    failField('tools', value, `use a non-empty array of at most ${MAX_TOOLS} { type: 'function', function } tools`);
  }
  const names = new Set<string>();
  return value.map((tool, i): ChatTool => {
    const t = checkObject(`tools[${i}]`, tool, ['type', 'function']);
    if (t.type !== 'function') failField(`tools[${i}].type`, t.type, "use 'function' (the one tool type)");
    const f = checkObject(`tools[${i}].function`, t.function, ['name', 'description', 'parameters', 'strict']);
    if (typeof f.name !== 'string' || !FUNCTION_NAME.test(f.name)) {
      failField(`tools[${i}].function.name`, f.name, "use 1-64 letters, digits, '_' or '-'");
    }
    if (names.has(f.name)) failField(`tools[${i}].function.name`, f.name, 'each tool needs a name of its own');
    names.add(f.name);
    const description = optionalString(`tools[${i}].function.description`, f.description, MAX_TEXT_CHARS);
    if (f.parameters !== undefined && !isPlainObject(f.parameters)) {
      failField(`tools[${i}].function.parameters`, f.parameters, 'use a JSON Schema object');
    }
    const strict = optionalBoolean(`tools[${i}].function.strict`, f.strict);
    return {
      type: 'function',
      function: {
        name: f.name,
        ...(description !== undefined ? { description } : {}),
        ...(f.parameters !== undefined ? { parameters: f.parameters as Record<string, unknown> } : {}),
        ...(strict !== undefined ? { strict } : {}),
      },
    };
  });
}

function validateToolChoice(value: unknown, tools: readonly ChatTool[]): ChatToolChoice {
  if (value === undefined || value === null) return tools.length > 0 ? 'auto' : 'none';
  if (tools.length === 0) failField('tool_choice', JSON.stringify(value), 'a tool choice needs `tools`');
  if (value === 'none' || value === 'auto' || value === 'required') return value;
  if (typeof value === 'string') {
    failField('tool_choice', value, "use 'none', 'auto', 'required' or { type: 'function', function: { name } }");
  }
  const c = checkObject('tool_choice', value, ['type', 'function']);
  if (c.type !== 'function') failField('tool_choice.type', c.type, "use 'function'");
  const f = checkObject('tool_choice.function', c.function, ['name']);
  if (typeof f.name !== 'string' || !tools.some((t) => t.function.name === f.name)) {
    failField(
      'tool_choice.function.name',
      f.name,
      `name one of the tools (${tools.map((t) => t.function.name).join(', ')})`,
    );
  }
  return { type: 'function', function: { name: f.name } };
}

/**
 * An assistant message's calls as the chat template reads them: each call's arguments as an object where they are
 * JSON (templates write them with \`tojson\`), else the text.
 */
function validateToolCalls(field: string, value: unknown): Array<Record<string, unknown>> {
  if (!Array.isArray(value) || value.length === 0 || value.length > MAX_TOOLS) {
    failField(field, value, `use a non-empty array of at most ${MAX_TOOLS} calls`);
  }
  return value.map((call, j) => {
    const c = checkObject(`${field}[${j}]`, call, ['id', 'type', 'function']);
    const id = optionalString(`${field}[${j}].id`, c.id, MAX_ID_CHARS);
    if (c.type !== 'function') failField(`${field}[${j}].type`, c.type, "use 'function'");
    const f = checkObject(`${field}[${j}].function`, c.function, ['name', 'arguments']);
    if (typeof f.name !== 'string' || !FUNCTION_NAME.test(f.name)) {
      failField(`${field}[${j}].function.name`, f.name, "use 1-64 letters, digits, '_' or '-'");
    }
    const text = optionalString(`${field}[${j}].function.arguments`, f.arguments, MAX_TEXT_CHARS) ?? '{}';
    let args: unknown = text;
    try {
      args = JSON.parse(text);
    } catch {}
    return { ...(id !== undefined ? { id } : {}), type: 'function', function: { name: f.name, arguments: args } };
  });
}

export function validateChatRequest(request: unknown): ValidatedChatRequest {
  const r = checkObject('chat.completions.create request', request, [
    ...SAMPLING_FIELDS,
    'messages',
    'tools',
    'tool_choice',
    'conversation_id',
    'persist',
    'context_overflow',
    'special_tokens_in_content',
  ]);
  if (!Array.isArray(r.messages) || r.messages.length === 0) {
    throw new InvalidRequestError('messages must be a non-empty array of { role, content }.', { field: 'messages' });
  }
  if (r.messages.length > MAX_MESSAGES)
    failField('messages', `${r.messages.length} messages`, `use at most ${MAX_MESSAGES}`);
  const messages = r.messages.map((m, i): ChatMessage => {
    const message = checkObject(`messages[${i}]`, m, ['role', 'content', 'name', 'tool_calls', 'tool_call_id']);
    const { role } = message;
    if (role !== 'system' && role !== 'user' && role !== 'assistant' && role !== 'tool') {
      failField(`messages[${i}].role`, role, "use 'system', 'user', 'assistant' or 'tool'");
    }
    if (message.tool_calls !== undefined && role !== 'assistant') {
      failField(`messages[${i}].tool_calls`, '[…]', 'only an assistant message carries tool calls');
    }
    if ((message.tool_call_id !== undefined) !== (role === 'tool')) {
      failField(
        `messages[${i}].tool_call_id`,
        message.tool_call_id,
        "a 'tool' message, and only one, names the call it answers",
      );
    }
    const toolCalls =
      message.tool_calls === undefined ? undefined : validateToolCalls(`messages[${i}].tool_calls`, message.tool_calls);
    // An assistant message that only calls tools has no content.
    const content =
      (message.content === null || message.content === undefined) && toolCalls
        ? ''
        : messageText(`messages[${i}].content`, message.content);
    if (content.length > MAX_TEXT_CHARS) failField(`messages[${i}].content`, '(long)', 'too long');
    return {
      role,
      content,
      ...(toolCalls ? { tool_calls: toolCalls } : {}),
      ...(role === 'tool' ? { tool_call_id: validateId(`messages[${i}].tool_call_id`, message.tool_call_id) } : {}),
    };
  });
  const conversationId = optionalString('conversation_id', r.conversation_id, MAX_ID_CHARS);
  if (conversationId === '') failField('conversation_id', conversationId, 'use a non-empty string');
  const persist = optionalBoolean('persist', r.persist);
  if (persist && conversationId === undefined) {
    failField('persist', persist, 'a request keeps its KV only in a conversation: pass a conversation_id with it');
  }
  const overflow = r.context_overflow ?? 'error';
  if (overflow !== 'error' && overflow !== 'drop_oldest_turns') {
    failField('context_overflow', overflow, "use 'error' or 'drop_oldest_turns'");
  }
  const specialTokensInContent = r.special_tokens_in_content ?? 'text';
  if (specialTokensInContent !== 'text' && specialTokensInContent !== 'tokens') {
    failField('special_tokens_in_content', specialTokensInContent, "use 'text' (the default) or 'tokens'");
  }
  const tools = validateTools(r.tools);
  const toolChoice = validateToolChoice(r.tool_choice, tools);
  const sampling = validateSampling(r);
  if (tools.length > 0 && toolChoice !== 'none' && sampling.responseFormat.type !== 'text') {
    throw new InvalidRequestError(
      "response_format and tools cannot be combined: a reply is either calls of the tools or text in the format. Pass tool_choice: 'none' to have the reply in the format.",
      { field: 'response_format' },
    );
  }
  return { ...sampling, messages, conversationId, persist, overflow, specialTokensInContent, tools, toolChoice };
}

export interface ValidatedCompletionRequest extends ValidatedSampling {
  prompt: string;
}

export function validateCompletionRequest(request: unknown): ValidatedCompletionRequest {
  const r = checkObject('completions.create request', request, [...SAMPLING_FIELDS, 'prompt']);
  if (typeof r.prompt !== 'string') failField('prompt', r.prompt, 'use a string');
  if (r.prompt.length > MAX_TEXT_CHARS) failField('prompt', '(long)', 'too long');
  return { ...validateSampling(r), prompt: r.prompt };
}

/** Conversation ids and other short strings passed alone. */
export function validateId(field: string, value: unknown): string {
  const id = optionalString(field, value, MAX_ID_CHARS);
  if (!id) failField(field, value, 'use a non-empty string');
  return id;
}
