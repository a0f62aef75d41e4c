/**
 * Conversations as files: every conversation as one versioned JSON file (export, and import back), one conversation
 * as Markdown (to read or share). An imported file is checked here, once, field by field, and becomes plain
 * `Conversation` records; nothing past this boundary sees the file's own objects.
 */
import type { Conversation, ConversationMode, MessageStatus, StoredMessage } from './conversations.ts';

export const CONVERSATIONS_FORMAT = 'longtab-conversations';
export const CONVERSATIONS_VERSION = 1;

export interface ConversationsFile {
  format: typeof CONVERSATIONS_FORMAT;
  version: typeof CONVERSATIONS_VERSION;
  conversations: Conversation[];
}

/** An import that cannot be read; the message names the field that is wrong and what it should be. */
export class InvalidConversationsFileError extends Error {
  readonly code = 'invalid-conversations-file';
  constructor(
    message: string,
    /** Where in the file, e.g. `conversations[2].messages[0].role` (empty for the file as a whole). */
    readonly field: string,
  ) {
    super(message);
    this.name = 'InvalidConversationsFileError';
  }
}

const MESSAGE_STATUSES: readonly MessageStatus[] = ['done', 'streaming', 'stopped', 'error', 'interrupted'];
const CONVERSATION_MODES: readonly ConversationMode[] = ['chat', 'text'];

export function conversationsFileText(conversations: readonly Conversation[]): string {
  const file: ConversationsFile = {
    format: CONVERSATIONS_FORMAT,
    version: CONVERSATIONS_VERSION,
    conversations: [...conversations],
  };
  return `${JSON.stringify(file, null, 2)}\n`;
}

function describeValue(value: unknown): string {
  if (value === undefined) return 'it is missing';
  if (value === null) return 'it is null';
  if (Array.isArray(value)) return 'it is a list';
  if (typeof value === 'string')
    return `it is the text ${JSON.stringify(value.length > 40 ? `${value.slice(0, 39)}…` : value)}`;
  if (typeof value === 'object') return 'it is an object';
  return `it is ${typeof value} ${String(value)}`;
}

function fail(field: string, expected: string, value: unknown): never {
  throw new InvalidConversationsFileError(
    `This is not a conversations file longtab can import: ${field} should be ${expected}, but ${describeValue(value)}.`,
    field,
  );
}

function record(value: unknown, field: string): Record<string, unknown> {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) fail(field, 'an object', value);
  return value as Record<string, unknown>;
}

function text(value: unknown, field: string, nonEmpty = false): string {
  if (typeof value !== 'string' || (nonEmpty && value === ''))
    fail(field, nonEmpty ? 'a non-empty text' : 'a text', value);
  return value;
}

function time(value: unknown, field: string): number {
  if (typeof value !== 'number' || !Number.isFinite(value) || value < 0) fail(field, 'a time in milliseconds', value);
  return value;
}

function count(value: unknown, field: string): number {
  if (typeof value !== 'number' || !Number.isFinite(value) || value < 0) fail(field, 'a number, 0 or more', value);
  return value;
}

function message(value: unknown, field: string): StoredMessage {
  const m = record(value, field);
  const role = m.role;
  if (role !== 'user' && role !== 'assistant') fail(`${field}.role`, `"user" or "assistant"`, role);
  const status = m.status;
  if (!MESSAGE_STATUSES.includes(status as MessageStatus)) {
    fail(`${field}.status`, `one of ${MESSAGE_STATUSES.map((s) => `"${s}"`).join(', ')}`, status);
  }
  const parsed: StoredMessage = {
    id: text(m.id, `${field}.id`, true),
    role,
    content: text(m.content, `${field}.content`),
    createdAt: time(m.createdAt, `${field}.createdAt`),
    // A reply that was streaming when the file was written ended there.
    status: status === 'streaming' ? 'interrupted' : (status as MessageStatus),
  };
  if (m.note !== undefined) parsed.note = text(m.note, `${field}.note`);
  if (m.stats !== undefined) {
    const s = record(m.stats, `${field}.stats`);
    parsed.stats = {
      completionTokens: count(s.completionTokens, `${field}.stats.completionTokens`),
      decodeTokensPerSecond: count(s.decodeTokensPerSecond, `${field}.stats.decodeTokensPerSecond`),
      ttftMs: count(s.ttftMs, `${field}.stats.ttftMs`),
    };
  }
  return parsed;
}

