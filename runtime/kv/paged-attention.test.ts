import { describe, expect, it } from 'vitest';
import { InvalidRequestError } from '../../core/errors.ts';
import { releaseDispatches, submitDispatches, uniformBuffer } from '../../core/gpu/dispatch.ts';
import { readFloat32 } from '../../core/gpu/readback.ts';
import { prepareAttention } from '../../kernels/attention.ts';
import { attentionReference } from '../../kernels/reference/attention.ts';
import type { RopeStage } from '../../kernels/rope.ts';
import { withLimits, withTestGpu } from '../../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../../test/random.ts';
import { PagedKvAttention, prefillSplitsFor, splitsWithinBinding } from './paged-attention.ts';
import { KvPagePool } from './pool.ts';
import { covarianceRotation, multiply, rotationSet, transpose, transposedMatrices } from './rotation.ts';

const ctx = withTestGpu();

/**
 * Llama's RoPE (adjacent pairs, no frequency factors) for q and k of these heads, as the forward pass hands it to the
 * cache; its step uniform (position, tokens) is the test's to write, and both buffers to release.
 */
function llamaRope(heads: number, kvHeads: number, headDim: number): RopeStage {
  const { gpu } = ctx;
  return {
    freqFactors: gpu.allocator.createStorage('freq', 'weights', new Float32Array(headDim / 2).fill(1)),
    step: uniformBuffer(gpu, 'step', [0, 1, 0, 0], 'uuuu'),
    heads,
    kvHeads,
    headDim,
    ropeDim: headDim,
    base: 10000,
    layout: 'normal',
  };
}

// One prefill split's partials here: 6 tokens × 8 heads × (8 + 2) floats = 1920 bytes.
const SPLIT_BYTES = 1920;
// 21 prefill tokens × 8 heads × (64 + 2) floats: one prefill split's partials (44,352 bytes); a decode split's is 2,112.
const PREFILL_SPLIT_BYTES = 44352;

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
        const { append, attention } = backend.prepareLayer(3, bufs, t, null);
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

describe('PagedKvAttention on a shape its attention refuses', () => {
  it('throws and releases what the layer had prepared (its demotion and fused store, before the attention)', () => {
    const { gpu } = ctx;
    // Heads of 256 dims on a device reporting 8 KiB of workgroup memory: the fused store takes them, the attention's
    // tiles do not fit.
    const [heads, kvHeads, headDim] = [4, 2, 256];
    const small = withLimits(gpu, { maxComputeWorkgroupStorageSize: 8192 });
    const pool = new KvPagePool(gpu, { layers: 1, kvHeads, headDim, budgetBytes: 1 << 22, kv: 'quant' });
    const f32 = (n: number) => gpu.allocator.createStorage('test', 'scratch', n * 4);
    const bufs = {
      q: f32(heads * headDim),
      k: f32(kvHeads * headDim),
      v: f32(kvHeads * headDim),
      output: f32(heads * headDim),
    };
    const rope = llamaRope(heads, kvHeads, headDim);
    const before = gpu.allocator.snapshot();
    expect(() => new PagedKvAttention(small, pool, { heads }).prepareLayer(0, bufs, 1, rope)).toThrow(
      /workgroup storage, the device has 8192/,
    );
    expect(gpu.allocator.snapshot().totalBuffers).toBe(before.totalBuffers);
    for (const b of [...Object.values(bufs), rope.freqFactors, rope.step]) gpu.allocator.release(b);
    pool.destroy();
  });
});

