import { InvalidRequestError } from '../core/errors.ts';
import type { GgmlType } from '../core/gguf-types.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from '../core/gpu/dispatch.ts';
import type { GatedActivation } from './elementwise.wgsl.ts';
import {
  DEFAULT_MATMUL_VARIANT,
  isDenseMatvecType,
  MATVEC_ROWS_PER_WORKGROUP,
  type MatmulVariant,
  matmulTileShape,
  matmulWgsl,
  matvecBuildFor,
  matvecGroupWgsl,
  matvecSwigluWgsl,
  matvecThreads,
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
  /** Add the product to what `output` holds (y += W·x: a residual connection) instead of overwriting it. */
  accumulate?: boolean;
}

export interface MatmulOptions {
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
  if (isDenseMatvecType(type)) return packedRowWords(type, rowLength);
  return (rowLength / weightLayout(type).blockSize) * matvecUnitsPerBlock(type);
}

/** Threads of the matvec workgroup for a weight of this type and row length (matvecThreads). */
export function matvecThreadsFor(type: GgmlType, rowLength: number): number {
  return matvecThreads(matvecUnitsPerRow(type, rowLength));
}

/**
 * The tiled kernel for a matmul of `rows` weight rows over `tokens` tokens: 64x64 once its grid has 256 workgroups or
 * more, where it measured faster; below that a large GPU's SMs outnumber its workgroups and 32x32's four times as many
 * win (bench/results/2026-11-29-nvidia-h200-matmul-micro.md).
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
  const accumulate = b.accumulate ?? false;
  const code = matvec
    ? matvecWgsl(weight.type, hasBias, accumulate, matvecThreadsFor(weight.type, K), matvecBuildFor(gpu.features))
    : matmulWgsl(weight.type, hasBias, variant, accumulate);
  const pipeline = computePipeline(gpu, matvec ? 'matvec' : `matmul ${variant}`, code);
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

/** One matvec of a group: a whole weight (one part), its output and optional bias. */
export interface MatvecGroupEntry {
  weight: GpuWeight;
  /** f32 [weight.rows] */
  output: GPUBuffer;
  /** f32 [weight.rows] */
  bias?: GPUBuffer;
}

/**
 * Several matvecs over one input x (tokens = 1) as one dispatch, e.g. a decode step's q, k and v: two dependent
 * dispatches fewer per layer, each a launch gap the GPU idles through
 * (bench/results/2026-11-30-nvidia-h200-session5-fused-profiles.txt). The same floats
 * as one prepareMatmul per weight. Null when it cannot be one dispatch (a weight split into parts, row lengths that
 * differ, more storage bindings than the device allows): the caller then prepares them one by one.
 */
export function prepareMatvecGroup(
  gpu: GpuContext,
  label: string,
  input: GPUBuffer,
  entries: readonly MatvecGroupEntry[],
): PreparedDispatch | null {
  if (entries.length === 0) throw new InvalidRequestError(`Matvec group '${label}' has no weights.`);
  const K = entries[0].weight.rowLength;
  const storageBindings = 1 + entries.reduce((n, e) => n + (e.bias ? 3 : 2), 0);
  if (
    entries.some((e) => e.weight.parts.length !== 1 || e.weight.rowLength !== K) ||
    storageBindings > gpu.limits.maxStorageBuffersPerShaderStage
  ) {
    return null;
  }
  requireBytes(label, 'input', input, K * 4);
  const words = [K, 0, 0, 0];
  const memberBuffers: GPUBuffer[] = [];
  let groups = 0;
  for (const [i, e] of entries.entries()) {
    const w = e.weight;
    requireBytes(`${label}[${i}]`, 'output', e.output, w.rows * 4);
    if (e.bias) requireBytes(`${label}[${i}]`, 'bias', e.bias, w.rows * 4);
    words.push(w.rows, packedRowWords(w.type, K), matvecUnitsPerRow(w.type, K), groups);
    groups += Math.ceil(w.rows / MATVEC_ROWS_PER_WORKGROUP);
    memberBuffers.push(w.parts[0].buffer, e.output);
    if (e.bias) memberBuffers.push(e.bias);
  }
  const code = matvecGroupWgsl(
    entries.map((e) => ({
      type: e.weight.type,
      hasBias: e.bias !== undefined,
      threads: matvecThreadsFor(e.weight.type, K),
    })),
    matvecBuildFor(gpu.features),
  );
  const pipeline = computePipeline(gpu, 'matvec group', code);
  const params = uniformBuffer(gpu, `${label}.params`, words, 'u'.repeat(words.length));
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [input, params, ...memberBuffers]),
    workgroups: [...foldWorkgroups(gpu, groups), 1] as const,
    owned: [params],
  };
}

export interface MatvecSwigluBinding {
  gate: GpuWeight;
  up: GpuWeight;
  /** f32 [K] */
  input: GPUBuffer;
  /** f32 [rows]: silu(gate·x)·(up·x), or gelu(gate·x)·(up·x) with `activation` 'geglu' */
  output: GPUBuffer;
  /** Default 'swiglu'. */
  activation?: GatedActivation;
}

/**
 * The feed-forward's gate and up matvecs and SwiGLU as one dispatch (tokens = 1): two dependent dispatches fewer per
 * layer, the same floats as gate, up and swiglu dispatched apart. Null when it cannot be one dispatch (a weight
 * split into parts, shapes that differ).
 */
export function prepareMatvecSwiglu(gpu: GpuContext, label: string, b: MatvecSwigluBinding): PreparedDispatch | null {
  const { gate, up } = b;
  if (gate.parts.length !== 1 || up.parts.length !== 1 || gate.rows !== up.rows || gate.rowLength !== up.rowLength) {
    return null;
  }
  const K = gate.rowLength;
  requireBytes(label, 'input', b.input, K * 4);
  requireBytes(label, 'output', b.output, gate.rows * 4);
  const activation = b.activation ?? 'swiglu';
  const code = matvecSwigluWgsl(
    { type: gate.type, threads: matvecThreadsFor(gate.type, K) },
    { type: up.type, threads: matvecThreadsFor(up.type, K) },
    matvecBuildFor(gpu.features),
    activation,
  );
  const pipeline = computePipeline(gpu, `matvec ${activation}`, code);
  const params = uniformBuffer(
    gpu,
    `${label}.params`,
    [
      K,
      gate.rows,
      packedRowWords(gate.type, K),
      matvecUnitsPerRow(gate.type, K),
      packedRowWords(up.type, K),
      matvecUnitsPerRow(up.type, K),
      0,
      0,
    ],
    'uuuuuuuu',
  );
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [b.input, params, gate.parts[0].buffer, up.parts[0].buffer, b.output]),
    workgroups: [...foldWorkgroups(gpu, Math.ceil(gate.rows / MATVEC_ROWS_PER_WORKGROUP)), 1] as const,
    owned: [params],
  };
}
