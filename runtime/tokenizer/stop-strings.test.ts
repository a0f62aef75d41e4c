import { describe, expect, it } from 'vitest';
import { StopStringMatcher } from './stop-strings.ts';

/** Feeds pieces and returns what was shown, and the stop string that ended it (if any). */
function run(stops: string[], pieces: string[]): { shown: string; stop?: string; outputs: string[] } {
  const matcher = new StopStringMatcher(stops);
  const outputs: string[] = [];
  let stop: string | undefined;
  for (const piece of pieces) {
    const result = matcher.push(piece);
    outputs.push(result.text);
    if (result.stop) {
      stop = result.stop;
      break;
    }
  }
  if (!stop) outputs.push(matcher.flush());
  return { shown: outputs.join(''), stop, outputs };
}

describe('StopStringMatcher', () => {
  it('stops when a stop string completes inside one piece and returns the text before it', () => {
    expect(run(['<|im_end|>'], ['Hello<|im_end|>ignored'])).toMatchObject({ shown: 'Hello', stop: '<|im_end|>' });
  });

  it('holds back a possible start across pieces and releases it when it is not a stop', () => {
    const stopped = run(['\nUser:'], ['Answer.', '\n', 'Us', 'er:', ' more']);
    expect(stopped.shown).toBe('Answer.');
    expect(stopped.stop).toBe('\nUser:');
    expect(stopped.outputs).toEqual(['Answer.', '', '', '']);

    const released = run(['\nUser:'], ['Answer.', '\n', 'Us', 'ually fine', '\n']);
    // The final newline could still start a stop string, so it waits for flush().
    expect(released.outputs).toEqual(['Answer.', '', '', '\nUsually fine', '', '\n']);
    expect(released.shown).toBe('Answer.\nUsually fine\n');
    expect(released.stop).toBeUndefined();
  });

  it('matches every split of the input into pieces the same way', () => {
    const text = 'abc <END and <EN more <END> tail';
    for (let size = 1; size <= 6; size++) {
      const pieces = text.match(new RegExp(`[\\s\\S]{1,${size}}`, 'g'))!;
      expect(run(['<END>'], pieces)).toMatchObject({ shown: 'abc <END and <EN more ', stop: '<END>' });
    }
  });

  it('picks the earliest of several stop strings', () => {
    expect(run(['STOP', 'END'], ['a END b STOP'])).toMatchObject({ shown: 'a ', stop: 'END' });
    expect(run(['xyz', 'yz!'], ['..x', 'yz!'])).toMatchObject({ shown: '..', stop: 'xyz' });
  });

  it('passes text through untouched when there are no stop strings', () => {
    expect(run([], ['a', 'b'])).toMatchObject({ shown: 'ab', outputs: ['a', 'b', ''] });
    expect(run([''], ['a'])).toMatchObject({ shown: 'a' });
  });

  it('emits nothing after a stop', () => {
    const matcher = new StopStringMatcher(['!']);
    expect(matcher.push('hi!there')).toEqual({ text: 'hi', stop: '!' });
    expect(matcher.isStopped).toBe(true);
    expect(matcher.push('more')).toEqual({ text: '' });
    expect(matcher.flush()).toBe('');
  });
});