describe('PagedKvAttention with rotations', () => {
  it.each([
    // Decode graphs un-rotate in their merge pass, prefill graphs in a rotate dispatch of their own: after the rows
    // merge, or
    ['prefill un-rotation after the rows merge', undefined, undefined],
    // with storage bindings that hold one prefill split's partials, in a prefill graph without a merge pass (decode
    // graphs, whose splits' partials are smaller, still merge).
    ['prefill un-rotation without a merge pass', PREFILL_SPLIT_BYTES + 100, undefined],
    // Decode steps finish q, k and v in one dispatch (rope-append) where the device binds its 11 storage buffers; on
    // an adapter with the WebGPU default of 8, in RoPE, rotate and kv-append dispatches.
    ['decode on the spec default of 8 storage buffers', undefined, 8],
  ] as const)(
    'gives the same attention output as the unrotated cache (Hadamard and calibrated rotations; %s)',
    async (_, bindingLimit, storageLimit) => {
      const { gpu } = ctx;
      const before = gpu.allocator.snapshot().totalBuffers;
      // Prefill steps of 21 and 19 tokens: the prefill build's blocks cut short.
      const [layers, heads, kvHeads, headDim, maxTokens] = [2, 8, 2, 64, 21];
      const random = seededRandom(42);
      // Layer 0: Hadamard; layer 1: a calibrated rotation per KV head, for K and for V (not symmetric, unlike the
      // Hadamard matrix: an un-rotation by R instead of Rᵀ, or by another head's matrix, cannot pass).
      const keyRotations = rotationSet('hadamard', layers, kvHeads, headDim);
      const valueRotations = rotationSet('hadamard', layers, kvHeads, headDim);
      const calibrated = () => {
        const a = Float64Array.from(randomFloats(random, headDim * headDim, 1));
        return covarianceRotation(multiply(transpose(a, headDim), a, headDim), headDim);
      };
      for (let h = 0; h < kvHeads; h++) {
        keyRotations.set(calibrated(), (kvHeads + h) * headDim * headDim);
        valueRotations.set(calibrated(), (kvHeads + h) * headDim * headDim);
      }
      const rotations = {
        key: gpu.allocator.createStorage('rk', 'kv', keyRotations),
        value: gpu.allocator.createStorage('rv', 'kv', valueRotations),
        valueTransposed: gpu.allocator.createStorage('rvt', 'kv', transposedMatrices(valueRotations, headDim)),
      };
      const f32 = (n: number) => gpu.allocator.createStorage('test', 'scratch', n * 4);
      // Both caches apply the same RoPE (Llama's layout) to q and k before they store k: the rotated one with its
      // rotation, in the same dispatch in decode steps.
      const rope = llamaRope(heads, kvHeads, headDim);
      const { step } = rope;
      const run = async (rotated: boolean) => {
        const pool = new KvPagePool(gpu, { layers, kvHeads, headDim, budgetBytes: 1 << 20 });
        const limits = {
          ...(rotated && bindingLimit !== undefined ? { maxStorageBufferBindingSize: bindingLimit } : {}),
          ...(storageLimit !== undefined ? { maxStorageBuffersPerShaderStage: storageLimit } : {}),
        };
        const backend = new PagedKvAttention(withLimits(gpu, limits), pool, {
          heads,
          rotations: rotated ? rotations : undefined,
        });
        const bufs = {
          q: f32(maxTokens * heads * headDim),
          k: f32(maxTokens * kvHeads * headDim),
          v: f32(maxTokens * kvHeads * headDim),
          output: f32(maxTokens * heads * headDim),
        };
        const data = seededRandom(7);
        const seq = pool.createSequence();
        const outputs: Float32Array[] = [];
        let lastKeys: Float32Array = new Float32Array();
        const graphs = new Map<number, ReturnType<typeof backend.prepareLayer>[]>();
        for (const tokens of [21, 19, 1, 1]) {
          if (!graphs.has(tokens)) {
            const layers = [0, 1].map((l) => backend.prepareLayer(l, bufs, tokens, rope));
            const ownDispatch = layers.map((g) => g.attention.some((d) => d.label.endsWith('.unrotate_out')));
            expect(ownDispatch).toEqual(layers.map(() => rotated && tokens > 1));
            const fused = layers.map((g) => g.append.some((d) => d.label.endsWith('.rope_append')));
            expect(fused).toEqual(layers.map(() => tokens === 1 && storageLimit === undefined));
            graphs.set(tokens, layers);
          }
          gpu.device.queue.writeBuffer(step, 0, Uint32Array.of(seq.length, tokens, 0, 0));
          pool.beginStep(seq, tokens);
          pool.submitPending(); // page copies and promotions the step asked for
          for (const layer of [0, 1]) {
            gpu.device.queue.writeBuffer(bufs.q, 0, randomFloats(data, tokens * heads * headDim, 2));
            gpu.device.queue.writeBuffer(bufs.k, 0, randomFloats(data, tokens * kvHeads * headDim, 2));
            gpu.device.queue.writeBuffer(bufs.v, 0, randomFloats(data, tokens * kvHeads * headDim, 1));
            const g = graphs.get(tokens)![layer];
            submitDispatches(gpu, 'step', [...g.append, ...g.attention]);
            outputs.push(await readFloat32(gpu, bufs.output, tokens * heads * headDim));
            // The cache really holds rotated keys: a prefill step rotates k in place before it stores it.
            if (tokens > 1) lastKeys = await readFloat32(gpu, bufs.k, tokens * kvHeads * headDim);
          }
        }
        for (const gs of graphs.values()) for (const g of gs) releaseDispatches(gpu, [...g.append, ...g.attention]);
        for (const b of Object.values(bufs)) gpu.allocator.release(b);
        pool.destroy();
        return { outputs, lastKeys };
      };
      const { outputs: reference, lastKeys: plainKeys } = await run(false);
      const { outputs: rotated, lastKeys: rotatedKeys } = await run(true);
      expect(maxToleranceRatio(rotatedKeys, plainKeys, 1e-3, 1e-3)).toBeGreaterThan(1);
      for (let i = 0; i < reference.length; i++) {
        // Rotated values are rounded to f16 in a different basis: equal within f16 rounding of the outputs.
        expect(maxToleranceRatio(rotated[i], reference[i], 3e-3, 3e-3)).toBeLessThanOrEqual(1);
      }
      for (const b of [rotations.key, rotations.value, rotations.valueTransposed, rope.freqFactors, step]) {
        gpu.allocator.release(b);
      }
      expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
    },
  );

  it('refuses an output rotation in the merge pass of a prefill graph or of a graph without one', () => {
    const { gpu } = ctx;
    const [heads, headDim] = [4, 64];
    const pool = new KvPagePool(gpu, { layers: 1, kvHeads: 2, headDim, budgetBytes: 1 << 20 });
    const matrices = gpu.allocator.createStorage('r', 'kv', new Float32Array(2 * headDim * headDim));
    const q = gpu.allocator.createStorage('q', 'scratch', 8 * heads * headDim * 4);
    const output = gpu.allocator.createStorage('o', 'scratch', 8 * heads * headDim * 4);
    const binding = { pool, layer: 0, q, output, heads, scale: 1, minChunkKeys: 2 };
    const outputRotation = { matrices, firstMatrix: 0, headsPerMatrix: 2 };
    // Prefill graphs un-rotate with the rotate kernel's blocks build; a single split has no merge pass.
    for (const [maxTokens, splits] of [
      [8, 4],
      [1, 1],
    ]) {
      expect(() => prepareAttention(gpu, 'refused', { ...binding, maxTokens, splits, outputRotation })).toThrow(
        InvalidRequestError,
      );
    }
    const decode = prepareAttention(gpu, 'decode', { ...binding, maxTokens: 1, splits: 4, outputRotation });
    expect(decode.some((d) => d.pipeline.label.endsWith('-rotated'))).toBe(true);
    releaseDispatches(gpu, decode);
    for (const b of [matrices, q, output]) gpu.allocator.release(b);
    pool.destroy();
  });
});