function conversation(value: unknown, field: string): Conversation {
  const c = record(value, field);
  if (!Array.isArray(c.messages)) fail(`${field}.messages`, 'a list of messages', c.messages);
  if (c.mode !== undefined && !CONVERSATION_MODES.includes(c.mode as ConversationMode))
    fail(`${field}.mode`, `one of ${CONVERSATION_MODES.join(', ')}`, c.mode);
  return {
    id: text(c.id, `${field}.id`, true),
    title: text(c.title, `${field}.title`),
    ...(c.mode !== undefined ? { mode: c.mode as ConversationMode } : {}),
    systemPrompt: text(c.systemPrompt, `${field}.systemPrompt`),
    messages: c.messages.map((m, i) => message(m, `${field}.messages[${i}]`)),
    createdAt: time(c.createdAt, `${field}.createdAt`),
    updatedAt: time(c.updatedAt, `${field}.updatedAt`),
  };
}

/** The conversations of an exported file; throws InvalidConversationsFileError naming the first field that is wrong. */
export function parseConversationsFile(fileText: string): Conversation[] {
  let json: unknown;
  try {
    json = JSON.parse(fileText);
  } catch (error) {
    throw new InvalidConversationsFileError(
      `This file is not JSON (${error instanceof Error ? error.message : String(error)}); choose a file made by Export conversations.`,
      '',
    );
  }
  const file = record(json, 'the file');
  if (file.format !== CONVERSATIONS_FORMAT) fail('format', `"${CONVERSATIONS_FORMAT}"`, file.format);
  if (typeof file.version === 'number' && file.version > CONVERSATIONS_VERSION) {
    throw new InvalidConversationsFileError(
      `This file is version ${file.version} of the conversations format, from a newer longtab; this page reads version ${CONVERSATIONS_VERSION}. Update the page and import it again.`,
      'version',
    );
  }
  if (file.version !== CONVERSATIONS_VERSION) fail('version', String(CONVERSATIONS_VERSION), file.version);
  if (!Array.isArray(file.conversations)) fail('conversations', 'a list of conversations', file.conversations);
  return file.conversations.map((c, i) => conversation(c, `conversations[${i}]`));
}

/**
 * The imported conversations ready to store beside the existing ones: one whose id is taken (by a stored
 * conversation or an earlier one of the same file) gets a fresh id from `freshId`, so an import never overwrites.
 */
export function withUnusedIds(
  imported: readonly Conversation[],
  takenIds: Iterable<string>,
  freshId: () => string,
): Conversation[] {
  const taken = new Set(takenIds);
  return imported.map((c) => {
    let id = c.id;
    while (taken.has(id)) id = freshId();
    taken.add(id);
    return id === c.id ? c : { ...c, id };
  });
}

/** One conversation as Markdown: its title, the system prompt when it has one, then a section per message. */
export function conversationMarkdown(conversation: Conversation): string {
  const lines = [`# ${conversation.title}`, ''];
  if (conversation.systemPrompt.trim()) {
    lines.push('System prompt:', '', ...conversation.systemPrompt.split('\n').map((l) => `> ${l}`), '');
  }
  for (const m of conversation.messages) {
    lines.push(m.role === 'user' ? '## You' : '## Assistant', '', m.content);
    if (m.note) lines.push('', `_(${m.note})_`);
    lines.push('');
  }
  return `${lines.join('\n').trimEnd()}\n`;
}

/** A file name from a title: letters, digits and dashes, never empty. */
export function fileNameFrom(title: string, extension: string): string {
  const stem = title
    .toLowerCase()
    .normalize('NFKD')
    .replace(/\p{M}/gu, '')
    .replace(/[^\p{L}\p{N}]+/gu, '-')
    .replace(/^-+|-+$/g, '')
    .slice(0, 60)
    .replace(/-+$/, '');
  return `${stem || 'conversation'}.${extension}`;
}
