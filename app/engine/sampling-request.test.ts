import { describe, expect, it } from 'vitest';
import { MAX_STOP_CHARS, MAX_STOP_STRINGS, validateChatRequest } from '../../runtime/engine/validate.ts';
import { DEFAULT_SETTINGS, type Settings } from '../storage/settings.ts';
import { samplingFields } from './sampling-request.ts';

describe('samplingFields', () => {
  it('sends every sampling setting under the engine API names', () => {
    const settings = {
      ...DEFAULT_SETTINGS,
      temperature: 1.2,
      topP: 0.95,
      topK: 40,
      minP: 0.05,
      repetitionPenalty: 1.1,
      seed: 42,
      stop: ['\n\n', 'The end'],
      maxTokens: 64,
    };
    expect(samplingFields(settings)).toEqual({
      max_tokens: 64,
      temperature: 1.2,
      top_p: 0.95,
      top_k: 40,
      min_p: 0.05,
      repetition_penalty: 1.1,
      seed: 42,
      stop: ['\n\n', 'The end'],
    });
  });

  it('draws a seed for each reply when none is set, and leaves out an empty stop list', () => {
    let next = 100;
    const draw = () => next++;
    const first = samplingFields(DEFAULT_SETTINGS, draw);
    const second = samplingFields(DEFAULT_SETTINGS, draw);
    expect([first.seed, second.seed]).toEqual([100, 101]);
    expect('stop' in first).toBe(false);
  });

  it("requests from settings at the edges of the page's rules pass the engine's own validation", () => {
    const messages = [{ role: 'user' as const, content: 'Hi' }];
    const edges: Partial<Settings>[] = [
      DEFAULT_SETTINGS,
      { temperature: 0, topP: 1, topK: 0, minP: 0, repetitionPenalty: 1, seed: null },
      { temperature: 2, topP: 1e-9, topK: 0xffffffff, minP: 1, repetitionPenalty: 1e-9, seed: Number.MAX_SAFE_INTEGER },
      {
        seed: -Number.MAX_SAFE_INTEGER,
        stop: Array.from({ length: MAX_STOP_STRINGS }, () => 'x'.repeat(MAX_STOP_CHARS)),
      },
      { maxTokens: 1 },
      { maxTokens: 8192 },
    ];
    for (const edge of edges) {
      const request = { messages, ...samplingFields({ ...DEFAULT_SETTINGS, ...edge }) };
      expect(() => validateChatRequest(request), JSON.stringify(edge)).not.toThrow();
    }
  });
});
