import { describe, expect, it } from 'vitest';
import { type Conversation, passageText, type StoredMessage, titleFrom, withEditedMessage } from './conversations.ts';

function message(id: string, role: StoredMessage['role'], content: string): StoredMessage {
  return { id, role, content, createdAt: 1, status: 'done' };
}

const conversation: Conversation = {
  id: 'c1',
  title: titleFrom('Once upon a time'),
  systemPrompt: 'Be kind.',
  messages: [
    message('u1', 'user', 'Once upon a time'),
    message('a1', 'assistant', 'there was a girl'),
    message('u2', 'user', 'The dog'),
    message('a2', 'assistant', 'ran away'),
  ],
  createdAt: 1,
  updatedAt: 1,
};

describe('withEditedMessage', () => {
  it('replaces the user message and drops every message after it; the title made from it follows', () => {
    const edited = withEditedMessage(conversation, 'u1', 'The cat sat');
    expect(edited?.messages).toEqual([{ ...conversation.messages[0], content: 'The cat sat' }]);
    expect(edited?.title).toBe('The cat sat');
    expect(edited?.systemPrompt).toBe('Be kind.');
    expect(edited?.id).toBe('c1');
    expect(conversation.messages).toHaveLength(4);
  });

  it('keeps the turns before a later message, and a title the person chose', () => {
    const renamed = { ...conversation, title: 'Stories' };
    const edited = withEditedMessage(renamed, 'u2', 'The bird');
    expect(edited?.messages.map((m) => m.content)).toEqual(['Once upon a time', 'there was a girl', 'The bird']);
    expect(edited?.title).toBe('Stories');
    expect(withEditedMessage(conversation, 'u2', 'The bird')?.title).toBe(conversation.title);
  });

  it('refuses a reply or an id the conversation does not have', () => {
    expect(withEditedMessage(conversation, 'a1', 'x')).toBeNull();
    expect(withEditedMessage(conversation, 'missing', 'x')).toBeNull();
  });
});

describe('passageText', () => {
  it('joins a text-mode conversation into the passage the model continues, leaving out failed and empty replies', () => {
    const failed: StoredMessage = { ...message('a0', 'assistant', 'lost'), status: 'error' };
    expect(
      passageText([
        message('u1', 'user', 'It is a truth universally acknowledged'),
        message('a1', 'assistant', ', that a single man'),
        message('u2', 'user', 'must be'),
        failed,
        message('a2', 'assistant', ''),
        message('u3', 'user', '\nChapter 2'),
      ]),
    ).toBe('It is a truth universally acknowledged, that a single man must be\nChapter 2');
    expect(passageText([])).toBe('');
  });
});
