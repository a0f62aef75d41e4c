import { describe, expect, it } from 'vitest';
import {
  INT8_ATTENTION_QUANTIZATION_BOUND,
  INT8_ATTENTION_TOLERANCE,
  INT8_PREFILL_CASES,
  INT8_PREFILL_MUTATIONS,
  int8MutationRatio,
  runSteps,
} from '../test/attention-harness.ts';
import { withTestGpu } from '../test/gpu.ts';
import { INT8_MIXED_CASES, runMixed } from '../test/mixed-attention-harness.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { attentionPrefillInt8ShapeFor } from './attention.ts';
import { attentionPrefillInt8Shape, attentionPrefillInt8WorkgroupBytes } from './attention-prefill-int8.wgsl.ts';
import { attentionReference } from './reference/attention.ts';
import { attentionInt8Reference } from './reference/attention-int8.ts';

const ctx = withTestGpu();

/** CI's lavapipe has no i8 subgroup matrices: these cases run on the H200 through bench/attention-kernels.ts --check-int8. */
function skipWithoutTensorCores(context: { skip: () => void }): void {
  if (!ctx.gpu.features.subgroupMatrixI8) {
    console.warn(
      `SKIPPED: ${ctx.gpu.adapter.description} has no i8 subgroup matrices (run bench/attention-kernels.ts --check-int8)`,
    );
    context.skip();
  }
}

describe('int8 prefill attention', () => {
  it.for(INT8_PREFILL_CASES)('matches the CPU reference: %s', async ([, shape, chunks, more], context) => {
    skipWithoutTensorCores(context);
    const pool = { headDim: shape.headDim, kvHeads: shape.kvHeads, quant: null } as never;
    expect(
      attentionPrefillInt8ShapeFor(ctx.gpu, { pool, layer: 0, maxTokens: 2, prefillProducts: 'int8' }),
    ).not.toBeNull();
    const { ratios } = await runSteps(ctx.gpu, shape, chunks, 57 + shape.headDim, 4, {
      ...more,
      prefillProducts: 'int8',
      tolerance: INT8_ATTENTION_TOLERANCE,
    });
    expect(Math.max(...ratios)).toBeLessThanOrEqual(1);
  });

  it.for(INT8_MIXED_CASES)('over f16 and quant pages, matches the CPU reference: %s', async ([, c], context) => {
    skipWithoutTensorCores(context);
    const r = await runMixed(ctx.gpu, c, 4242, { prefillProducts: 'int8', tolerance: INT8_ATTENTION_TOLERANCE });
    expect(r.quantPositions).toBeGreaterThan(0);
    expect(r.mismatchedCodes).toBe(0);
    expect(r.worst).toBeLessThanOrEqual(1);
  });

  it.for(INT8_PREFILL_MUTATIONS)('catches a broken kernel: %s', async ([, edit], context) => {
    skipWithoutTensorCores(context);
    expect(await int8MutationRatio(ctx.gpu, edit)).toBeGreaterThan(1);
  });

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
      };
      const exact = attentionReference(input);
      const int8 = attentionInt8Reference({
        ...input,
        splits: more.prefillSplits ?? 1,
        minChunkKeys: more.minChunkKeys ?? 1,
      });
      const { atol } = INT8_ATTENTION_QUANTIZATION_BOUND;
      const ratio = maxToleranceRatio(int8, exact, atol, 0);
      expect(ratio).toBeLessThanOrEqual(1);
      expect(ratio * atol).toBeGreaterThan(1e-3);
    }
  });

  it('serves head sizes 64 and 128 where the workgroup storage holds the build; the f32 kernels elsewhere', () => {
    expect(attentionPrefillInt8WorkgroupBytes(64)).toBe(34304);
    expect(attentionPrefillInt8WorkgroupBytes(128)).toBe(46592);
    expect(attentionPrefillInt8Shape(128, null, 49152)).toEqual({ headDim: 128, quant: null });
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
