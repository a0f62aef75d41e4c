/** What `stats().kv` says of the cache's plan and of the tokens its budget holds (runtime/engine/api.ts). */

import type { KvPagePool, KvPoolOptions } from '../kv/pool.ts';
import { describePlan, planEffectiveBits } from '../kv/precision-plan.ts';
import type { KvPlanStats } from './api-types.ts';

/** The plan of a quant pool's pages; null for an f16 pool. */
export function planStats(pool: KvPagePool, options: KvPoolOptions): KvPlanStats | null {
  const layout = pool.quant;
  if (!layout) return null;
  const share = { sink: pool.sinkPages * pool.pageTokens, window: pool.window, pageTokens: pool.pageTokens };
  return {
    summary: describePlan(layout.plan),
    source: options.plan ? 'calibration' : layout.boostLayers.length > 0 ? 'boostLayers' : 'uniform',
    layers: layout.plan.map((l) => ({ key: { ...l.key }, value: { ...l.value } })),
    bitsPerElementAt32K: planEffectiveBits(layout.plan, layout.key.groupSize, share, 32768),
  };
}

/** Positions one conversation could hold if the same budget held f16 pages (whole pages, the same length cap). */
export function f16TokensInBudget(pool: KvPagePool, options: KvPoolOptions, f16BytesPerToken: number): number {
  if (!pool.quant) return pool.maxPagesPerSequence * pool.pageTokens;
  const pages = Math.floor(options.budgetBytes / (f16BytesPerToken * pool.pageTokens));
  const cap = options.maxSequenceTokens ?? Number.POSITIVE_INFINITY;
  return Math.min(pages * pool.pageTokens, Math.ceil(cap / pool.pageTokens) * pool.pageTokens);
}
