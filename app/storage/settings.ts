/**
 * Chat settings, kept in IndexedDB beside the conversations, and the rules each one must meet. Values are checked
 * here, where they come in: what a person types (the Settings panel shows the rule it broke) and what is loaded
 * (a stored value that breaks its rule, from an older version or a hand edit, falls back to its default). The
 * sampling rules are the engine's (runtime/engine/validate.ts), so a request built from settings is never refused.
 */
import { createStore, get, set, type UseStore } from 'idb-keyval';
import { MAX_STOP_CHARS, MAX_STOP_STRINGS } from '../../workers/index.ts';
import type { KvMode } from '../engine/types.ts';

export const THEME_CHOICES = ['system', 'light', 'dark'] as const;
/** 'system' follows the browser's light or dark preference. */
export type ThemeChoice = (typeof THEME_CHOICES)[number];

export interface Settings {
  /** Id of the selected stored model (see models.ts), or null. */
  modelId: string | null;
  /** 'int2' (the default): the 2-bit cache where the model allows it, else f16 (see use-engine.ts); 'f16': exact. */
  kv: KvMode;
  kvBudgetMiB: number;
  temperature: number;
  topP: number;
  /** 0 = off. */
  topK: number;
  /** 0 = off. */
  minP: number;
  /** 1 = off. */
  repetitionPenalty: number;
  /** null: a new random seed for each reply (so Regenerate gives another one); a number makes replies repeatable. */
  seed: number | null;
  /** Generation ends before the first of these that appears (the engine takes up to MAX_STOP_STRINGS). */
  stop: string[];
  maxTokens: number;
  defaultSystemPrompt: string;
  /** Where presets download from: `<hubBaseUrl>/<repo>/resolve/main/<file>`. */
  hubBaseUrl: string;
  theme: ThemeChoice;
}

export const DEFAULT_SETTINGS: Settings = {
  modelId: null,
  kv: 'int2',
  kvBudgetMiB: 64,
  temperature: 0.7,
  topP: 0.9,
  topK: 0,
  minP: 0,
  repetitionPenalty: 1,
  seed: null,
  stop: [],
  maxTokens: 256,
  defaultSystemPrompt: 'You are a helpful assistant.',
  hubBaseUrl: 'https://huggingface.co',
  theme: 'system',
};

export type NumberSettingKey =
  | 'temperature'
  | 'topP'
  | 'topK'
  | 'minP'
  | 'repetitionPenalty'
  | 'maxTokens'
  | 'kvBudgetMiB';

export interface NumberRule {
  label: string;
  min: number;
  max: number;
  /** The value must be above `min`, not equal to it. */
  aboveMin?: boolean;
  integer?: boolean;
  /** What a valid value is, in words: the end of "Top-k must be …". */
  rule: string;
}

export const NUMBER_SETTINGS: Record<NumberSettingKey, NumberRule> = {
  temperature: { label: 'Temperature', min: 0, max: 2, rule: 'a number from 0 (greedy) to 2' },
  topP: { label: 'Top-p', min: 0, aboveMin: true, max: 1, rule: 'a number above 0, at most 1 (1 = off)' },
  topK: {
    label: 'Top-k',
    min: 0,
    max: 0xffffffff,
    integer: true,
    rule: 'a whole number, 0 or more (0 = off)',
  },
  minP: { label: 'Min-p', min: 0, max: 1, rule: 'a number from 0 (off) to 1' },
  repetitionPenalty: {
    label: 'Repetition penalty',
    min: 0,
    aboveMin: true,
    max: Number.MAX_VALUE,
    rule: 'a number above 0 (1 = off; above 1 makes repeats less likely)',
  },
  maxTokens: {
    label: 'Max new tokens',
    min: 1,
    max: 8192,
    integer: true,
    rule: 'a whole number from 1 to 8192',
  },
  kvBudgetMiB: {
    label: 'KV budget',
    min: 1,
    max: 8192,
    integer: true,
    rule: 'a whole number of MiB from 1 to 8192',
  },
};

/** A checked value, or what is wrong with it in words a person can act on. */
export type Checked<T> = { ok: true; value: T } | { ok: false; error: string };

function meetsRule(value: number, rule: NumberRule): boolean {
  return (
    Number.isFinite(value) &&
    (rule.aboveMin ? value > rule.min : value >= rule.min) &&
    value <= rule.max &&
    (!rule.integer || Number.isInteger(value))
  );
}

/** What was typed into a number setting's field. */
export function checkNumberSetting(key: NumberSettingKey, text: string): Checked<number> {
  const rule = NUMBER_SETTINGS[key];
  const trimmed = text.trim();
  const value = Number(trimmed);
  if (trimmed !== '' && meetsRule(value, rule)) return { ok: true, value };
  const typed = trimmed === '' ? 'it is empty' : `${trimmed} is not`;
  return { ok: false, error: `${rule.label} must be ${rule.rule}; ${typed}.` };
}

