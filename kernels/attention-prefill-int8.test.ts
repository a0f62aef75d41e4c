import { describe, expect, it } from 'vitest';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readUint32 } from '../core/gpu/readback.ts';
import { KvPagePool } from '../runtime/kv/pool.ts';
import {
  expectedAttention,
  INT8_ATTENTION_QUANTIZATION_BOUND,
  INT8_ATTENTION_TOLERANCE,
  INT8_PREFILL_CASES,
  INT8_PREFILL_MUTATIONS,
  int8MutationRatio,
  runSteps,
} from '../test/attention-harness.ts';
import { withTestGpu } from '../test/gpu.ts';
import { INT8_MIXED_CASES, keysInt8Mismatches, runMixed } from '../test/mixed-attention-harness.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import {
  attentionPrefillDotShapeFor,
  attentionPrefillInt8ShapeFor,
  poolKeysInt8Bytes,
  poolKeysInt8Capacity,
  prepareKeysInt8,
} from './attention.ts';
import { attentionPrefillDotShape, attentionPrefillDotWorkgroupBytes } from './attention-prefill-dot.wgsl.ts';
import {
  attentionPrefillInt8Shape,
  attentionPrefillInt8WorkgroupBytes,
  keysInt8ByteAt,
  keysInt8Bytes,
  keysInt8Capacity,
} from './attention-prefill-int8.wgsl.ts';
import { prepareKvAppend } from './kv-append.ts';
import { attentionReference, roundToF16 } from './reference/attention.ts';

const ctx = withTestGpu();

/**
 * Whether this device runs the kernel of `products` for `headDim`: the tensor-core kernel needs i8 subgroup
 * matrices (CI's lavapipe has none: its cases run on the H200 through bench/attention-kernels.ts --check-int8), the
 * dot4I8Packed one subgroups and, at headDim 128, more than 32 KiB of workgroup storage.
 */
function skipUnserved(products: 'int8' | 'int8-dot', headDim: number, context: { skip: () => void }): void {
  const pool = { headDim, kvHeads: 1, quant: null } as never;
  const b = { pool, layer: 0, maxTokens: 2, prefillProducts: products };
  const served =
    products === 'int8' ? attentionPrefillInt8ShapeFor(ctx.gpu, b) : attentionPrefillDotShapeFor(ctx.gpu, b);
  if (!served) {
    console.warn(
      `SKIPPED: ${ctx.gpu.adapter.description} does not run the ${products} prefill attention at headDim ${headDim} (run bench/attention-kernels.ts --check-int8 on a GPU)`,
    );
    context.skip();
  }
}

