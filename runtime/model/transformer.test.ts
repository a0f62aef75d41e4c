/**
 * A forward graph that cannot be prepared (a kernel refusing the model's shape partway through its layers) throws,
 * and leaves no GPU buffer behind: what its layers had prepared is released before the error reaches the loader.
 */
import { describe, expect, it } from 'vitest';
import type { RopeStage } from '../../kernels/rope.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { parseGguf } from '../gguf/parse.ts';
import { PagedKvAttention } from '../kv/paged-attention.ts';
import { KvPagePool } from '../kv/pool.ts';
import { readModelConfig } from './config.ts';
import { Transformer } from './transformer.ts';
import { loadModelWeights, releaseModelWeights } from './weights.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);

/** The paged cache, refusing one layer as a kernel refuses a shape it cannot run. */
class RefusingLayer extends PagedKvAttention {
  constructor(...args: [...ConstructorParameters<typeof PagedKvAttention>, number]) {
    super(args[0], args[1], args[2]);
    this.refused = args[3];
  }
  private readonly refused: number;
  override prepareLayer(
    layer: number,
    buffers: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer },
    maxTokens: number,
    rope: RopeStage | null,
  ) {
    if (layer === this.refused) throw new RangeError(`layer ${layer}: this shape is not supported`);
    return super.prepareLayer(layer, buffers, maxTokens, rope);
  }
}

describe.skipIf(!modelPath)('Transformer graphs', () => {
  it('a graph refused at its fourth layer throws and leaves every buffer it prepared released', async () => {
    const { gpu } = ctx;
    const source = await sourceFromPath(modelPath!);
    const file = await parseGguf(source);
    const config = readModelConfig(file);
    const weights = await loadModelWeights(gpu, file, source, config);
    const pool = new KvPagePool(gpu, {
      layers: config.layers,
      kvHeads: config.kvHeads,
      headDim: config.headDim,
      budgetBytes: 1 << 20,
    });
    const transformer = new Transformer(gpu, config, weights, new RefusingLayer(gpu, pool, config, 3), 16);
    const before = gpu.allocator.snapshot();
    for (const tokens of [1, 16]) expect(() => transformer.graph(tokens)).toThrow(/layer 3/);
    const after = gpu.allocator.snapshot();
    expect(after.totalBuffers).toBe(before.totalBuffers);
    expect(after.totalBytes).toBe(before.totalBytes);
    transformer.release();
    pool.destroy();
    releaseModelWeights(gpu, weights);
  });
});
