/** Small KV pool shapes the pool's tests share (runtime/kv/pool.test.ts on the GPU, page-ledger.test.ts without). */
import type { KvPoolOptions } from '../runtime/kv/pool.ts';

/** layers 1, kvHeads 1, headDim 8, pageTokens 4: 128-byte f16 pages. */
export const SMALL_PAGE_BYTES = 1 * 2 * 1 * 4 * 8 * 2;

/** An f16 pool of `budgetPages` pages in slabs of `slabPages`. */
export function smallPoolOptions(budgetPages: number, slabPages = 5, maxSequences = 4): KvPoolOptions {
  return {
    layers: 1,
    kvHeads: 1,
    headDim: 8,
    pageTokens: 4,
    budgetBytes: budgetPages * SMALL_PAGE_BYTES,
    maxSlabBytes: slabPages * SMALL_PAGE_BYTES,
    maxSequences,
  };
}

/** quant: kvHeads 2 x headDim 8 = rows of 16 values, 2-bit, group 16: 4 + 1 words; pages of 4 tokens. */
const QUANT_PAGE_BYTES = 1 * 4 * (5 + 5) * 4;

/** A 2-bit pool of `f16Pages` f16 and `quantPages` quant pages, sink and window of one page each. */
export function quantPoolOptions(f16Pages: number, quantPages: number, maxStepTokens?: number): KvPoolOptions {
  const f16PageBytes = 1 * 2 * 2 * 4 * 8 * 2;
  return {
    layers: 1,
    kvHeads: 2,
    headDim: 8,
    pageTokens: 4,
    kv: 'quant',
    sink: 4,
    window: 4,
    keyFormat: { groupSize: 16 },
    valueFormat: { groupSize: 16 },
    f16BudgetBytes: f16Pages * f16PageBytes,
    budgetBytes: f16Pages * f16PageBytes + quantPages * QUANT_PAGE_BYTES,
    maxSlabBytes: 12 * f16PageBytes,
    maxSequences: 4,
    maxStepTokens,
  };
}
