/** The request validation at the API boundary, without a model: what it accepts, and the typed errors it gives. */
import { describe, expect, it } from 'vitest';
import { InvalidRequestError } from '../../core/errors.ts';
import { validateChatRequest, validateCompletionRequest } from './validate.ts';

const user = (content: unknown) => ({ messages: [{ role: 'user', content }] });

describe('chat request validation', () => {
  it("takes OpenAI's content parts: the text parts, joined by newlines", () => {
    const r = validateChatRequest(
      user([
        { type: 'text', text: 'First paragraph.' },
        { type: 'text', text: 'Second.' },
      ]),
    );
    expect(r.messages).toEqual([{ role: 'user', content: 'First paragraph.\nSecond.' }]);
    expect(validateChatRequest(user('plain')).messages[0].content).toBe('plain');
  });

  it('refuses parts it cannot read, by name, with a typed error', () => {
    const cases: Array<[unknown, RegExp]> = [
      [[{ type: 'image_url', image_url: { url: 'x' } }], /messages\[0\]\.content\[0\]\.type = "image_url".*text only/],
      [[{ type: 'text', text: 5 }], /content\[0\]\.text = 5 is invalid/],
      [[{ type: 'text', text: 'a', cache: true }], /unknown field 'cache'/],
      [[], /non-empty array/],
      [['bare string part'], /content\[0\]/],
      [{ text: 'an object' }, /use a string or a non-empty array/],
    ];
    for (const [content, message] of cases) {
      expect(() => validateChatRequest(user(content)), JSON.stringify(content)).toThrow(InvalidRequestError);
      expect(() => validateChatRequest(user(content)), JSON.stringify(content)).toThrow(message);
    }
  });

  it('max_tokens is at least 1, as in the OpenAI API', () => {
    expect(() => validateChatRequest({ ...user('x'), max_tokens: 0 })).toThrow(
      /max_tokens = 0 is invalid: use an integer in 1\.\./,
    );
    expect(() => validateCompletionRequest({ prompt: 'x', max_tokens: 0 })).toThrow(InvalidRequestError);
    expect(validateCompletionRequest({ prompt: 'x', max_tokens: 1 }).maxTokens).toBe(1);
  });

  it("special_tokens_in_content is 'text' by default, 'tokens' on request, and nothing else", () => {
    expect(validateChatRequest(user('x')).specialTokensInContent).toBe('text');
    expect(validateChatRequest({ ...user('x'), special_tokens_in_content: 'tokens' }).specialTokensInContent).toBe(
      'tokens',
    );
    expect(() => validateChatRequest({ ...user('x'), special_tokens_in_content: true })).toThrow(
      /special_tokens_in_content = true is invalid: use 'text'/,
    );
  });

  it('persist is true or false, and only in a conversation', () => {
    expect(validateChatRequest(user('x')).persist).toBeUndefined();
    expect(validateChatRequest({ ...user('x'), conversation_id: 'c', persist: true }).persist).toBe(true);
    expect(validateChatRequest({ ...user('x'), persist: false }).persist).toBe(false);
    expect(() => validateChatRequest({ ...user('x'), persist: true })).toThrow(/pass a conversation_id with it/);
    expect(() => validateChatRequest({ ...user('x'), conversation_id: 'c', persist: 1 })).toThrow(
      /persist = 1 is invalid: use true or false/,
    );
  });
});
