/**
 * stories260K's weights on the GPU and an f16 page pool of its shape, for tests that build a forward pass themselves
 * (StepRunner, Transformer) rather than through the model runner. `release()` frees all of it.
 */
import type { GpuContext } from '../core/gpu/device.ts';
import { sourceFromPath } from '../runtime/gguf/node-source.ts';
import { parseGguf } from '../runtime/gguf/parse.ts';
import { KvPagePool } from '../runtime/kv/pool.ts';
import { type ModelConfig, readModelConfig } from '../runtime/model/config.ts';
import { loadModelWeights, type ModelWeights, releaseModelWeights } from '../runtime/model/weights.ts';

export interface StoriesModel {
  config: ModelConfig;
  weights: ModelWeights;
  pool: KvPagePool;
  release(): Promise<void>;
}

export async function loadStoriesModel(gpu: GpuContext, modelPath: string): Promise<StoriesModel> {
  const source = await sourceFromPath(modelPath);
  const file = await parseGguf(source);
  const config = readModelConfig(file);
  const weights = await loadModelWeights(gpu, file, source, config);
  const pool = new KvPagePool(gpu, {
    layers: config.layers,
    kvHeads: config.kvHeads,
    headDim: config.headDim,
    budgetBytes: 1 << 20,
  });
  return {
    config,
    weights,
    pool,
    async release() {
      pool.destroy();
      releaseModelWeights(gpu, weights);
      await source.close?.();
    },
  };
}
