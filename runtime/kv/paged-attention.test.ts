import { describe, expect, it } from 'vitest';
import { releaseDispatches, submitDispatches } from '../../core/gpu/dispatch.ts';
import { readFloat32 } from '../../core/gpu/readback.ts';
import { attentionReference } from '../../kernels/reference/attention.ts';
import { withLimits, withTestGpu } from '../../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../../test/random.ts';
import { PagedKvAttention, prefillSplitsFor, splitsWithinBinding } from './paged-attention.ts';
import { KvPagePool } from './pool.ts';

const ctx = withTestGpu();

// One prefill split's partials here: 6 tokens × 8 heads × (8 + 2) floats = 1920 bytes.
const SPLIT_BYTES = 1920;

describe('PagedKvAttention', () => {
  it("fits a graph's splits to the storage binding, counting the records of its largest step", () => {
    const graph = { maxTokens: 1024, heads: 32, headDim: 128 };
    const oneSplitBytes = 1024 * 32 * 130 * 4; // a record of every token and head
    // Int8 graphs: a 1024-token step takes one split, a 73-token one all 8 (fewer records): one split's worth holds 8.
    expect(splitsWithinBinding(prefillSplitsFor(true), graph, oneSplitBytes)).toBe(8);
    expect(splitsWithinBinding(prefillSplitsFor(true), graph, oneSplitBytes - 1)).toBe(1);
    // Every step takes all of its splits: the binding holds 3 of 16.
    expect(splitsWithinBinding(prefillSplitsFor(false), graph, 3 * oneSplitBytes + 100)).toBe(3);
  });

  it.each([
    ['all 16 prefill splits', undefined, 2, 16],
    // A device whose storage bindings hold only 3 splits' partials: 3 splits, still merged.
    ['3 prefill splits (binding limit)', 3 * SPLIT_BYTES + 100, 2, 3],
    // Not even 2: one split, no partials, no merge pass.
    ['1 prefill split (binding limit)', SPLIT_BYTES + 100, 1, 1],
  ] as const)(
    'runs a prefill graph then a decode graph over the same pages (stories260K shape, %s)',
    async (_, bindingLimit, prefillAttentionDispatches, prefillSplits) => {
      const { gpu } = ctx;
      const before = gpu.allocator.snapshot().totalBuffers;
      const [heads, kvHeads, headDim, maxTokens] = [8, 4, 8, 6];
      const pool = new KvPagePool(gpu, { layers: 5, kvHeads, headDim, budgetBytes: 1 << 20 });
      const limited = bindingLimit === undefined ? gpu : withLimits(gpu, { maxStorageBufferBindingSize: bindingLimit });
      const backend = new PagedKvAttention(limited, pool, { heads });
      const f32 = (n: number) => gpu.allocator.createStorage('test', 'scratch', n * 4);
      const bufs = {
        q: f32(maxTokens * heads * headDim),
        k: f32(maxTokens * kvHeads * headDim),
        v: f32(maxTokens * kvHeads * headDim),
        output: f32(maxTokens * heads * headDim),
      };
      const graphs = [maxTokens, 1].map((t) => {
        const { append, attention } = backend.prepareLayer(3, bufs, t);
        if (t > 1) {
          expect(attention.length).toBe(prefillAttentionDispatches);
          const partials = attention.flatMap((d) => d.owned).filter((b) => b.label.endsWith('.partials'));
          expect(partials.map((b) => b.size)).toEqual(prefillSplits === 1 ? [] : [prefillSplits * SPLIT_BYTES]);
        }
        return [...append, ...attention];
      });
      const random = seededRandom(260);
      const seq = pool.createSequence();
      const ks: number[] = [];
      const vs: number[] = [];
      let worst = 0;
      for (const tokens of [6, 5, 1, 1]) {
        const position = pool.beginStep(seq, tokens);
        pool.submitPending(); // page copies and promotions the step asked for
        const q = randomFloats(random, tokens * heads * headDim, 2);
        const k = randomFloats(random, tokens * kvHeads * headDim, 2);
        const v = randomFloats(random, tokens * kvHeads * headDim, 1);
        ks.push(...k);
        vs.push(...v);
        for (const [buffer, data] of [
          [bufs.q, q],
          [bufs.k, k],
          [bufs.v, v],
        ] as const)
          gpu.device.queue.writeBuffer(buffer, 0, data.buffer as ArrayBuffer, 0, data.byteLength);
        submitDispatches(gpu, 'step', tokens === 1 ? graphs[1] : graphs[0]);
        const actual = await readFloat32(gpu, bufs.output, tokens * heads * headDim);
        const expected = attentionReference({
          q,
          k: Float32Array.from(ks),
          v: Float32Array.from(vs),
          position,
          tokens,
          heads,
          kvHeads,
          headDim,
          scale: 1 / Math.sqrt(headDim),
        });
        worst = Math.max(worst, maxToleranceRatio(actual, expected, 2e-5, 2e-4));
      }
      expect(seq.length).toBe(13);
      releaseDispatches(gpu, graphs.flat());
      for (const b of Object.values(bufs)) gpu.allocator.release(b);
      pool.destroy();
      expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
      expect(worst).toBeLessThanOrEqual(1);
    },
  );
});
