/** The roofline's bytes: what a decode step reads of a real pool, against the pool's own page accounting. */
import { describe, expect, it } from 'vitest';
import { KvPagePool } from '../runtime/kv/pool.ts';
import { withTestGpu } from '../test/gpu.ts';
import { kvBytesRead } from './attention-roofline.ts';

const ctx = withTestGpu();

// One layer of Llama-3.2-1B's cache: 8 KV heads × 64, rows of 512 values.
const LAYER = { layers: 1, kvHeads: 8, headDim: 64, pageTokens: 16, budgetBytes: 32 << 20, maxSequences: 1 } as const;

/** A sequence of `context` positions written in prefill chunks of 512, then the decode step at its last position. */
function filled(pool: KvPagePool, context: number) {
  const seq = pool.createSequence();
  while (seq.length < context) pool.writeStep(seq, seq.length, 512);
  pool.writeStep(seq, context - 1, 1);
  return seq;
}

describe('kvBytesRead', () => {
  it('an f16 pool: K and V of every position at 2 bytes a value', () => {
    const pool = new KvPagePool(ctx.gpu, { ...LAYER, kv: 'f16' });
    try {
      const read = kvBytesRead(pool, filled(pool, 2048), 2048);
      expect(read).toEqual({
        f16Positions: 2048,
        quantPositions: 0,
        f16BytesPerPosition: 2 * 512 * 2,
        quantBytesPerPosition: 0,
        bytes: 2048 * 2048,
      });
    } finally {
      pool.destroy();
    }
  });

  it('an int2 pool: the f16 sink and window, 2-bit rows with a (lo, scale) word per group of 128 for the rest', () => {
    const pool = new KvPagePool(ctx.gpu, { ...LAYER, kv: 'quant' });
    try {
      const read = kvBytesRead(pool, filled(pool, 2048), 2048);
      // A K or V row: 512 values × 2 bits = 128 bytes of codes, 4 groups × 4 bytes.
      expect(read.quantBytesPerPosition).toBe(2 * (128 + 16));
      expect(read.f16BytesPerPosition).toBe(2048);
      expect(read.f16Positions).toBeGreaterThanOrEqual(64 + 256);
      expect(read.f16Positions + read.quantPositions).toBe(2048);
      // The same bytes as the pages the pool counts as used (2048 positions fill their pages).
      const { f16, quant } = pool.stats();
      expect(read.bytes).toBe(f16.pagesUsed * f16.pageBytes + quant.pagesUsed * quant.pageBytes);
    } finally {
      pool.destroy();
    }
  });
});
