import { prepareAttention } from '../../kernels/attention.ts';
import { prepareKvAppend } from '../../kernels/kv-append.ts';
import type { GpuContext } from '../gpu/device.ts';
import type { KvAttentionBackend } from '../model/transformer.ts';
import type { KvPagePool } from './pool.ts';

/** The forward pass's view of a KV pool: per layer, store this step's k/v, then attend over the pages. */
export class PagedKvAttention implements KvAttentionBackend {
  constructor(
    private readonly gpu: GpuContext,
    private readonly pool: KvPagePool,
    private readonly heads: number,
  ) {}

  prepareLayer(layer: number, b: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer }, maxTokens: number) {
    const { gpu, pool } = this;
    const label = `blk.${layer}`;
    return {
      append: [prepareKvAppend(gpu, `${label}.kv_append`, { pool, layer, k: b.k, v: b.v, tokens: maxTokens })],
      attention: prepareAttention(gpu, `${label}.attention`, {
        pool,
        layer,
        q: b.q,
        output: b.output,
        heads: this.heads,
        maxTokens,
        scale: 1 / Math.sqrt(pool.headDim),
      }),
    };
  }
}
