import { InvalidRequestError } from '../core/errors.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from '../core/gpu/dispatch.ts';
import { embeddingWgsl } from './embedding.wgsl.ts';
import { requireBytes } from './matmul.ts';
import { type GpuWeight, packedRowWords } from './weights.ts';

export interface EmbeddingBinding {
  /** The table, shape [dim, vocab]: one row of `dim` values per token. */
  weight: GpuWeight;
  /** u32 [tokens] */
  tokenIds: GPUBuffer;
  /** f32 [tokens, dim] */
  output: GPUBuffer;
  tokens: number;
  /** Multiplies every value (default 1; Gemma's embeddings are scaled by sqrt(dim)). */
  scale?: number;
}

/**
 * out[t, :] = row tokenIds[t] of the table, dequantized to f32, times `scale`. One dispatch per weight part; each writes the
 * tokens whose ids fall in its rows. Ids outside the table leave their output row untouched.
 */
export function prepareEmbedding(gpu: GpuContext, label: string, b: EmbeddingBinding): PreparedDispatch[] {
  const { weight, tokens } = b;
  if (!Number.isInteger(tokens) || tokens < 1 || tokens > gpu.limits.maxComputeWorkgroupsPerDimension) {
    throw new InvalidRequestError(
      `Embedding '${label}' needs 1..${gpu.limits.maxComputeWorkgroupsPerDimension} tokens, got ${tokens}.`,
    );
  }
  const K = weight.rowLength;
  requireBytes(label, 'tokenIds', b.tokenIds, tokens * 4);
  requireBytes(label, 'output', b.output, tokens * K * 4);
  const scaled = b.scale !== undefined && b.scale !== 1;
  const pipeline = computePipeline(gpu, scaled ? 'embedding-scaled' : 'embedding', embeddingWgsl(weight.type, scaled));
  const rowWords = packedRowWords(weight.type, K);
  const groupsK = Math.ceil(K / 256);
  return weight.parts.map((part, i) => {
    const partLabel = weight.parts.length > 1 ? `${label}#${i}` : label;
    const params = uniformBuffer(
      gpu,
      `${partLabel}.params`,
      [K, part.firstRow, part.rowCount, rowWords, tokens, b.scale ?? 1, 0, 0],
      'uuuuufuu',
    );
    return {
      label: partLabel,
      pipeline,
      bindGroup: bindBuffers(gpu, partLabel, pipeline, [part.buffer, b.tokenIds, b.output, params]),
      workgroups: [groupsK, tokens, 1] as const,
      owned: [params],
    };
  });
}
