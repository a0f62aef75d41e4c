import { InvalidRequestError } from '../runtime/errors.ts';
import { GgmlType } from '../runtime/gguf/types.ts';
import type { GpuContext } from '../runtime/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from './dispatch.ts';
import {
  DEFAULT_MATMUL_VARIANT,
  MATVEC_ROWS_PER_WORKGROUP,
  type MatmulVariant,
  matmulTileShape,
  matmulWgsl,
  matvecUnitsPerBlock,
  matvecWgsl,
} from './matmul.wgsl.ts';
import { type GpuWeight, packedRowWords, weightLayout } from './weights.ts';

export interface MatmulBinding {
  weight: GpuWeight;
  /** f32 [tokens, K] */
  input: GPUBuffer;
  /** f32 [tokens, N] */
  output: GPUBuffer;
  tokens: number;
  /** f32 [N] */
  bias?: GPUBuffer;
}

export interface MatmulOptions {
  /** Rewrites the generated WGSL (tests use it to prove a broken kernel fails). */
  transformSource?: (code: string) => string;
  /** The tiled kernel for tokens > 1 (default DEFAULT_MATMUL_VARIANT); tokens = 1 always uses the matvec. */
  variant?: MatmulVariant;
}

/** Splits `count` workgroups into x*y <= maxPerDimension each; kernels recover the index as x + y * nwg.x. */
export function foldWorkgroups(gpu: GpuContext, count: number): [number, number] {
  const max = gpu.limits.maxComputeWorkgroupsPerDimension;
  if (count <= max) return [Math.max(1, count), 1];
  const y = Math.ceil(count / max);
  return [Math.ceil(count / y), y];
}

/** Out-of-range reads and writes are silently clamped on WebGPU, so buffer sizes are checked up front. */
export function requireBytes(label: string, role: string, buffer: GPUBuffer, bytes: number): void {
  if (buffer.size < bytes) {
    throw new InvalidRequestError(`'${label}' needs ${bytes} bytes of ${role} but the buffer has ${buffer.size}.`, {
      label,
      role,
    });
  }
}

/** Matvec units in one row: words for dense types, blocks x units-per-block for quantized ones. */
export function matvecUnitsPerRow(type: GgmlType, rowLength: number): number {
  if (type === GgmlType.F32 || type === GgmlType.F16 || type === GgmlType.BF16) {
    return packedRowWords(type, rowLength);
  }
  return (rowLength / weightLayout(type).blockSize) * matvecUnitsPerBlock(type);
}

/**
 * The tiled kernel for a matmul of `rows` weight rows over `tokens` tokens. Measured on an H200
 * (bench/results/2026-11-29-nvidia-h200-matmul-micro.md): 64x64 is 1.6-1.7x faster than 32x32 once its grid has
 * ~256 workgroups or more, and 0.8x on smaller grids (2048 rows x 128 tokens: 64 workgroups for 132 SMs), where
 * 32x32's four times as many workgroups win.
 */
export function defaultMatmulVariant(rows: number, tokens: number): MatmulVariant {
  return Math.ceil(rows / 64) * Math.ceil(tokens / 64) >= 256 ? '64x64' : DEFAULT_MATMUL_VARIANT;
}

/**
 * y[t, n] = Σ_k W[n, k]·x[t, k] (+ bias[n]). tokens = 1 uses the matvec kernel, tokens > 1 the tiled matmul.
 * One dispatch per weight part; each writes its own row range of y.
 */
export function prepareMatmul(
  gpu: GpuContext,
  label: string,
  b: MatmulBinding,
  options: MatmulOptions = {},
): PreparedDispatch[] {
  const { weight, tokens } = b;
  if (!Number.isInteger(tokens) || tokens < 1) {
    throw new InvalidRequestError(`Matmul '${label}' needs tokens >= 1, got ${tokens}.`);
  }
  const K = weight.rowLength;
  requireBytes(label, 'input', b.input, tokens * K * 4);
  requireBytes(label, 'output', b.output, tokens * weight.rows * 4);
  if (b.bias) requireBytes(label, 'bias', b.bias, weight.rows * 4);
  const matvec = tokens === 1;
  const hasBias = b.bias !== undefined;
  const variant = options.variant ?? defaultMatmulVariant(weight.rows, tokens);
  const tile = matmulTileShape(variant);
  const code = matvec ? matvecWgsl(weight.type, hasBias) : matmulWgsl(weight.type, hasBias, variant);
  const pipeline = computePipeline(
    gpu,
    matvec ? 'matvec' : `matmul ${variant}`,
    options.transformSource ? options.transformSource(code) : code,
  );
  const rowWords = packedRowWords(weight.type, K);
  const unitsPerRow = matvecUnitsPerRow(weight.type, K);
  const tokenTiles = Math.ceil(tokens / tile.tokens);
  if (tokenTiles > gpu.limits.maxComputeWorkgroupsPerDimension) {
    throw new InvalidRequestError(
      `Matmul '${label}' over ${tokens} tokens exceeds the dispatch limit; split the batch.`,
    );
  }
  return weight.parts.map((part, i) => {
    const partLabel = weight.parts.length > 1 ? `${label}#${i}` : label;
    const params = uniformBuffer(
      gpu,
      `${partLabel}.params`,
      [K, part.rowCount, tokens, rowWords, unitsPerRow, part.firstRow, weight.rows, 0],
      'uuuuuuuu',
    );
    const buffers = [part.buffer, b.input, b.output, params];
    if (b.bias) buffers.push(b.bias);
    const groups = matvec
      ? foldWorkgroups(gpu, Math.ceil(part.rowCount / MATVEC_ROWS_PER_WORKGROUP))
      : foldWorkgroups(gpu, Math.ceil(part.rowCount / tile.rows));
    return {
      label: partLabel,
      pipeline,
      bindGroup: bindBuffers(gpu, partLabel, pipeline, buffers),
      workgroups: [groups[0], groups[1], matvec ? 1 : tokenTiles] as const,
      owned: [params],
    };
  });
}
