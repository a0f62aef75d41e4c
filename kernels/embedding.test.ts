import { describe, expect, it } from 'vitest';
import { GgmlType } from '../core/gguf-types.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { prepareEmbedding } from './embedding.ts';
import { dequantize, randomWeightBytes } from './reference/dequantize.ts';
import { releaseWeight, uploadWeightFromBytes } from './weights.ts';

const ctx = withTestGpu();

// dim per type: F32/F16/BF16 use an odd dim (K % 4 != 0, odd F16 rows are padded); the rest a few blocks.
const TYPES: [string, GgmlType, number][] = [
  ['F32', GgmlType.F32, 291],
  ['F16', GgmlType.F16, 291],
  ['BF16', GgmlType.BF16, 291],
  ['Q8_0', GgmlType.Q8_0, 288],
  ['Q4_0', GgmlType.Q4_0, 288],
  ['Q4_1', GgmlType.Q4_1, 288],
  ['Q5_0', GgmlType.Q5_0, 288],
  ['Q5_1', GgmlType.Q5_1, 288],
  ['Q4_K', GgmlType.Q4_K, 512],
  ['Q5_K', GgmlType.Q5_K, 512],
  ['Q6_K', GgmlType.Q6_K, 512],
  ['Q2_K', GgmlType.Q2_K, 512],
  ['Q3_K', GgmlType.Q3_K, 512],
  ['IQ4_NL', GgmlType.IQ4_NL, 288],
  ['IQ4_XS', GgmlType.IQ4_XS, 512],
];

/** The lookup of a 41-row table split into 3 parts, on `gpu`, and the reference's rows. */
async function runEmbedding(gpu: GpuContext, type: GgmlType, dim: number, scale: number) {
  const vocab = 41;
  const random = seededRandom(type * 131 + dim);
  const raw = randomWeightBytes(type, dim * vocab, random);
  const ids = new Uint32Array([0, 40, 17, 16, 15, 32, 33, 5, 40]);
  const before = gpu.allocator.snapshot().totalBuffers;
  const weight = uploadWeightFromBytes(gpu, 'tok_embd', type, [dim, vocab], raw, { maxRowsPerPart: 16 });
  expect(weight.parts.length).toBe(3);
  const tokenIds = gpu.allocator.createStorage('ids', 'scratch', ids);
  const output = gpu.allocator.createStorage('out', 'scratch', ids.length * dim * 4);
  const dispatches = prepareEmbedding(gpu, 'embed', { weight, tokenIds, output, tokens: ids.length, scale });
  submitDispatches(gpu, 'embedding-test', dispatches);
  const actual = await readFloat32(gpu, output, ids.length * dim);
  releaseDispatches(gpu, dispatches);
  releaseWeight(gpu, weight);
  gpu.allocator.release(tokenIds);
  gpu.allocator.release(output);
  expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
  const table = dequantize(type, raw, dim * vocab);
  const expected = new Float32Array(ids.length * dim);
  for (const [t, id] of ids.entries()) {
    expected.set(
      table.subarray(id * dim, (id + 1) * dim).map((v) => v * scale),
      t * dim,
    );
  }
  return { actual, expected };
}

describe('embedding lookup', () => {
  // The GPU dequantizes in f32, the reference in f64 rounded once to f32. K-quant values are d·sc·q - dmin·m with
  // terms up to ~50, so the absolute error is a few f32 ulps of 50: 2e-5 absolute plus 1e-5 relative (times the
  // scale: every other type is scaled as Gemma's embeddings are, by sqrt(dim)).
  it.each(TYPES)('%s: rows of a 41-row table split into 3 parts match the reference', async (_name, type, dim) => {
    const scale = type % 2 === 0 ? Math.fround(Math.sqrt(dim)) : 1;
    const { actual, expected } = await runEmbedding(ctx.gpu, type, dim, scale);
    expect(maxToleranceRatio(actual, expected, 2e-5 * scale, 1e-5)).toBeLessThanOrEqual(1);
  });

  it('catches a broken kernel: the scale left out fails the comparison', async () => {
    const broken = mutateShaders(ctx.gpu, {
      label: 'embedding-scaled',
      edit: (code) => code.replace(' * params.scale', ''),
    });
    const { actual, expected } = await runEmbedding(broken.gpu, GgmlType.Q8_0, 288, 16.97);
    expect(broken.mutated).toEqual(['embedding-scaled']);
    expect(maxToleranceRatio(actual, expected, 2e-5 * 16.97, 1e-5)).toBeGreaterThan(1);
  });
});
