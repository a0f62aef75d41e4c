import { InvalidRequestError } from '../core/errors.ts';
import type { GgmlType } from '../core/gguf-types.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import {
  bindBuffers,
  computePipeline,
  linearInvocationGrid,
  type PreparedDispatch,
  uniformBuffer,
} from '../core/gpu/dispatch.ts';
import type { GatedActivation } from './elementwise.wgsl.ts';
import { foldWorkgroups, requireBytes } from './matmul.ts';
import {
  INT8_MATMUL_TILES,
  INT8_TOKEN_PADDING,
  type Int8MatmulVariant,
  int8MatmulSupportsType,
  int8VariantShape,
  int8VariantWgsl,
  int8WorkgroupBytes,
  QUANTIZE_ACTIVATIONS_WORKGROUP,
  quantizeActivationsWgsl,
} from './matmul-int8.wgsl.ts';
import { type GpuWeight, packedRowWords } from './weights.ts';

/** The int8 activations of one matmul input: codes [paddedTokens, K] (4 per word) and (d, d·Σq) per 32-block. */
export interface Int8Activations {
  codes: GPUBuffer;
  scales: GPUBuffer;
  /** Capacity: tokens (a multiple of INT8_TOKEN_PADDING) and K the buffers were sized for. */
  tokens: number;
  K: number;
}

function paddedTokens(tokens: number): number {
  return Math.ceil(tokens / INT8_TOKEN_PADDING) * INT8_TOKEN_PADDING;
}

/** Scratch for the activations of matmuls over up to `tokens` tokens and rows of up to `K` elements. */
export function createInt8Activations(gpu: GpuContext, label: string, tokens: number, K: number): Int8Activations {
  const padded = paddedTokens(tokens);
  return {
    codes: gpu.allocator.createStorage(`${label}.codes`, 'scratch', padded * K),
    scales: gpu.allocator.createStorage(`${label}.scales`, 'scratch', padded * (K / 32) * 8),
    tokens: padded,
    K,
  };
}

export function releaseInt8Activations(gpu: GpuContext, a: Int8Activations): void {
  gpu.allocator.release(a.codes);
  gpu.allocator.release(a.scales);
}

/** Whether this device runs the int8 matmul (`variant`: a tensor-core tile, or 'dot4') for weights of `type`. */
export function int8MatmulAvailable(gpu: GpuContext, type: GgmlType, variant: Int8MatmulVariant = '32x32'): boolean {
  if (!int8MatmulSupportsType(type, variant)) return false;
  if (variant === 'dot4') return true;
  return (
    gpu.features.subgroupMatrixI8 &&
    int8WorkgroupBytes(INT8_MATMUL_TILES[variant]) <= gpu.limits.maxComputeWorkgroupStorageSize
  );
}

/**
 * The int8 kernel for a weight over `tokens` tokens on a device with tensor cores: dot4I8Packed's 64x64 tiles once
 * their grid has 256 workgroups (its sums need no trip through workgroup memory), the 32x32 tensor-core tile below
 * that, and dot4I8Packed for the types no tensor-core tile reads (Q6_K). The 64x64 tensor-core tile is never the
 * pick: it was rarely the fastest, and then only by little (bench/int8-matmul.ts;
 * bench/results/2026-12-01-nvidia-h200-session12-int8-matmul-dot4.json).
 */
export function defaultInt8Variant(gpu: GpuContext, weight: GpuWeight, tokens: number): Int8MatmulVariant {
  const grid = Math.ceil(weight.rows / 64) * Math.ceil(tokens / 64);
  return grid >= 256 || !int8MatmulAvailable(gpu, weight.type, '32x32') ? 'dot4' : '32x32';
}

/**
 * Whether `code` compiles into a compute pipeline on this device, its errors caught (not left to the device's
 * uncaptured-error handler).
 */
export async function pipelineCompiles(gpu: GpuContext, code: string): Promise<boolean> {
  const { device } = gpu;
  device.pushErrorScope('validation');
  device.pushErrorScope('internal');
  const module = device.createShaderModule({ label: 'probe', code });
  device.createComputePipeline({ label: 'probe', layout: 'auto', compute: { module, entryPoint: 'main' } });
  const internal = await device.popErrorScope();
  const validation = await device.popErrorScope();
  return internal === null && validation === null;
}

/**
 * Whether the activation quantizer and the int8 matmul (`kernel`: the tensor-core one, or 'dot4') compile for the
 * first of `types` it reads. A browser can offer the subgroup-matrix feature with a WGSL that lacks a form the kernel
 * uses (subgroup_id, the templated subgroupMatrixLoad), or lack the packed 8-bit dot product the quantizer and 'dot4'
 * use (a WGSL language feature): the f32 kernels run instead.
 */
