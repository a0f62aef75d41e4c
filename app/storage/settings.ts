/** Chat settings, kept in IndexedDB beside the conversations. */
import { createStore, get, set } from 'idb-keyval';
import type { KvMode } from '../engine/types.ts';

export interface Settings {
  /** Id of the selected stored model (see models.ts), or null. */
  modelId: string | null;
  /** 'int2' (the default): the 2-bit cache where the model allows it, else f16 (see use-engine.ts); 'f16': exact. */
  kv: KvMode;
  kvBudgetMiB: number;
  temperature: number;
  topP: number;
  maxTokens: number;
  defaultSystemPrompt: string;
  /** Where presets download from: `<hubBaseUrl>/<repo>/resolve/main/<file>`. */
  hubBaseUrl: string;
}

export const DEFAULT_SETTINGS: Settings = {
  modelId: null,
  kv: 'int2',
  kvBudgetMiB: 64,
  temperature: 0.7,
  topP: 0.9,
  maxTokens: 256,
  defaultSystemPrompt: 'You are a helpful assistant.',
  hubBaseUrl: 'https://huggingface.co',
};

const store = createStore('longtab-settings', 'settings');

/** The saved settings over the defaults: a saved field (kv: 'f16' included) keeps what was saved. */
export async function loadSettings(): Promise<Settings> {
  const saved = await get<Partial<Settings>>('settings', store);
  return { ...DEFAULT_SETTINGS, ...saved };
}

export async function saveSettings(settings: Settings): Promise<void> {
  await set('settings', settings, store);
}
