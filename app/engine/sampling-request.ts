/** The sampling fields of a chat request, from the settings (names as the engine's API spells them). */
import type { Settings } from '../storage/settings.ts';
import type { ChatRequest } from './types.ts';

export type SamplingFields = Pick<
  ChatRequest,
  'max_tokens' | 'temperature' | 'top_p' | 'top_k' | 'min_p' | 'repetition_penalty' | 'seed' | 'stop'
>;

/** A seed for one reply: the engine's own default is a fixed seed, which would make Regenerate repeat the reply. */
export function randomSeed(): number {
  return crypto.getRandomValues(new Uint32Array(1))[0]!;
}

export function samplingFields(settings: Settings, drawSeed: () => number = randomSeed): SamplingFields {
  return {
    max_tokens: settings.maxTokens,
    temperature: settings.temperature,
    top_p: settings.topP,
    top_k: settings.topK,
    min_p: settings.minP,
    repetition_penalty: settings.repetitionPenalty,
    seed: settings.seed ?? drawSeed(),
    ...(settings.stop.length > 0 ? { stop: settings.stop.slice() } : {}),
  };
}
