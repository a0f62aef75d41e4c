/**
 * OSCAR-style calibration of the KV rotations, on the device, from the model's own activations:
 *   pass 1: S_Q[l][h] = Σ over query heads h' under KV head h of q_h'ᵀ q_h'   (the metric key errors are read with)
 *   pass 2: S_V[l][h] = Σ_t w_t · v_tᵀ v_t with w_t = k_t · S_Q · k_tᵀ         (values weighted by the logit energy
 *                                                                            of their key)
 * then R_K = rotation(S_Q), R_V = rotation(S_V) per (layer, KV head) (runtime/kv/rotation.ts). Both passes are
 * prefill-only forwards with an f16 cache over the calibration tokens; nothing but the moments is read back.
 */
import { prepareCovariance, prepareKeyEnergy } from '../../kernels/covariance.ts';
import type { PreparedDispatch } from '../../kernels/dispatch.ts';
import type { GpuContext } from '../gpu/device.ts';
import { readFloat32 } from '../gpu/readback.ts';
import type { ModelConfig } from '../model/config.ts';
import { type KvAttentionBackend, Transformer } from '../model/transformer.ts';
import type { ModelWeights } from '../model/weights.ts';
import { PagedKvAttention } from './paged-attention.ts';
import { KvPagePool } from './pool.ts';
import { covarianceRotation } from './rotation.ts';

export interface CalibratedRotations {
  /** f32 [layers × kvHeads × headDim × headDim], row-major, applied as x · R. */
  key: Float32Array;
  value: Float32Array;
  /** The measured second moments the rotations were fitted to (same layout), for inspection and tests. */
  moments: { query: Float32Array; value: Float32Array };
  tokens: number;
}

type Pass = 'query' | 'value';

/** Adds moment accumulation after RoPE (pass 'query') or around the value store (pass 'value') of each layer. */
class MomentCapture implements KvAttentionBackend {
  constructor(
    private readonly gpu: GpuContext,
    private readonly inner: KvAttentionBackend,
    private readonly config: ModelConfig,
    private readonly step: GPUBuffer,
    private readonly pass: Pass,
    private readonly moments: { query: GPUBuffer; value: GPUBuffer; energy: GPUBuffer },
  ) {}

  prepareLayer(layer: number, b: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer }, maxTokens: number) {
    const { gpu, config: c, step, moments } = this;
    const firstMatrix = layer * c.kvHeads;
    const capture: PreparedDispatch[] =
      this.pass === 'query'
        ? [
            prepareCovariance(gpu, `blk.${layer}.moment_q`, {
              x: b.q,
              weights: null,
              covariance: moments.query,
              firstMatrix,
              matrices: c.kvHeads,
              heads: c.heads,
              headDim: c.headDim,
              step,
            }),
          ]
        : [
            prepareKeyEnergy(gpu, `blk.${layer}.key_energy`, {
              k: b.k,
              queryMoment: moments.query,
              firstMatrix,
              energy: moments.energy,
              kvHeads: c.kvHeads,
              headDim: c.headDim,
              maxTokens,
              step,
            }),
            prepareCovariance(gpu, `blk.${layer}.moment_v`, {
              x: b.v,
              weights: moments.energy,
              covariance: moments.value,
              firstMatrix,
              matrices: c.kvHeads,
              heads: c.kvHeads,
              headDim: c.headDim,
              step,
            }),
          ];
    const inner = this.inner.prepareLayer(layer, b, maxTokens);
    return { append: [...capture, ...inner.append], attention: inner.attention };
  }
}

/**
 * Runs both calibration passes over `tokens` (one sequence; ~4K tokens is plenty) and returns the rotations.
 * GPU memory used here (a small f16 pool, scratch activations, the moments) is released before returning.
 */
export async function calibrateKvRotations(
  gpu: GpuContext,
  config: ModelConfig,
  weights: ModelWeights,
  tokens: readonly number[],
  options: { chunk?: number; onProgress?: (done: number, total: number) => void } = {},
): Promise<CalibratedRotations> {
  const c = config;
  const d = c.headDim;
  const chunk = options.chunk ?? 128;
  const matrices = c.layers * c.kvHeads;
  const pool = new KvPagePool(gpu, {
    layers: c.layers,
    kvHeads: c.kvHeads,
    headDim: d,
    budgetBytes: 2 * c.layers * c.kvHeads * d * 2 * (tokens.length + 64),
    maxSequences: 1,
    maxSequenceTokens: tokens.length + 64,
  });
  const moments = {
    query: gpu.allocator.createStorage('calibration.S_Q', 'scratch', matrices * d * d * 4),
    value: gpu.allocator.createStorage('calibration.S_V', 'scratch', matrices * d * d * 4),
    energy: gpu.allocator.createStorage('calibration.energy', 'scratch', chunk * c.kvHeads * 4),
  };
  const total = 2 * tokens.length;
  let done = 0;
  try {
    for (const pass of ['query', 'value'] as const) {
      const backend = new MomentCapture(
        gpu,
        new PagedKvAttention(gpu, pool, { heads: c.heads }),
        c,
        pool.step,
        pass,
        moments,
      );
      const transformer = new Transformer(gpu, c, weights, backend, chunk);
      const seq = pool.createSequence();
      try {
        for (let position = 0; position < tokens.length; position += chunk) {
          const ids = tokens.slice(position, position + chunk);
          pool.writeStep(seq, position, ids.length);
          transformer.writeStep(ids, position);
          const encoder = gpu.device.createCommandEncoder({ label: `calibration.${pass}` });
          transformer.encode(encoder, ids.length, 'none');
          gpu.device.queue.submit([encoder.finish()]);
          await gpu.device.queue.onSubmittedWorkDone();
          gpu.throwIfErrors();
          done += ids.length;
          options.onProgress?.(done, total);
        }
      } finally {
        pool.free(seq);
        transformer.release();
      }
    }
    const sq = await readFloat32(gpu, moments.query, matrices * d * d);
    const sv = await readFloat32(gpu, moments.value, matrices * d * d);
    const key = new Float32Array(matrices * d * d);
    const value = new Float32Array(matrices * d * d);
    for (let m = 0; m < matrices; m++) {
      key.set(covarianceRotation(Float64Array.from(sq.subarray(m * d * d, (m + 1) * d * d)), d), m * d * d);
      value.set(covarianceRotation(Float64Array.from(sv.subarray(m * d * d, (m + 1) * d * d)), d), m * d * d);
    }
    return { key, value, moments: { query: sq, value: sv }, tokens: tokens.length };
  } finally {
    for (const b of Object.values(moments)) gpu.allocator.release(b);
    pool.destroy();
  }
}