describe.each(['int8', 'int8-dot'] as const)('%s prefill attention', (products) => {
  it.for(INT8_PREFILL_CASES)('matches the CPU reference: %s', async ([, shape, chunks, more], context) => {
    skipUnserved(products, shape.headDim, context);
    const { ratios } = await runSteps(ctx.gpu, shape, chunks, 57 + shape.headDim, 4, {
      ...more,
      prefillProducts: products,
      tolerance: INT8_ATTENTION_TOLERANCE,
    });
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  it.for(products === 'int8' ? INT8_PREFILL_CASES : [])(
    'the build that converts each tile from the pages matches the CPU reference: %s',
    async ([, shape, chunks, more], context) => {
      skipUnserved(products, shape.headDim, context);
      const { ratios } = await runSteps(ctx.gpu, shape, chunks, 57 + shape.headDim, 4, {
        ...more,
        prefillProducts: products,
        convertKeys: false,
        tolerance: INT8_ATTENTION_TOLERANCE,
      });
      expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
    },
  );

  // A CPU driver takes minutes to compile the quant builds (two formats where a layer is boosted).
  it.for(INT8_MIXED_CASES)(
    'over f16 and quant pages, matches the CPU reference: %s',
    { timeout: 600_000 },
    async ([, c], context) => {
      skipUnserved(products, c.headDim, context);
      const r = await runMixed(ctx.gpu, c, 4242, { prefillProducts: products, tolerance: INT8_ATTENTION_TOLERANCE });
      expect(r.quantPositions).toBeGreaterThan(0);
      expect(r.mismatchedCodes).toBe(0);
      expect(r.worst).toBeLessThanOrEqual(1);
    },
  );

  it.for(INT8_PREFILL_MUTATIONS[products])('catches a broken kernel: %s', async ([, edit, at], context) => {
    skipUnserved(products, 64, context);
    expect(await int8MutationRatio(ctx.gpu, edit, products, true, at)).toBeGreaterThan(1);
  });

  // The page-reading build has no keys buffer to misread.
  it.for(
    products === 'int8' ? INT8_PREFILL_MUTATIONS.int8.filter(([name]) => name !== 'values read from the keys') : [],
  )('catches a broken kernel, the build that converts each tile from the pages: %s', async ([, edit, at], context) => {
    skipUnserved(products, 64, context);
    expect(await int8MutationRatio(ctx.gpu, edit, products, false, at)).toBeGreaterThan(1);
  });
});

describe('int8 prefill attention', () => {
  it('its CPU reference quantizes: within the 8-bit bound of exact attention, not equal to it', () => {
    for (const [, shape, chunks, more] of INT8_PREFILL_CASES) {
      const random = seededRandom(71 + shape.headDim);
      const { heads, kvHeads, headDim } = shape;
      const length = chunks[0];
      const input = {
        q: randomFloats(random, length * heads * headDim, 2),
        k: randomFloats(random, length * kvHeads * headDim, 2),
        v: randomFloats(random, length * kvHeads * headDim, 1),
        position: 0,
        tokens: length,
        heads,
        kvHeads,
        headDim,
        scale: 1 / Math.sqrt(headDim),
        window: more.window,
      };
      const exact = attentionReference(input);
      const int8 = expectedAttention(input, {
        splits: more.prefillSplits ?? 1,
        splitRows: more.prefillSplitRows ?? 0,
        minChunkKeys: more.minChunkKeys ?? 1,
      });
      const { atol } = INT8_ATTENTION_QUANTIZATION_BOUND;
      const ratio = maxToleranceRatio(int8, exact, atol, 0);
      expect(ratio).toBeLessThanOrEqual(1);
      expect(ratio * atol).toBeGreaterThan(1e-3);
    }
  });

  it('the dot4I8Packed build keeps q in registers: headDim 128 fits 32 KiB of workgroup storage', () => {
    expect(attentionPrefillDotWorkgroupBytes(64)).toBe(12800);
    expect(attentionPrefillDotWorkgroupBytes(128)).toBe(25088);
    expect(attentionPrefillDotShape(128, null, 32768, false)).toEqual({ headDim: 128, quant: null, unrolled: false });
    expect(attentionPrefillDotShape(128, null, 16384)).toBeNull();
    expect(attentionPrefillDotShape(96, null, 32768)).toBeNull();
    const pool = { headDim: 64, kvHeads: 2, quant: null } as never;
    expect(attentionPrefillDotShapeFor(ctx.gpu, { pool, layer: 0, maxTokens: 64 })).toBeNull();
    // Served wherever subgroups of an even size fill the 128 invocations (lavapipe: 8, SwiftShader, GPUs).
    const { subgroupMinSize = 0, subgroupMaxSize = 0 } = ctx.gpu.adapter;
    const served = ctx.gpu.features.subgroups && subgroupMinSize >= 2 && 128 % subgroupMaxSize === 0;
    expect(
      attentionPrefillDotShapeFor(ctx.gpu, { pool, layer: 0, maxTokens: 64, prefillProducts: 'int8-dot' }) !== null,
    ).toBe(served);
  });

  it('serves head sizes 64 and 128 where the workgroup storage holds the build; the f32 kernels elsewhere', () => {
    expect(attentionPrefillInt8WorkgroupBytes(64, false)).toBe(33280);
    expect(attentionPrefillInt8WorkgroupBytes(128, false)).toBe(41472);
    // The converted build is compact: 20 KiB at head size 64, and at 128 (V's tile staged half its dims at a time) 24
    // KiB, which lets the H200 keep two workgroups an SM.
    expect(attentionPrefillInt8WorkgroupBytes(64, true)).toBe(19968);
    expect(attentionPrefillInt8WorkgroupBytes(128, true)).toBe(24064);
    expect(attentionPrefillInt8Shape(128, null, 49152)).toEqual({
      headDim: 128,
      quant: null,
      converted: false,
    });
    expect(attentionPrefillInt8Shape(128, null, 49152, true)).toEqual({
      headDim: 128,
      quant: null,
      converted: true,
    });
    expect(attentionPrefillInt8Shape(128, null, 32768)).toBeNull();
    expect(attentionPrefillInt8Shape(96, null, 49152)).toBeNull();
    const pool = { headDim: 64, kvHeads: 2, quant: null } as never;
    // Asked for only: 'f32' (the default) and decode steps keep the f32 kernels.
    expect(attentionPrefillInt8ShapeFor(ctx.gpu, { pool, layer: 0, maxTokens: 64 })).toBeNull();
    expect(attentionPrefillInt8ShapeFor(ctx.gpu, { pool, layer: 0, maxTokens: 1, prefillProducts: 'int8' })).toBeNull();
    expect(
      attentionPrefillInt8ShapeFor(ctx.gpu, { pool, layer: 0, maxTokens: 64, prefillProducts: 'int8' }) !== null,
    ).toBe(ctx.gpu.features.subgroupMatrixI8);
  });
});

describe('int8 keys conversion pass', () => {
  it('lays out the int8 keys buffer without gaps or overlaps: each code and scale its own bytes, to the end', () => {
    // Tiles start on multiples of 64 keys, so the converted build reads no key past a KV head's capacity.
    for (const headDim of [64, 128]) {
      for (const [kvHeads, maxKeys] of [
        [1, 100],
        [2, 130],
      ]) {
        const capacity = keysInt8Capacity(maxKeys);
        expect(capacity % 64).toBe(0);
        expect(capacity).toBeGreaterThanOrEqual(maxKeys);
        const bytes = keysInt8Bytes(maxKeys, kvHeads, headDim);
        const owner = new Int32Array(bytes).fill(-1);
        let entry = 0;
        const claim = (from: number, length: number) => {
          for (let b = from; b < from + length; b++) {
            expect(owner[b]).toBe(-1);
            owner[b] = entry;
          }
          entry++;
        };
        for (const kind of [0, 1] as const) {
          for (let kvh = 0; kvh < kvHeads; kvh++) {
            for (let key = 0; key < capacity; key++) {
              const layout = { capacity, kvHeads, headDim };
              for (let dim = 0; dim < headDim; dim++) claim(keysInt8ByteAt(kind, kvh, key, dim, layout).code, 1);
              claim(keysInt8ByteAt(kind, kvh, key, 0, layout).scale, 4);
            }
          }
        }
        expect(owner.indexOf(-1)).toBe(-1);
      }
    }
    // V's tiles are transposed: one dim's codes of 4 consecutive keys share a word.
    const layout = { capacity: 128, kvHeads: 1, headDim: 64 };
    const word = (key: number, dim: number) => Math.floor(keysInt8ByteAt(1, 0, key, dim, layout).code / 4);
    expect(word(65, 3)).toBe(word(64, 3));
    expect(word(64, 4)).not.toBe(word(64, 3));
  });

  // The tensor-core kernel's converted build reads these codes (checked on the H200 by bench/attention-kernels.ts
  // --check-int8); the pass itself needs only subgroups, so CI's adapters run it.
  it.for([64, 128])(
    "writes each key's codes and scale as the CPU reference quantizes the f16 pages: headDim %i",
    async (headDim, context) => {
      const { gpu } = ctx;
      if (!gpu.features.subgroups) {
        console.warn(`SKIPPED: ${gpu.adapter.description} has no subgroups (the int8 keys conversion needs them)`);
        context.skip();
      }
      const kvHeads = 2;
      const pageTokens = 16;
      const steps = [64, 37]; // the second ends inside a tile
      const pool = new KvPagePool(gpu, {
        layers: 1,
        kvHeads,
        headDim,
        pageTokens,
        budgetBytes: 2 * kvHeads * pageTokens * headDim * 2 * 16,
        maxSequenceTokens: 128,
      });
      const capacity = poolKeysInt8Capacity(pool);
      const keysInt8 = gpu.allocator.createStorage('test.keys_int8', 'scratch', poolKeysInt8Bytes(pool));
      const row = kvHeads * headDim;
      const k = gpu.allocator.createStorage('test.k', 'scratch', 64 * row * 4);
      const v = gpu.allocator.createStorage('test.v', 'scratch', 64 * row * 4);
      const append = prepareKvAppend(gpu, 'test.append', { pool, layer: 0, k, v, tokens: 64 });
      const binding = { pool, layer: 0, q: k, output: v, heads: kvHeads, maxTokens: 64, scale: 1, keysInt8 };
      const { dispatch } = prepareKeysInt8(gpu, 'test', binding);
      const random = seededRandom(headDim);
      const seq = pool.createSequence();
      const written: { k: Float32Array[]; v: Float32Array[] } = { k: [], v: [] };
      for (const tokens of steps) {
        pool.writeStep(seq, seq.length, tokens);
        pool.submitPending(); // page copies and promotions the step asked for
        for (const [buffer, list, scale] of [
          [k, written.k, 2],
          [v, written.v, 1],
        ] as const) {
          const values = randomFloats(random, tokens * row, scale);
          gpu.device.queue.writeBuffer(buffer, 0, values);
          list.push(values);
        }
        submitDispatches(gpu, 'test', [append, dispatch]);
      }
      const words = await readUint32(gpu, keysInt8, keysInt8.size / 4);
      const length = steps[0] + steps[1];
      // What the f16 pages hold of the rows written.
      const held = (list: Float32Array[]) => Array.from([...list[0], ...list[1]], roundToF16);
      const found = keysInt8Mismatches(
        words,
        { capacity, kvHeads, headDim },
        [held(written.k), held(written.v)],
        length,
      );
      expect(found.codes).toBe(2 * length * kvHeads * headDim);
      expect(found.worstScale).toBeLessThan(5e-7);
      // Rounding ties may fall either way in f32; anything more is a wrong code.
      expect(found.wrong).toBe(0);
      expect(found.offByOne).toBeLessThanOrEqual(2);
      releaseDispatches(gpu, [append, dispatch]);
      for (const b of [keysInt8, k, v]) gpu.allocator.release(b);
      pool.destroy();
    },
  );
});
