import { describe, expect, it } from 'vitest';
import { MAX_STOP_CHARS } from '../../runtime/engine/validate.ts';
import {
  checkNumberSetting,
  checkSeed,
  DEFAULT_SETTINGS,
  formatStopSequences,
  parseStopSequences,
  settingsFromStored,
} from './settings.ts';

describe('number settings', () => {
  it('accept values inside the engine rules, at their edges too', () => {
    expect(checkNumberSetting('topK', '0')).toEqual({ ok: true, value: 0 });
    expect(checkNumberSetting('topK', ' 40 ')).toEqual({ ok: true, value: 40 });
    expect(checkNumberSetting('minP', '1')).toEqual({ ok: true, value: 1 });
    expect(checkNumberSetting('topP', '1')).toEqual({ ok: true, value: 1 });
    expect(checkNumberSetting('repetitionPenalty', '1.1')).toEqual({ ok: true, value: 1.1 });
    expect(checkNumberSetting('temperature', '0')).toEqual({ ok: true, value: 0 });
  });

  it('refuse what the engine would refuse, naming the setting, its rule and what was typed', () => {
    expect(checkNumberSetting('topK', '-1')).toEqual({
      ok: false,
      error: 'Top-k must be a whole number, 0 or more (0 = off); -1 is not.',
    });
    expect(checkNumberSetting('topK', '2.5').ok).toBe(false);
    expect(checkNumberSetting('minP', '1.5')).toEqual({
      ok: false,
      error: 'Min-p must be a number from 0 (off) to 1; 1.5 is not.',
    });
    expect(checkNumberSetting('topP', '0').ok).toBe(false);
    expect(checkNumberSetting('repetitionPenalty', '0').ok).toBe(false);
    expect(checkNumberSetting('repetitionPenalty', 'Infinity').ok).toBe(false);
    expect(checkNumberSetting('temperature', 'warm')).toEqual({
      ok: false,
      error: 'Temperature must be a number from 0 (greedy) to 2; warm is not.',
    });
    expect(checkNumberSetting('maxTokens', '')).toEqual({
      ok: false,
      error: 'Max new tokens must be a whole number from 1 to 8192; it is empty.',
    });
  });
});

describe('seed', () => {
  it('is a safe integer, or empty for a random one per reply', () => {
    expect(checkSeed('')).toEqual({ ok: true, value: null });
    expect(checkSeed(' 42 ')).toEqual({ ok: true, value: 42 });
    expect(checkSeed('-7')).toEqual({ ok: true, value: -7 });
    for (const bad of ['1.5', '1e3', 'abc', '9007199254740993']) expect(checkSeed(bad).ok).toBe(false);
  });
});

describe('stop sequences', () => {
  it('are one a line, empty lines ignored, with \\n, \\t and \\\\ escapes', () => {
    expect(parseStopSequences('girl\n\n The end\n')).toEqual({ ok: true, value: ['girl', ' The end'] });
    expect(parseStopSequences('\\n\\nUser:\nA\\tB\nback\\\\slash\\n')).toEqual({
      ok: true,
      value: ['\n\nUser:', 'A\tB', 'back\\slash\n'],
    });
    expect(parseStopSequences('')).toEqual({ ok: true, value: [] });
  });

  it('round-trip through the field text', () => {
    const stops = ['\n', 'a\\nb\tc', '\\', ' spaced '];
    expect(parseStopSequences(formatStopSequences(stops))).toEqual({ ok: true, value: stops });
  });

  it('keep to the engine limits: four at most, each of at most 256 characters', () => {
    expect(parseStopSequences('a\nb\nc\nd\ne')).toEqual({
      ok: false,
      error: 'Use at most 4 stop sequences (one a line); there are 5.',
    });
    expect(parseStopSequences('x'.repeat(MAX_STOP_CHARS)).ok).toBe(true);
    expect(parseStopSequences('x'.repeat(MAX_STOP_CHARS + 1))).toEqual({
      ok: false,
      error: 'A stop sequence may have at most 256 characters; one has 257.',
    });
  });
});

describe('stored settings', () => {
  it('nothing stored gives the defaults; settings saved by an older version gain the new fields', () => {
    expect(settingsFromStored(undefined)).toEqual({ settings: DEFAULT_SETTINGS, reset: [] });
    const older = { modelId: 'm1', kv: 'f16', kvBudgetMiB: 128, temperature: 0.2, topP: 0.8, maxTokens: 32 };
    const { settings, reset } = settingsFromStored(older);
    expect(reset).toEqual([]);
    expect(settings).toEqual({ ...DEFAULT_SETTINGS, ...older });
  });

  it('keeps every valid field and resets each broken one to its default, naming it', () => {
    const saved = {
      ...DEFAULT_SETTINGS,
      topK: 40,
      seed: 7,
      stop: ['\n'],
      theme: 'dark',
      minP: 3,
      repetitionPenalty: -1,
      kv: 'int3',
      temperature: Number.NaN,
      unknownField: 1,
    };
    const { settings, reset } = settingsFromStored(saved);
    expect(reset.sort()).toEqual(['kv', 'minP', 'repetitionPenalty', 'temperature']);
    expect(settings).toEqual({ ...DEFAULT_SETTINGS, topK: 40, seed: 7, stop: ['\n'], theme: 'dark' });
  });

  it('resets broken stop lists and themes, and survives a stored value that is not an object', () => {
    const { settings, reset } = settingsFromStored({ stop: ['', 'a'], theme: 'sepia', seed: 1.5 });
    expect(reset.sort()).toEqual(['seed', 'stop', 'theme']);
    expect(settings).toEqual(DEFAULT_SETTINGS);
    expect(settingsFromStored('garbage')).toEqual({ settings: DEFAULT_SETTINGS, reset: ['all'] });
  });
});
