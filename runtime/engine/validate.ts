/**
 * Validation of everything a caller hands the API (in-process, and again in the worker for every message): types,
 * ranges and unknown fields, each failure an InvalidRequestError that names the field and what it accepts.
 */
import { InvalidRequestError } from '../../core/errors.ts';
import type { SamplingParams } from '../sampling/params.ts';
import {
  type ChatMessageParam,
  type ContextOverflowPolicy,
  type EngineLoadOptions,
  PREFILL_CHOICES,
} from './api-types.ts';

const MAX_MESSAGES = 10_000;
const MAX_TEXT_CHARS = 16 << 20;
const MAX_STOP_STRINGS = 4;
const MAX_STOP_CHARS = 256;
const MAX_ID_CHARS = 256;
const MAX_TOKENS_LIMIT = 1 << 20;

function fail(field: string, value: unknown, rule: string): never {
  const shown = typeof value === 'string' ? JSON.stringify(value.slice(0, 40)) : String(value);
  throw new InvalidRequestError(`${field} = ${shown} is invalid: ${rule}.`, { field });
}

/** "'a', 'b' or 'c'": the values a field accepts, as its error message lists them. */
export function choiceList(choices: readonly string[]): string {
  const quoted = choices.map((c) => `'${c}'`);
  return quoted.length > 1 ? `${quoted.slice(0, -1).join(', ')} or ${quoted[quoted.length - 1]}` : quoted.join('');
}

function optionalChoice(field: string, value: unknown, choices: readonly string[]): void {
  if (value !== undefined && !choices.includes(value as string)) fail(field, value, `use ${choiceList(choices)}`);
}

function isPlainObject(value: unknown): value is Record<string, unknown> {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) return false;
  const proto = Object.getPrototypeOf(value);
  return proto === Object.prototype || proto === null;
}

function checkObject(what: string, value: unknown, allowed: readonly string[]): Record<string, unknown> {
  if (!isPlainObject(value)) throw new InvalidRequestError(`${what} must be a plain object.`);
  for (const key of Object.keys(value)) {
    if (!allowed.includes(key)) {
      throw new InvalidRequestError(`${what}: unknown field '${key}'. Supported fields: ${allowed.join(', ')}.`, {
        field: key,
      });
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
    fail(field, value, rule);
  }
  return value;
}

function optionalString(field: string, value: unknown, maxChars: number): string | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== 'string') fail(field, value, 'use a string');
  if (value.length > maxChars) fail(field, value, `use at most ${maxChars} characters`);
  return value;
}

function optionalBoolean(field: string, value: unknown): boolean | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== 'boolean') fail(field, value, 'use true or false');
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
] as const;

export interface ValidatedSampling {
  maxTokens: number | undefined;
  sampling: Partial<SamplingParams>;
  stop: string[];
  stream: boolean;
}

