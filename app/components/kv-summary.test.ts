/** The stats panel's KV sentences from EngineStats as the engine fills them (no GPU, no DOM). */
import { describe, expect, it } from 'vitest';
import type { EngineStats } from '../engine/types.ts';
import { formatBytes } from '../storage/models.ts';
import { formatTokens, kvHoldsText, kvHostText, kvPlanText, kvReuseText, kvStoredText } from './kv-summary.ts';

/** The fields the sentences read; the rest of EngineStats does not matter to them. */
function stats(kv: Partial<EngineStats['kv']>, contextLength = 1 << 20): EngineStats {
  return {
    model: { contextLength } as EngineStats['model'],
    kv: { mode: 'int2', plan: null, holds: { tokens: 0, f16Tokens: 0 }, ...kv },
  } as EngineStats;
}

describe('the stats panel KV sentences', () => {
  it('counts tokens in K of 1024, as context lengths are named', () => {
    expect([0, 512, 1023, 1024, 1536, 2048, 10240, 32768, 235520].map(formatTokens)).toEqual([
      '0',
      '512',
      '1023',
      '1K',
      '1.5K',
      '2K',
      '10K',
      '32K',
      '230K',
    ]);
  });

  it('says what the budget holds in int2 and what f16 would hold in it', () => {
    expect(kvHoldsText(stats({ holds: { tokens: 235520, f16Tokens: 32768 } }))).toBe(
      'int2: 230K tokens in this budget; f16 would hold 32K',
    );
  });

  it('in f16 says only the f16 number, and names the context length where it, not the budget, is the cap', () => {
    expect(kvHoldsText(stats({ mode: 'f16', holds: { tokens: 32768, f16Tokens: 32768 } }))).toBe(
      'f16: 32K tokens in this budget',
    );
    expect(kvHoldsText(stats({ holds: { tokens: 2048, f16Tokens: 2048 } }, 2048))).toBe(
      "int2: 2K tokens in this budget; f16 would hold 2K (capped at the model's context length, 2K)",
    );
    // Only int2 reaches the context length: the note follows its number, not f16's.
    expect(kvHoldsText(stats({ holds: { tokens: 2048, f16Tokens: 1024 } }, 2048))).toBe(
      "int2: 2K tokens in this budget (capped at the model's context length, 2K); f16 would hold 1K",
    );
    expect(kvHoldsText(stats({ mode: 'f16', holds: { tokens: 2048, f16Tokens: 2048 } }, 2048))).toBe(
      "f16: 2K tokens in this budget (capped at the model's context length, 2K)",
    );
    expect(kvHoldsText(null)).toBeNull();
    expect(kvHoldsText({ ...stats({}), model: null })).toBeNull();
  });

  it('names the plan, where it came from, and its bits per element; nothing in f16', () => {
    const layer = { key: { bits: 2, clipQuantile: 0.96 }, value: { bits: 2, clipQuantile: 1 } };
    const plan = {
      summary: 'K 2-bit clip 0.96, V 2-bit; layer 5: K 4-bit, V 2-bit',
      source: 'calibration' as const,
      layers: [layer],
      bitsPerElementAt32K: 2.4127,
    };
    expect(kvPlanText(stats({ plan }))).toBe(
      'Plan, chosen by the calibration: K 2-bit clip 0.96, V 2-bit; layer 5: K 4-bit, V 2-bit; 2.41 bits per element at 32K tokens.',
    );
    expect(kvPlanText(stats({ plan: { ...plan, source: 'uniform', summary: 'K 2-bit, V 2-bit' } }))).toBe(
      'Plan, one format for every layer: K 2-bit, V 2-bit; 2.41 bits per element at 32K tokens.',
    );
    expect(kvPlanText(stats({ mode: 'f16', plan: null }))).toBeNull();
  });
});

describe('the stats panel host memory line', () => {
  const withHost = (host: EngineStats['host'] | undefined) => ({ host }) as EngineStats;
  it('says how many evicted conversations wait in host memory and how much of its budget they take', () => {
    const host = { conversations: 2, bytes: 3 * 2 ** 20, budgetBytes: 64 * 2 ** 20, saves: 3, restores: 1 };
    expect(kvHostText(withHost(host))).toBe(
      `2 conversations, ${formatBytes(3 * 2 ** 20)} of ${formatBytes(64 * 2 ** 20)}`,
    );
    expect(kvHostText(withHost({ ...host, conversations: 1 }))).toMatch(/^1 conversation, /);
    expect(kvHostText(withHost({ ...host, conversations: 0, bytes: 0 }))).toBe(`none of ${formatBytes(64 * 2 ** 20)}`);
    expect(kvHostText(withHost({ ...host, conversations: 0, bytes: 0, budgetBytes: 0 }))).toBeNull();
    expect(kvHostText(null)).toBeNull();
  });
});

describe('the stats panel KV store line', () => {
  const withStored = (stored: EngineStats['stored'] | undefined) => ({ stored }) as EngineStats;
  it("says how many of this model's conversations have their KV in the store and its bytes; off without a store", () => {
    const stored = { conversations: 2, bytes: 1982464, saves: 3, restores: 1, refused: 0, note: null };
    expect(kvStoredText(withStored(stored))).toBe(`2 conversations, ${formatBytes(1982464)}`);
    expect(kvStoredText(withStored({ ...stored, conversations: 1 }))).toBe(`1 conversation, ${formatBytes(1982464)}`);
    expect(kvStoredText(withStored({ ...stored, conversations: 0, bytes: 0 }))).toBe('none');
    expect(kvStoredText(withStored(null))).toBeNull();
    expect(kvStoredText(null)).toBeNull();
  });
});

describe('the stats panel last prompt line', () => {
  it('counts the prompt and its cached tokens, and names host memory or storage when they came from there', () => {
    expect(kvReuseText({ tokens: 1374, cached: 1353, from: 'storage' })).toBe(
      'Last prompt: 1374 tokens, 1353 from the KV cache (read back from storage)',
    );
    expect(kvReuseText({ tokens: 1374, cached: 1353, from: 'host' })).toBe(
      'Last prompt: 1374 tokens, 1353 from the KV cache (copied back from host memory)',
    );
    expect(kvReuseText({ tokens: 40, cached: 31, from: 'gpu' })).toBe('Last prompt: 40 tokens, 31 from the KV cache');
    // A shared system prompt is cached though the conversation itself had nothing: no place is named.
    expect(kvReuseText({ tokens: 40, cached: 12, from: 'none' })).toBe('Last prompt: 40 tokens, 12 from the KV cache');
    expect(kvReuseText({ tokens: 1, cached: 0, from: 'none' })).toBe('Last prompt: 1 token, none from the KV cache');
    expect(kvReuseText(null)).toBeNull();
  });
});
