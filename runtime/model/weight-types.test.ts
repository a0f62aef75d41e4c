/**
 * The weight types of the files users download (issue 43): the IQ1/IQ2/IQ3 quantizations longtab does not run are
 * refused from the header with a message that names the tensor, its type and the nearest supported file to get
 * instead, leaving nothing on the GPU; a low-bit file whose fallback tensors have int8 kernels (Q2_K with a Q4_0
 * ffn_down) prefills on both kinds at once. (The types it runs are compared with llama.cpp in llama-oracle.test.ts.)
 */
import { describe, expect, it } from 'vitest';
import { UnsupportedModelError } from '../../core/errors.ts';
import { GGML_TYPE_INFO, GgmlType } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { seededRandom } from '../../test/random.ts';
import { type ModelFixtureSpec, modelFixtureGguf } from '../../tools/fixtures/model-fixtures.ts';
import { type LoadOptions, ModelRunner } from '../engine/model-runner.ts';
import { logProbability } from '../eval/perplexity.ts';
import { parseGguf } from '../gguf/parse.ts';
import { sourceFromBytes } from '../gguf/sources.ts';
import { metadataEntriesOf, writeGguf } from '../gguf/writer.ts';

const ctx = withTestGpu();

const spec = (weightType: GgmlType, ffnDim: number): ModelFixtureSpec => ({
  architecture: 'llama',
  weightType,
  dim: 256,
  layers: 2,
  heads: 4,
  kvHeads: 1,
  headDim: 64,
  ffnDim,
  vocab: 300,
  tiedOutput: true,
  ropeFreqBase: 10000,
  llama3RopeFreqs: false,
  seed: 43,
});

/** A tiny Q4_K model (rows of 256) whose attn_q of layer 0 is rewritten as `type` (zero bytes of its size). */
async function modelWithAttnQ(type: GgmlType): Promise<Uint8Array> {
  const bytes = modelFixtureGguf(spec(GgmlType.Q4_K, 512));
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

describe('a Q2_K file whose ffn_down rows (384) fell back to Q4_0', () => {
  async function forced(bytes: Uint8Array, prefillMatmul: LoadOptions['prefillMatmul']) {
    const runner = new ModelRunner(ctx.gpu);
    try {
      await runner.load(sourceFromBytes(bytes), { kv: 'f16', kvBudgetBytes: 1 << 20, prefillChunk: 32, prefillMatmul });
      const random = seededRandom(5);
      const ids = [1, ...Array.from({ length: 31 }, () => 3 + Math.floor(random() * 297))];
      const body = runner.loaded?.transformer.graph(32).body ?? [];
      return {
        ids,
        logits: await runner.teacherForcedLogits(ids),
        quantizes: body.filter((d) => d.label.endsWith('.quantize')).map((d) => d.label),
        f32Matmuls: body.filter((d) => d.pipeline.label.startsWith('matmul ')).map((d) => d.label),
      };
    } finally {
      runner.unload();
    }
  }

  // int8 activations (one scale per 32) into ffn_down move log-probabilities by up to 0.29 here (silu(gate)·up is
  // heavy-tailed; the same model all Q4_0, every projection on int8: 0.29 too); routing a projection's input or
  // output wrong moves them by whole units.
  it('prefills with ffn_down on dot4I8Packed and the Q2_K projections on the f32 tiled matmul, as the f32 graph', async () => {
    const bytes = modelFixtureGguf(spec(GgmlType.Q2_K, 384));
    const file = await parseGguf(sourceFromBytes(bytes));
    expect(file.tensors.find((t) => t.name === 'blk.0.ffn_down.weight')?.type).toBe(GgmlType.Q4_0);
    expect(file.tensors.find((t) => t.name === 'blk.0.ffn_gate.weight')?.type).toBe(GgmlType.Q2_K);
    const f32 = await forced(bytes, 'f32');
    const mixed = await forced(bytes, 'int8-dot');
    expect(f32.quantizes).toEqual([]);
    expect(mixed.quantizes).toEqual(['blk.0.down.quantize', 'blk.1.down.quantize']);
    expect(mixed.f32Matmuls.filter((l) => l.includes('.down'))).toEqual([]);
    expect(mixed.f32Matmuls.filter((l) => /\.(q|k|v|o|gate|up)$/.test(l)).length).toBe(12);
    let worst = 0;
    for (let t = 0; t < f32.ids.length; t++) {
      for (let v = 0; v < 300; v++) {
        const a = logProbability(f32.logits, t * 300, 300, v);
        const b = logProbability(mixed.logits, t * 300, 300, v);
        worst = Math.max(worst, Math.abs(a - b));
      }
    }
    process.stderr.write(`Q2_K + Q4_0 on int8-dot vs f32: worst |Δ log p| ${worst.toFixed(4)}\n`);
    expect(worst).toBeLessThan(0.5);
  });
});
