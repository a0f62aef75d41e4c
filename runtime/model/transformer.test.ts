/**
 * A forward graph that cannot be prepared (a kernel refusing the model's shape partway through its layers) throws,
 * and leaves no GPU buffer behind: what its layers had prepared is released before the error reaches the loader.
 */
import { describe, expect, it } from 'vitest';
import type { RopeStage } from '../../kernels/rope.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { loadStoriesModel } from '../../test/stories-model.ts';
import { PagedKvAttention } from '../kv/paged-attention.ts';
import { Transformer } from './transformer.ts';

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
    const model = await loadStoriesModel(gpu, modelPath!);
    const { config, weights, pool } = model;
    const transformer = new Transformer(gpu, config, weights, new RefusingLayer(gpu, pool, config, 3), 16);
    const before = gpu.allocator.snapshot();
    for (const tokens of [1, 16]) expect(() => transformer.graph(tokens)).toThrow(/layer 3/);
    const after = gpu.allocator.snapshot();
    expect(after.totalBuffers).toBe(before.totalBuffers);
    expect(after.totalBytes).toBe(before.totalBytes);
    transformer.release();
    await model.release();
  });
});
