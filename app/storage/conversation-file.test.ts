import { describe, expect, it } from 'vitest';
import {
  CONVERSATIONS_FORMAT,
  conversationMarkdown,
  conversationsFileText,
  fileNameFrom,
  InvalidConversationsFileError,
  parseConversationsFile,
  withUnusedIds,
} from './conversation-file.ts';
import type { Conversation } from './conversations.ts';

const stored: Conversation[] = [
  {
    id: 'c-1',
    title: 'The dragon',
    mode: 'text',
    systemPrompt: 'You tell short stories.\nKeep them kind.',
    messages: [
      { id: 'm-1', role: 'user', content: 'Tell me about a dragon', createdAt: 1000, status: 'done' },
      {
        id: 'm-2',
        role: 'assistant',
        content: 'Once upon a time there was a **dragon**.',
        createdAt: 1010,
        status: 'stopped',
        note: 'reached max tokens',
        stats: { completionTokens: 9, decodeTokensPerSecond: 41.5, ttftMs: 120 },
      },
    ],
    createdAt: 1000,
    updatedAt: 1010,
  },
  { id: 'c-2', title: 'New chat', systemPrompt: '', messages: [], createdAt: 2000, updatedAt: 2000 },
];

function rejection(text: string): InvalidConversationsFileError {
  try {
    parseConversationsFile(text);
  } catch (error) {
    if (error instanceof InvalidConversationsFileError) return error;
    throw error;
  }
  throw new Error('the file was accepted');
}

function fileWith(edit: (file: { conversations: Array<Record<string, unknown>> } & Record<string, unknown>) => void) {
  const file = JSON.parse(conversationsFileText(stored));
  edit(file);
  return JSON.stringify(file);
}

describe('conversations file', () => {
  it('round-trips every conversation and message field through export and import', () => {
    const text = conversationsFileText(stored);
    expect(JSON.parse(text)).toMatchObject({ format: CONVERSATIONS_FORMAT, version: 1 });
    expect(parseConversationsFile(text)).toEqual(stored);
  });

  it('drops fields it does not know and marks a reply that was streaming as interrupted', () => {
    const text = fileWith((file) => {
      file.conversations[0]!.extra = 'ignored';
      (file.conversations[0]!.messages as Array<Record<string, unknown>>)[1]!.status = 'streaming';
    });
    const [first] = parseConversationsFile(text);
    expect(first).not.toHaveProperty('extra');
    expect(first!.messages[1]!.status).toBe('interrupted');
  });

  it('names the wrong field and what it should be', () => {
    expect(rejection('{"format": "longtab-conversations", "version": 1').message).toMatch(/^This file is not JSON/);
    expect(rejection('[]').message).toBe(
      'This is not a conversations file longtab can import: the file should be an object, but it is a list.',
    );
    expect(rejection(fileWith((f) => (f.format = 'chatgpt'))).field).toBe('format');
    expect(rejection(fileWith((f) => (f.version = 2))).message).toContain('from a newer longtab');
    expect(rejection(fileWith((f) => (f.version = '1'))).field).toBe('version');
    expect(rejection(fileWith((f) => delete (f as Record<string, unknown>).conversations)).message).toBe(
      'This is not a conversations file longtab can import: conversations should be a list of conversations, but it is missing.',
    );
    const badRole = rejection(
      fileWith((f) => ((f.conversations[0]!.messages as Array<Record<string, unknown>>)[1]!.role = 'bot')),
    );
    expect(badRole.field).toBe('conversations[0].messages[1].role');
    expect(badRole.message).toBe(
      'This is not a conversations file longtab can import: conversations[0].messages[1].role should be "user" or "assistant", but it is the text "bot".',
    );
    expect(rejection(fileWith((f) => (f.conversations[1]!.id = ''))).field).toBe('conversations[1].id');
    expect(rejection(fileWith((f) => (f.conversations[0]!.mode = 'poem'))).message).toBe(
      'This is not a conversations file longtab can import: conversations[0].mode should be one of chat, text, but it is the text "poem".',
    );
    expect(rejection(fileWith((f) => (f.conversations[1]!.updatedAt = 'yesterday'))).field).toBe(
      'conversations[1].updatedAt',
    );
    expect(
      rejection(
        fileWith(
          (f) =>
            ((f.conversations[0]!.messages as Array<Record<string, unknown>>)[1]!.stats = { completionTokens: 'nine' }),
        ),
      ).field,
    ).toBe('conversations[0].messages[1].stats.completionTokens');
  });
});

describe('withUnusedIds', () => {
  it('keeps free ids and gives taken ones (also taken earlier in the same file) fresh ids', () => {
    let next = 0;
    const freshId = () => `fresh-${next++}`;
    const twice = [stored[0]!, stored[1]!, { ...stored[1]!, title: 'Second copy' }];
    const result = withUnusedIds(twice, ['c-1'], freshId);
    expect(result.map((c) => c.id)).toEqual(['fresh-0', 'c-2', 'fresh-1']);
    expect(result[0]).toEqual({ ...stored[0], id: 'fresh-0' });
    expect(result[1]).toBe(stored[1]);
  });

  it('skips a fresh id that is itself taken', () => {
    const ids = ['c-3', 'c-4'];
    expect(withUnusedIds([stored[1]!], ['c-2', 'c-3'], () => ids.shift()!).map((c) => c.id)).toEqual(['c-4']);
  });
});

describe('conversationMarkdown', () => {
  it('writes the title, the system prompt and a section per message', () => {
    expect(conversationMarkdown(stored[0]!)).toBe(
      [
        '# The dragon',
        '',
        'System prompt:',
        '',
        '> You tell short stories.',
        '> Keep them kind.',
        '',
        '## You',
        '',
        'Tell me about a dragon',
        '',
        '## Assistant',
        '',
        'Once upon a time there was a **dragon**.',
        '',
        '_(reached max tokens)_',
        '',
      ].join('\n'),
    );
    expect(conversationMarkdown(stored[1]!)).toBe('# New chat\n');
  });
});

describe('fileNameFrom', () => {
  it('keeps letters and digits, joins the rest with dashes, and is never empty', () => {
    expect(fileNameFrom('Once upon a time: the dragon!', 'md')).toBe('once-upon-a-time-the-dragon.md');
    expect(fileNameFrom('Über 2 Brücken', 'md')).toBe('uber-2-brucken.md');
    expect(fileNameFrom('…', 'md')).toBe('conversation.md');
  });
});
