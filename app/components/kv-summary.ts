/**
 * The stats panel's KV sentences: what the budget holds in each mode, the precision plan of the 2-bit pages, what
 * waits in host memory and in the KV store, and where the last prompt's cached tokens came from.
 */
import type { EngineStats, GenerationStats } from '../engine/types.ts';
import { formatBytes } from '../storage/models.ts';

/** 512, 1.5K, 230K: token counts in units of 1024, as context lengths are named. */
export function formatTokens(tokens: number): string {
  if (tokens < 1024) return String(tokens);
  const k = tokens / 1024;
  return `${k < 10 ? Math.round(k * 10) / 10 : Math.round(k)}K`;
}

/**
 * "int2: 230K tokens in this budget; f16 would hold 32K" (one conversation, stats().kv.holds). In f16 mode only the
 * f16 number: what int2 would hold depends on its page layout, which an f16 load never builds.
 */
export function kvHoldsText(stats: EngineStats | null): string | null {
  if (!stats?.model) return null;
  const { mode, holds } = stats.kv;
  const length = stats.model.contextLength;
  // Where the model's context length, not the budget, is the limit, the sentence says so, after the number it caps
  // (after both where it caps both).
  const capped = ` (capped at the model's context length, ${formatTokens(length)})`;
  const held = `${mode}: ${formatTokens(holds.tokens)} tokens in this budget`;
  if (mode === 'f16') return holds.tokens >= length ? held + capped : held;
  const f16 = `f16 would hold ${formatTokens(holds.f16Tokens)}`;
  if (holds.tokens < length) return `${held}; ${f16}`;
  return holds.f16Tokens >= length ? `${held}; ${f16}${capped}` : `${held}${capped}; ${f16}`;
}

const PLAN_SOURCES = {
  calibration: 'chosen by the calibration',
  uniform: 'one format for every layer',
  boostLayers: 'boosted layers from the load options',
} as const;

/** "Plan, chosen by the calibration: K 2-bit clip 0.96, V 2-bit; layer 5: …; 2.41 bits per element at 32K"; null in f16. */
export function kvPlanText(stats: EngineStats | null): string | null {
  const plan = stats?.kv.plan;
  if (!plan) return null;
  return `Plan, ${PLAN_SOURCES[plan.source]}: ${plan.summary}; ${plan.bitsPerElementAt32K.toFixed(2)} bits per element at 32K tokens.`;
}

/**
 * "2 conversations, 3.1 MB of 64 MB": evicted conversations whose pages wait in host memory (stats().host), to come
 * back without a re-prefill; "none of 64 MB" when none does, null when the host tier is off.
 */
export function kvHostText(stats: EngineStats | null): string | null {
  const host = stats?.host;
  if (!host || host.budgetBytes === 0) return null;
  const budget = `of ${formatBytes(host.budgetBytes)}`;
  if (host.conversations === 0) return `none ${budget}`;
  const count = `${host.conversations} conversation${host.conversations === 1 ? '' : 's'}`;
  return `${count}, ${formatBytes(host.bytes)} ${budget}`;
}

/**
 * "2 conversations, 3.1 MB": this model's conversations with a copy in the engine's KV store (stats().stored: OPFS
 * in the browser), which resume from it after a reload; "none" when none has one, null when the engine has no store.
 */
export function kvStoredText(stats: EngineStats | null): string | null {
  const stored = stats?.stored;
  if (!stored) return null;
  if (stored.conversations === 0) return 'none';
  const count = `${stored.conversations} conversation${stored.conversations === 1 ? '' : 's'}`;
  return `${count}, ${formatBytes(stored.bytes)}`;
}

/** A reply's prompt as its usage counted it: tokens, those reused from the KV cache, and where they were found. */
export interface PromptReuse {
  tokens: number;
  cached: number;
  from: GenerationStats['kv_from'];
}

const REUSED_FROM: Record<GenerationStats['kv_from'], string> = {
  gpu: '',
  host: ' (copied back from host memory)',
  storage: ' (read back from storage)',
  none: '',
};

/** "Last prompt: 1374 tokens, 1353 from the KV cache (read back from storage)"; null before the first reply. */
export function kvReuseText(prompt: PromptReuse | null): string | null {
  if (!prompt) return null;
  const head = `Last prompt: ${prompt.tokens} token${prompt.tokens === 1 ? '' : 's'}`;
  if (prompt.cached === 0) return `${head}, none from the KV cache`;
  return `${head}, ${prompt.cached} from the KV cache${REUSED_FROM[prompt.from]}`;
}
