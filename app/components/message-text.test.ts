import { describe, expect, it } from 'vitest';
import { copyableText } from './message-text.ts';

describe('copyableText', () => {
  it('drops the leading blank lines and trailing whitespace a reply often has, and nothing else', () => {
    expect(copyableText('\n\nOnce upon a time.\n')).toBe('Once upon a time.');
    expect(copyableText(' \t\r\n  indented first line\n\n  second\n  \n')).toBe('  indented first line\n\n  second');
    expect(copyableText('```\ncode\n```')).toBe('```\ncode\n```');
    expect(copyableText('\n \n')).toBe('');
  });
});
