/**
 * One randomized comparison of the int8 matmul (kernels/matmul-int8.ts) with its CPU reference, shared by
 * kernels/matmul-int8.test.ts and the device run (bench/int8-matmul.ts: CI adapters have no subgroup matrices).
 *
 * Two checks: the GPU's activation codes against the CPU quantizer (at most one code apart, where a WGSL division's
 * last ulp moves a value across .5), and y against the weights times the activations those GPU codes represent
 * (f32 accumulation: 1e-4 of Σ|w·x̂| per output, as kernels/matmul.test.ts).
 */

import { GgmlType } from '../core/gguf-types.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readBuffer, readFloat32 } from '../core/gpu/readback.ts';
import {
  createInt8Activations,
  prepareInt8Matmul,
  prepareQuantizeActivations,
  releaseInt8Activations,
} from '../kernels/matmul-int8.ts';
import { INT8_MATMUL_TILES, type Int8MatmulVariant, int8MatmulSupportsType } from '../kernels/matmul-int8.wgsl.ts';
import { dequantize, randomWeightBytes } from '../kernels/reference/dequantize.ts';
import { matmulReference, maxErrorRelativeToMagnitude } from '../kernels/reference/matmul.ts';
import { dequantizeActivations, quantizeActivationsReference } from '../kernels/reference/matmul-int8.ts';
import { releaseWeight, uploadWeightFromBytes } from '../kernels/weights.ts';
import { randomFloats, seededRandom } from './random.ts';
import { mutateShaders } from './shader-mutation.ts';

export interface Int8MatmulCase {
  tokens: number;
  rows: number;
  bias: boolean;
  accumulate?: boolean;
  maxRowsPerPart?: number;
  variant: Int8MatmulVariant;
}

export interface Int8MatmulCaseResult {
  /** Worst |y - reference| / (1e-6 + 1e-4·Σ|w·x̂|): <= 1 passes. */
  error: number;
  /** Largest difference between a GPU code and the CPU quantizer's. */
  codeDistance: number;
  /** Codes that differ from the CPU quantizer's. */
  codeMismatches: number;
  /** Worst |y - W·x| / Σ|w·x| against the f32 activations: what the int8 activations cost (reported, not bounded). */
  quantizationError: number;
}

export async function runInt8MatmulCase(
  gpu: GpuContext,
  type: GgmlType,
  K: number,
  c: Int8MatmulCase,
  transformSource?: (code: string) => string,
): Promise<Int8MatmulCaseResult> {
  const random = seededRandom(type * 7919 + K * 31 + c.tokens * 7 + c.rows + (c.bias ? 1 : 0));
  const N = c.rows;
  const raw = randomWeightBytes(type, K * N, random);
  // Blocks of very different magnitudes, as real activations have (outlier channels).
  const x = randomFloats(random, c.tokens * K, 1);
  for (let i = 0; i < x.length; i += 32) {
    const scale = 10 ** (random() * 3 - 1.5);
    for (let e = 0; e < 32; e++) x[i + e] *= scale;
  }
  const bias = c.bias ? randomFloats(random, N, 0.5) : undefined;
  const weight = uploadWeightFromBytes(gpu, 'w', type, [K, N], raw, { maxRowsPerPart: c.maxRowsPerPart });
  const input = gpu.allocator.createStorage('x', 'scratch', x);
  const initial = c.accumulate ? randomFloats(random, c.tokens * N, 3) : new Float32Array(c.tokens * N);
  const output = gpu.allocator.createStorage('y', 'scratch', initial);
  const biasBuffer = bias ? gpu.allocator.createStorage('bias', 'weights', bias) : undefined;
  const activations = createInt8Activations(gpu, 'int8', c.tokens, K);
  // A rebuilt kernel compiles on a view of the device whose int8 matmul modules are the rebuilt code.
  const target = transformSource
    ? mutateShaders(gpu, { label: /^matmul-int8 /, edit: transformSource, mayKeep: true })
    : null;
  const dispatches = [
    prepareQuantizeActivations(gpu, 'quantize', { input, activations, tokens: c.tokens, K }),
    ...prepareInt8Matmul(
      target?.gpu ?? gpu,
      'int8-matmul',
      { weight, activations, output, tokens: c.tokens, bias: biasBuffer, accumulate: c.accumulate },
      c.variant,
    ),
  ];
  submitDispatches(gpu, 'int8-matmul', dispatches);
  const actual = await readFloat32(gpu, output, c.tokens * N);
  const codes = new Int8Array(await readBuffer(gpu, activations.codes, c.tokens * K));
  const scales = await readFloat32(gpu, activations.scales, (c.tokens * K) / 16);
  releaseDispatches(gpu, dispatches);
  releaseWeight(gpu, weight);
  releaseInt8Activations(gpu, activations);
  for (const b of [input, output, biasBuffer]) if (b) gpu.allocator.release(b);

  const expectedCodes = quantizeActivationsReference(x, c.tokens, K).codes;
  let codeDistance = 0;
  let codeMismatches = 0;
  for (let i = 0; i < codes.length; i++) {
    const d = Math.abs(codes[i] - expectedCodes[i]);
    codeDistance = Math.max(codeDistance, d);
    if (d > 0) codeMismatches++;
  }
  const w = dequantize(type, raw, K * N);
  const xq = dequantizeActivations(codes, scales, c.tokens, K);
  const { y, magnitude } = matmulReference(w, xq, K, N, c.tokens, bias);
  const exact = matmulReference(w, x, K, N, c.tokens, bias);
  let quantizationError = 0;
  for (let i = 0; i < y.length; i++) {
    quantizationError = Math.max(quantizationError, Math.abs(actual[i] - initial[i] - exact.y[i]) / exact.magnitude[i]);
    y[i] += initial[i];
    magnitude[i] += Math.abs(initial[i]);
  }
  return {
    error: maxErrorRelativeToMagnitude(actual, y, magnitude, 1e-4),
    codeDistance,
    codeMismatches,
    quantizationError,
  };
}

/** Weight types and K: K not a multiple of the 64-token tile's K steps beyond one block where the type allows. */
export const INT8_MATMUL_TYPES: [string, GgmlType, number][] = [
  ['Q4_0', GgmlType.Q4_0, 288],
  ['Q4_1', GgmlType.Q4_1, 288],
  ['Q5_0', GgmlType.Q5_0, 288],
  ['Q5_1', GgmlType.Q5_1, 288],
  ['Q8_0', GgmlType.Q8_0, 288],
  ['Q4_K', GgmlType.Q4_K, 768],
  ['Q5_K', GgmlType.Q5_K, 768],
  ['Q6_K', GgmlType.Q6_K, 768],
];

/** Every tensor-core tile, and the dot4I8Packed kernel that every adapter runs. */
export const INT8_MATMUL_VARIANTS: readonly Int8MatmulVariant[] = [
  ...(Object.keys(INT8_MATMUL_TILES) as Int8MatmulVariant[]),
  'dot4',
];

/** The cases of a weight type: those of the kernels that read it (Q6_K: dot4I8Packed only). */
export function int8MatmulCasesFor(type: GgmlType): Int8MatmulCase[] {
  return INT8_MATMUL_CASES.filter((c) => int8MatmulSupportsType(type, c.variant));
}

export const INT8_MATMUL_CASES: Int8MatmulCase[] = INT8_MATMUL_VARIANTS.flatMap((variant) => [
  { tokens: 2, rows: 37, bias: true, variant },
  { tokens: 67, rows: 70, bias: false, variant, maxRowsPerPart: 48 },
  { tokens: 130, rows: 131, bias: true, accumulate: true, variant },
]);
