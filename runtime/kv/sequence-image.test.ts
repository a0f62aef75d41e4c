/**
 * A sequence saved to host memory and restored (KvPagePool.saveSequence / restoreSequence) holds what it held, bit
 * for bit: on the demo model, a prompt long enough to leave 2-bit pages behind its f16 window is saved, restored
 * beside the original, saved again (the same bytes and page kinds), and both copies decode the same greedy tokens.
 * A restore that does not fit takes nothing; an image of another pool is refused.
 */
import { describe, expect, it } from 'vitest';
import { ContextOverflowError, InvalidRequestError } from '../../core/errors.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { KV_PAGE_KIND } from './pool.ts';

const ctx = withTestGpu();
const DEMO = 'public/models/longtab-demo.gguf';
const TEXT =
  'It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. ';

describe('a KV sequence saved to host memory and restored', () => {
  it.each(['f16', 'int2'] as const)(
    'kv %s: same bytes, same page kinds, same greedy continuation',
    async (kv) => {
      const runner = new ModelRunner(ctx.gpu);
      const source = await sourceFromPath(DEMO);
      try {
        await runner.load(source, {
          kv,
          kvBudgetBytes: 16 << 20,
          sink: 16,
          window: 64,
          ...(kv === 'int2' ? { rotation: 'hadamard' as const } : {}),
        });
        const pool = runner.pool;
        const prompt = runner.tokenizer.encode(TEXT.repeat(12), { addSpecial: true });
        expect(prompt.length).toBeGreaterThan(300);
        const original = pool.createSequence();
        await runner.prefillSequence(original, prompt);
        const image = await pool.saveSequence(original);
        expect(image.length).toBe(prompt.length);
        const quantPages = image.kinds.filter((k) => k === KV_PAGE_KIND.quant).length;
        if (kv === 'int2') expect(quantPages).toBeGreaterThan(2);
        else expect(quantPages).toBe(0);

        const before = pool.stats();
        const restored = pool.restoreSequence(image);
        expect(pool.audit()).toEqual([]);
        expect(restored.length).toBe(prompt.length);
        const again = await pool.saveSequence(restored);
        expect(again.kinds).toEqual(image.kinds);
        expect(Buffer.from(again.bytes).equals(Buffer.from(image.bytes))).toBe(true);
        // Through staging buffers smaller than a run of pages (runs split across several, odd sizes): the same bytes.
        const split = await pool.saveSequence(restored, { stagingBytes: 3 * pool.pageBytes + 4 * 37 });
        expect(Buffer.from(split.bytes).equals(Buffer.from(image.bytes))).toBe(true);
        expect(pool.stats().bytesUsed - before.bytesUsed).toBe(image.bytes.byteLength);

        const continuation = async (seq: typeof original) =>
          (
            await runner.generateInSequence(seq, {
              promptIds: [...prompt, ...runner.tokenizer.encode(' She said', { addSpecial: false })],
              reuseTokens: prompt.length,
              maxTokens: 24,
              sampling: { temperature: 0 },
              stopAtEog: false,
            })
          ).ids;
        const a = await continuation(original);
        const b = await continuation(restored);
        expect(b).toEqual(a);
        pool.free(original);
        pool.free(restored);
      } finally {
        runner.unload();
        await source.close?.();
      }
    },
    240_000,
  );

  it('a restore that does not fit takes nothing; an image of another pool is refused', async () => {
    const runner = new ModelRunner(ctx.gpu);
    const other = new ModelRunner(ctx.gpu);
    const source = await sourceFromPath(DEMO);
    try {
      // Room for about two copies of the prompt's pages.
      await runner.load(source, { kv: 'f16', kvBudgetBytes: 2 << 20 });
      await other.load(source, { kv: 'f16', kvBudgetBytes: 2 << 20 });
      const pool = runner.pool;
      const prompt = runner.tokenizer.encode(TEXT.repeat(4), { addSpecial: true });
      const seq = pool.createSequence();
      await runner.prefillSequence(seq, prompt);
      const image = await pool.saveSequence(seq);
      expect(() => other.pool.restoreSequence(image)).toThrow(InvalidRequestError);
      const held: (typeof seq)[] = [];
      let refusal: unknown = null;
      try {
        for (let i = 0; i < 64; i++) held.push(pool.restoreSequence(image));
      } catch (error) {
        refusal = error;
      }
      expect(refusal).toBeInstanceOf(ContextOverflowError);
      expect(held.length).toBeGreaterThan(0);
      const stats = pool.stats();
      expect(() => pool.restoreSequence(image)).toThrow(ContextOverflowError);
      expect(pool.stats()).toEqual(stats);
      expect(pool.audit()).toEqual([]);
    } finally {
      runner.unload();
      other.unload();
      await source.close?.();
    }
  }, 240_000);
});
