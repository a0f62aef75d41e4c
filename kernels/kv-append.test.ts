import { describe, expect, it } from 'vitest';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readUint32 } from '../core/gpu/readback.ts';
import { decodePageEntry, KvPagePool } from '../runtime/kv/pool.ts';
import { withTestGpu } from '../test/gpu.ts';
import { randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { prepareKvAppend } from './kv-append.ts';
import { f16Bits } from './reference/attention.ts';

const ctx = withTestGpu();

/**
 * Appends random K/V rows in steps of `chunks` tokens to two layers and returns how many packed f16 words in the
 * pages differ from the CPU packing (page layout from runtime/kv/pool.ts).
 */
async function mismatchedWords(gpu: GpuContext, chunks: number[]): Promise<number> {
  const before = gpu.allocator.snapshot().totalBuffers;
  const layers = 2;
  const kvHeads = 3;
  const headDim = 8;
  const pageTokens = 4;
  const pageBytes = layers * 2 * kvHeads * pageTokens * headDim * 2;
  const pool = new KvPagePool(gpu, {
    layers,
    kvHeads,
    headDim,
    pageTokens,
    budgetBytes: 32 * pageBytes,
    maxSlabBytes: 3 * pageBytes,
  });
  const maxTokens = Math.max(...chunks);
  const row = kvHeads * headDim;
  const inputs = [] as GPUBuffer[];
  const dispatches = [];
  for (let layer = 0; layer < layers; layer++) {
    const k = gpu.allocator.createStorage(`k${layer}`, 'scratch', maxTokens * row * 4);
    const v = gpu.allocator.createStorage(`v${layer}`, 'scratch', maxTokens * row * 4);
    inputs.push(k, v);
    dispatches.push(prepareKvAppend(gpu, `append${layer}`, { pool, layer, k, v, tokens: maxTokens }));
  }
  const random = seededRandom(chunks.length);
  const seq = pool.createSequence();
  const history: number[][] = [[], [], [], []]; // k0, v0, k1, v1
  for (const n of chunks) {
    pool.writeStep(seq, seq.length, n);
    pool.submitPending(); // page copies and promotions the step asked for
    for (let i = 0; i < inputs.length; i++) {
      const data = randomFloats(random, n * row, 4);
      gpu.device.queue.writeBuffer(inputs[i], 0, data.buffer as ArrayBuffer, data.byteOffset, data.byteLength);
      history[i].push(...data);
    }
    submitDispatches(gpu, 'kv-append-test', dispatches);
  }
  expect(pool.stats().slabs).toBeGreaterThan(1);
  const slabs = pool.slabBindings();
  const slabWords = await Promise.all(slabs.slice(0, pool.stats().slabs).map((s) => readUint32(gpu, s, s.size / 4)));
  let mismatches = 0;
  for (let pos = 0; pos < seq.length; pos++) {
    const { slab, page } = decodePageEntry(seq.pages[Math.floor(pos / pageTokens)]);
    for (let layer = 0; layer < layers; layer++) {
      for (const kv of [0, 1] as const) {
        const src = history[layer * 2 + kv];
        for (let h = 0; h < kvHeads; h++) {
          for (let w = 0; w < headDim / 2; w++) {
            const word =
              page * pool.pageWords +
              pool.layerOffsetWords(layer, kv) +
              (h * pageTokens + (pos % pageTokens)) * (headDim / 2) +
              w;
            const x = pos * row + h * headDim + 2 * w;
            const expected = (f16Bits(src[x]) | (f16Bits(src[x + 1]) << 16)) >>> 0;
            if (slabWords[slab][word] !== expected) mismatches++;
          }
        }
      }
    }
  }
  releaseDispatches(gpu, dispatches);
  for (const b of inputs) gpu.allocator.release(b);
  pool.destroy();
  expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
  return mismatches;
}

describe('kv-append kernel', () => {
  it('packs K and V bit-exactly into their pages across page and slab boundaries', async () => {
    expect(await mismatchedWords(ctx.gpu, [7, 1, 1, 6, 1, 3, 1])).toBe(0);
  });

  it('catches a broken kernel: K and V swapped', async () => {
    const broken = mutateShaders(ctx.gpu, {
      label: 'kv-append',
      edit: (code) => code.replace('params.kOffset + within', 'params.vOffset + within'),
    });
    expect(await mismatchedWords(broken.gpu, [7, 6])).toBeGreaterThan(0);
    expect(broken.mutated).toEqual(['kv-append']);
  });
});