/** What was typed into the seed field: empty is a new random seed for each reply. */
export function checkSeed(text: string): Checked<number | null> {
  const trimmed = text.trim();
  if (trimmed === '') return { ok: true, value: null };
  const value = Number(trimmed);
  if (/^-?\d+$/.test(trimmed) && Number.isSafeInteger(value)) return { ok: true, value };
  return {
    ok: false,
    error: `Seed must be a whole number (up to ${Number.MAX_SAFE_INTEGER}), or empty for a random one; ${trimmed} is not.`,
  };
}

function checkStopList(stops: readonly string[]): string | null {
  if (stops.length > MAX_STOP_STRINGS) {
    return `Use at most ${MAX_STOP_STRINGS} stop sequences (one a line); there are ${stops.length}.`;
  }
  const long = stops.find((s) => s.length > MAX_STOP_CHARS);
  if (long !== undefined)
    return `A stop sequence may have at most ${MAX_STOP_CHARS} characters; one has ${long.length}.`;
  if (stops.some((s) => s.length === 0)) return 'A stop sequence cannot be empty.';
  return null;
}

/**
 * The stop sequences field: one a line, empty lines ignored; `\n` stands for a line break, `\t` for a tab and `\\`
 * for a backslash, so a sequence can hold what the field uses as separator.
 */
export function parseStopSequences(text: string): Checked<string[]> {
  const stops = text
    .split('\n')
    .filter((line) => line.length > 0)
    .map((line) => line.replace(/\\(\\|n|t)/g, (_, c: string) => (c === 'n' ? '\n' : c === 't' ? '\t' : '\\')));
  const error = checkStopList(stops);
  return error ? { ok: false, error } : { ok: true, value: stops };
}

/** The field's text for stored stop sequences (parseStopSequences reads it back to the same list). */
export function formatStopSequences(stops: readonly string[]): string {
  return stops.map((s) => s.replace(/\\/g, '\\\\').replace(/\n/g, '\\n').replace(/\t/g, '\\t')).join('\n');
}

type FieldCheck = (value: unknown) => boolean;

const isString: FieldCheck = (v) => typeof v === 'string';
const numberCheck =
  (key: NumberSettingKey): FieldCheck =>
  (v) =>
    typeof v === 'number' && meetsRule(v, NUMBER_SETTINGS[key]);

const STORED_CHECKS: Record<keyof Settings, FieldCheck> = {
  modelId: (v) => v === null || typeof v === 'string',
  kv: (v) => v === 'int2' || v === 'f16',
  kvBudgetMiB: numberCheck('kvBudgetMiB'),
  temperature: numberCheck('temperature'),
  topP: numberCheck('topP'),
  topK: numberCheck('topK'),
  minP: numberCheck('minP'),
  repetitionPenalty: numberCheck('repetitionPenalty'),
  seed: (v) => v === null || (typeof v === 'number' && Number.isSafeInteger(v)),
  stop: (v) => Array.isArray(v) && v.every(isString) && checkStopList(v) === null,
  maxTokens: numberCheck('maxTokens'),
  defaultSystemPrompt: isString,
  hubBaseUrl: isString,
  theme: (v) => THEME_CHOICES.includes(v as ThemeChoice),
};

/**
 * Stored settings over the defaults: each saved field that meets its rule is kept (kv: 'f16' included); a missing
 * one takes its default, and so does a broken one, which `reset` names. Unknown fields are dropped.
 */
export function settingsFromStored(saved: unknown): { settings: Settings; reset: string[] } {
  const settings: Settings = { ...DEFAULT_SETTINGS };
  const reset: string[] = [];
  if (saved === null || typeof saved !== 'object') return { settings, reset: saved === undefined ? [] : ['all'] };
  const record = saved as Record<string, unknown>;
  for (const key of Object.keys(STORED_CHECKS) as (keyof Settings)[]) {
    if (!(key in record)) continue;
    if (STORED_CHECKS[key](record[key])) (settings as unknown as Record<string, unknown>)[key] = record[key];
    else reset.push(key);
  }
  return { settings, reset };
}

let store: UseStore | null = null;
/** Opened on first use, so importing this module (the rules above, in unit tests) needs no IndexedDB. */
function settingsStore(): UseStore {
  store ??= createStore('longtab-settings', 'settings');
  return store;
}

/** The saved settings (see settingsFromStored); a saved value that breaks its rule is reset with a warning. */
export async function loadSettings(): Promise<Settings> {
  const { settings, reset } = settingsFromStored(await get('settings', settingsStore()));
  if (reset.length > 0) {
    console.warn(`longtab: saved settings out of range were reset to their defaults: ${reset.join(', ')}.`);
  }
  return settings;
}

export async function saveSettings(settings: Settings): Promise<void> {
  await set('settings', settings, settingsStore());
}
