import { describe, expect, it } from 'vitest';
import { InvalidRequestError } from '../../core/errors.ts';
import { releaseDispatches, submitDispatches } from '../../core/gpu/dispatch.ts';
import { readFloat32 } from '../../core/gpu/readback.ts';
import { prepareAttention } from '../../kernels/attention.ts';
import { withLimits, withTestGpu } from '../../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../../test/random.ts';
import { PagedKvAttention } from './paged-attention.ts';
import { KvPagePool } from './pool.ts';
import { RotatedKvAttention } from './rotated-attention.ts';
import { covarianceRotation, multiply, rotationSet, transpose, transposedMatrices } from './rotation.ts';

const ctx = withTestGpu();

// 21 prefill tokens × 8 heads × (64 + 2) floats: one prefill split's partials (44,352 bytes); a decode split's is 2,112.
const PREFILL_SPLIT_BYTES = 44352;

describe('RotatedKvAttention', () => {
  it.each([
    // Decode graphs un-rotate in their merge pass, prefill graphs in a rotate dispatch of their own: after the rows
    // merge, or
    ['after the rows merge', undefined],
    // with storage bindings that hold one prefill split's partials, in a prefill graph without a merge pass (decode
    // graphs, whose splits' partials are smaller, still merge).
    ['without a merge pass', PREFILL_SPLIT_BYTES + 100],
  ] as const)(
    'gives the same attention output as the unrotated cache (Hadamard and calibrated rotations; prefill un-rotation %s)',
    async (_, bindingLimit) => {
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
      const run = async (rotated: boolean) => {
        const pool = new KvPagePool(gpu, { layers, kvHeads, headDim, budgetBytes: 1 << 20 });
        const plain = new PagedKvAttention(
          rotated && bindingLimit !== undefined ? withLimits(gpu, { maxStorageBufferBindingSize: bindingLimit }) : gpu,
          pool,
          { heads },
        );
        const backend = rotated
          ? new RotatedKvAttention(gpu, plain, rotations, { heads, kvHeads, headDim }, pool.step)
          : plain;
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
            const layers = [0, 1].map((l) => backend.prepareLayer(l, bufs, tokens));
            const ownDispatch = layers.map((g) => g.attention.some((d) => d.label.endsWith('.unrotate_out')));
            expect(ownDispatch).toEqual(layers.map(() => rotated && tokens > 1));
            graphs.set(tokens, layers);
          }
          pool.beginStep(seq, tokens);
          pool.submitPending(); // page copies and promotions the step asked for
          for (const layer of [0, 1]) {
            gpu.device.queue.writeBuffer(bufs.q, 0, randomFloats(data, tokens * heads * headDim, 2));
            gpu.device.queue.writeBuffer(bufs.k, 0, randomFloats(data, tokens * kvHeads * headDim, 2));
            gpu.device.queue.writeBuffer(bufs.v, 0, randomFloats(data, tokens * kvHeads * headDim, 1));
            const g = graphs.get(tokens)![layer];
            submitDispatches(gpu, 'step', [...g.append, ...g.attention]);
            outputs.push(await readFloat32(gpu, bufs.output, tokens * heads * headDim));
            // The cache really holds rotated keys: k is rotated in place before it is stored.
            lastKeys = await readFloat32(gpu, bufs.k, tokens * kvHeads * headDim);
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
      gpu.allocator.release(rotations.key);
      gpu.allocator.release(rotations.value);
      gpu.allocator.release(rotations.valueTransposed);
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