function validateSampling(r: Record<string, unknown>): ValidatedSampling {
  const maxTokens = optionalNumber(
    'max_tokens',
    r.max_tokens,
    (n) => n >= 0 && n <= MAX_TOKENS_LIMIT,
    `use an integer in 0..${MAX_TOKENS_LIMIT}`,
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
  else if (r.stop !== undefined && r.stop !== null) fail('stop', r.stop, 'use a string or an array of strings');
  if (stop.length > MAX_STOP_STRINGS) fail('stop', `${stop.length} strings`, `use at most ${MAX_STOP_STRINGS}`);
  for (const s of stop) {
    if (typeof s !== 'string' || s.length === 0 || s.length > MAX_STOP_CHARS) {
      fail('stop', s, `each stop string must be a non-empty string of at most ${MAX_STOP_CHARS} characters`);
    }
  }
  optionalString('model', r.model, MAX_ID_CHARS);
  return { maxTokens, sampling, stop, stream: optionalBoolean('stream', r.stream) ?? false };
}

export interface ValidatedChatRequest extends ValidatedSampling {
  messages: ChatMessageParam[];
  conversationId: string | undefined;
  overflow: ContextOverflowPolicy;
}

export function validateChatRequest(request: unknown): ValidatedChatRequest {
  const r = checkObject('chat.completions.create request', request, [
    ...SAMPLING_FIELDS,
    'messages',
    'conversation_id',
    'context_overflow',
  ]);
  if (!Array.isArray(r.messages) || r.messages.length === 0) {
    throw new InvalidRequestError('messages must be a non-empty array of { role, content }.', { field: 'messages' });
  }
  if (r.messages.length > MAX_MESSAGES)
    fail('messages', `${r.messages.length} messages`, `use at most ${MAX_MESSAGES}`);
  const messages = r.messages.map((m, i): ChatMessageParam => {
    const message = checkObject(`messages[${i}]`, m, ['role', 'content', 'name']);
    if (message.role !== 'system' && message.role !== 'user' && message.role !== 'assistant') {
      fail(`messages[${i}].role`, message.role, "use 'system', 'user' or 'assistant'");
    }
    if (typeof message.content !== 'string') fail(`messages[${i}].content`, message.content, 'use a string');
    if (message.content.length > MAX_TEXT_CHARS) fail(`messages[${i}].content`, '(long)', 'too long');
    return { role: message.role, content: message.content };
  });
  const conversationId = optionalString('conversation_id', r.conversation_id, MAX_ID_CHARS);
  if (conversationId === '') fail('conversation_id', conversationId, 'use a non-empty string');
  const overflow = r.context_overflow ?? 'error';
  if (overflow !== 'error' && overflow !== 'drop_oldest_turns') {
    fail('context_overflow', overflow, "use 'error' or 'drop_oldest_turns'");
  }
  return { ...validateSampling(r), messages, conversationId, overflow };
}

export interface ValidatedCompletionRequest extends ValidatedSampling {
  prompt: string;
}

export function validateCompletionRequest(request: unknown): ValidatedCompletionRequest {
  const r = checkObject('completions.create request', request, [...SAMPLING_FIELDS, 'prompt']);
  if (typeof r.prompt !== 'string') fail('prompt', r.prompt, 'use a string');
  if (r.prompt.length > MAX_TEXT_CHARS) fail('prompt', '(long)', 'too long');
  return { ...validateSampling(r), prompt: r.prompt };
}

export const LOAD_OPTION_FIELDS = [
  'kv',
  'kvBudgetBytes',
  'sink',
  'window',
  'groupSize',
  'boostLayers',
  'rotation',
  'maxSequences',
  'maxContextTokens',
  'prefillChunk',
  'prefillMatmul',
  'prefillAttention',
  'calibrate',
  'calibrationTokens',
  'onProgress',
] as const;

/**
 * Load options: the fields' types here (their ranges are checked by kvPoolOptions / Engine.load, the one place each
 * is read). `onProgress` may be a function or, through the worker, a Comlink proxy (also callable).
 */
export function validateLoadOptions(options: unknown): EngineLoadOptions {
  if (options === undefined || options === null) return {};
  const o = checkObject('load options', options, LOAD_OPTION_FIELDS);
  optionalChoice('kv', o.kv, ['f16', 'int2']);
  optionalChoice('prefillMatmul', o.prefillMatmul, PREFILL_CHOICES);
  optionalChoice('prefillAttention', o.prefillAttention, PREFILL_CHOICES);
  for (const name of [
    'kvBudgetBytes',
    'sink',
    'window',
    'groupSize',
    'maxSequences',
    'maxContextTokens',
    'prefillChunk',
  ] as const) {
    optionalNumber(name, o[name], (n) => n >= 0 && Number.isSafeInteger(n), 'use a non-negative integer', true);
  }
  if (
    o.boostLayers !== undefined &&
    (!Array.isArray(o.boostLayers) || !Array.from(o.boostLayers).every((l) => Number.isSafeInteger(l) && l >= 0))
  )
    fail('boostLayers', o.boostLayers, 'use an array of layer indices (non-negative integers)');
  if (o.rotation !== undefined && o.rotation !== 'calibrated' && o.rotation !== 'hadamard' && o.rotation !== 'none')
    fail('rotation', o.rotation, "use 'hadamard', 'none' or 'calibrated'");
  if (o.calibrate !== undefined && o.calibrate !== 'background' && o.calibrate !== 'off')
    fail('calibrate', o.calibrate, "use 'background' or 'off'");
  optionalNumber(
    'calibrationTokens',
    o.calibrationTokens,
    (n) => n >= 16 && n <= 4096,
    'use an integer in 16..4096',
    true,
  );
  if (o.onProgress !== undefined && typeof o.onProgress !== 'function')
    fail('onProgress', o.onProgress, 'use a function');
  return o as EngineLoadOptions;
}

/** Conversation ids and other short strings passed alone. */
export function validateId(field: string, value: unknown): string {
  const id = optionalString(field, value, MAX_ID_CHARS);
  if (!id) fail(field, value, 'use a non-empty string');
  return id;
}
