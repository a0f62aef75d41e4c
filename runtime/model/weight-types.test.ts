/**
 * The weight types of the files users download (issue 43): the IQ1/IQ2/IQ3 quantizations longtab does not run are
 * refused from the header with a message that names the tensor, its type and the nearest supported file to get
 * instead; nothing is read past the header or left on the GPU. (The types it runs are compared with llama.cpp in
 * llama-oracle.test.ts.)
 */
import { describe, expect, it } from 'vitest';
import { UnsupportedModelError } from '../../core/errors.ts';
import { GGML_TYPE_INFO, GgmlType } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { modelFixtureGguf } from '../../tools/fixtures/model-fixtures.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { parseGguf } from '../gguf/parse.ts';
import { sourceFromBytes } from '../gguf/sources.ts';
import { metadataEntriesOf, writeGguf } from '../gguf/writer.ts';

const ctx = withTestGpu();

/** A tiny Q4_K model (rows of 256) whose attn_q of layer 0 is rewritten as `type` (zero bytes of its size). */
async function modelWithAttnQ(type: GgmlType): Promise<Uint8Array> {
  const bytes = modelFixtureGguf({
    architecture: 'llama',
    weightType: GgmlType.Q4_K,
    dim: 256,
    layers: 1,
    heads: 4,
    kvHeads: 1,
    headDim: 64,
    ffnDim: 512,
    vocab: 300,
    tiedOutput: true,
    ropeFreqBase: 10000,
    llama3RopeFreqs: false,
    seed: 43,
  });
  const file = await parseGguf(sourceFromBytes(bytes));
  const info = GGML_TYPE_INFO[type]!;
  const tensors = file.tensors.map((t) => {
    const count = t.shape.reduce((a, b) => a * b, 1);
    return t.name === 'blk.0.attn_q.weight'
      ? { name: t.name, shape: t.shape, type, data: new Uint8Array((count / info.blockSize) * info.blockBytes) }
      : { name: t.name, shape: t.shape, type: t.type, data: bytes.subarray(t.offset, t.offset + t.byteLength) };
  });
  return writeGguf({ metadata: metadataEntriesOf(file), tensors, alignment: file.alignment });
}

describe('weight types longtab does not run', () => {
  it.each([
    ['IQ1_S', GgmlType.IQ1_S, 'a Q2_K file'],
    ['IQ1_M', GgmlType.IQ1_M, 'a Q2_K file'],
    ['IQ2_XXS', GgmlType.IQ2_XXS, 'a Q2_K or Q3_K_S file'],
    ['IQ2_XS', GgmlType.IQ2_XS, 'a Q2_K or Q3_K_S file'],
    ['IQ2_S', GgmlType.IQ2_S, 'a Q2_K or Q3_K_S file'],
    ['IQ3_XXS', GgmlType.IQ3_XXS, 'a Q3_K_M or Q4_K_M file'],
    ['IQ3_S', GgmlType.IQ3_S, 'a Q3_K_M or Q4_K_M file'],
  ] as const)(
    '%s: refused at load, naming the tensor, the type and the nearest supported file',
    async (name, type, nearest) => {
      const bytes = await modelWithAttnQ(type);
      const baseline = ctx.gpu.allocator.snapshot().totalBuffers;
      const runner = new ModelRunner(ctx.gpu);
      const error = await runner.load(sourceFromBytes(bytes)).then(
        () => null,
        (e: unknown) => e,
      );
      expect(error).toBeInstanceOf(UnsupportedModelError);
      expect((error as Error).message).toBe(
        `Tensor 'blk.0.attn_q.weight' has type ${name}, which longtab does not run; use ${nearest}.`,
      );
      expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline);
    },
  );
});