export async function int8MatmulCompiles(
  gpu: GpuContext,
  types: readonly GgmlType[],
  kernel: '32x32' | 'dot4' = '32x32',
): Promise<boolean> {
  const type = types.find((t) => int8MatmulAvailable(gpu, t, kernel));
  if (type === undefined) return false;
  return (
    (await pipelineCompiles(gpu, quantizeActivationsWgsl())) &&
    pipelineCompiles(gpu, int8VariantWgsl(type, kernel, false))
  );
}

export interface QuantizeActivationsBinding {
  /** f32 [tokens, K] */
  input: GPUBuffer;
  /** f32 [tokens, K]: quantize silu(input)·up instead (input the gate; the SwiGLU fused into the quantizer). */
  up?: GPUBuffer;
  /** With `up`: gelu(input)·up instead of silu ('geglu'); default 'swiglu'. */
  activation?: GatedActivation;
  activations: Int8Activations;
  tokens: number;
  K: number;
}

/**
 * x (or silu(x)·up) -> int8 codes per 32-element block (kernels/matmul-int8.wgsl.ts); token rows past `tokens` get
 * zeros.
 */
export function prepareQuantizeActivations(
  gpu: GpuContext,
  label: string,
  b: QuantizeActivationsBinding,
): PreparedDispatch {
  const { activations: a, tokens, K } = b;
  if (K % 32 !== 0 || K > a.K || tokens > a.tokens || tokens < 1) {
    throw new InvalidRequestError(
      `'${label}': int8 activations of ${tokens} tokens x ${K} do not fit ${a.tokens} x ${a.K} (K a multiple of 32).`,
    );
  }
  requireBytes(label, 'input', b.input, tokens * K * 4);
  if (b.up) requireBytes(label, 'up', b.up, tokens * K * 4);
  const padded = paddedTokens(tokens);
  const gated = b.up !== undefined ? (b.activation ?? 'swiglu') : null;
  // The plain and SwiGLU builds keep the label they had; GeGLU's is its own.
  const pipeline = computePipeline(
    gpu,
    gated === 'geglu' ? 'quantize-activations-geglu' : 'quantize-activations',
    quantizeActivationsWgsl(gated),
  );
  const params = uniformBuffer(gpu, `${label}.params`, [K, tokens, padded, 0], 'uuuu');
  const inputs = [b.input, a.codes, a.scales, params, ...(b.up ? [b.up] : [])];
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, inputs),
    workgroups: linearInvocationGrid((padded * K) / 32, QUANTIZE_ACTIVATIONS_WORKGROUP),
    owned: [params],
  };
}

export interface Int8MatmulBinding {
  weight: GpuWeight;
  /** Quantized by prepareQuantizeActivations over the same tokens and K = weight.rowLength. */
  activations: Int8Activations;
  /** f32 [tokens, N] */
  output: GPUBuffer;
  tokens: number;
  bias?: GPUBuffer;
  accumulate?: boolean;
}

/** y[t, n] = Σ_k W[n, k]·x[t, k] (+ bias) from int8 activations: one dispatch per weight part. */
export function prepareInt8Matmul(
  gpu: GpuContext,
  label: string,
  b: Int8MatmulBinding,
  variant: Int8MatmulVariant = defaultInt8Variant(gpu, b.weight, b.tokens),
): PreparedDispatch[] {
  const { weight, tokens } = b;
  const K = weight.rowLength;
  if (!int8MatmulAvailable(gpu, weight.type, variant)) {
    throw new InvalidRequestError(`'${label}': this device has no int8 matmul for these weights.`);
  }
  if (tokens > b.activations.tokens || K > b.activations.K) {
    throw new InvalidRequestError(`'${label}': ${tokens} tokens x ${K} exceed the int8 activations' capacity.`);
  }
  requireBytes(label, 'output', b.output, tokens * weight.rows * 4);
  if (b.bias) requireBytes(label, 'bias', b.bias, weight.rows * 4);
  const shape = int8VariantShape(variant);
  const code = int8VariantWgsl(weight.type, variant, b.bias !== undefined, b.accumulate ?? false);
  const pipeline = computePipeline(gpu, `matmul-int8 ${variant}`, code);
  const rowWords = packedRowWords(weight.type, K);
  const tokenTiles = Math.ceil(tokens / shape.tokens);
  return weight.parts.map((part, i) => {
    const partLabel = weight.parts.length > 1 ? `${label}#${i}` : label;
    const params = uniformBuffer(
      gpu,
      `${partLabel}.params`,
      [K, part.rowCount, tokens, rowWords, part.firstRow, weight.rows, 0, 0],
      'uuuuuuuu',
    );
    const buffers = [part.buffer, b.activations.codes, b.activations.scales, b.output, params];
    if (b.bias) buffers.push(b.bias);
    const groups = foldWorkgroups(gpu, Math.ceil(part.rowCount / shape.rows));
    return {
      label: partLabel,
      pipeline,
      bindGroup: bindBuffers(gpu, partLabel, pipeline, buffers),
      workgroups: [groups[0], groups[1], tokenTiles] as const,
      owned: [params],
    };
  });
}
