/**
 * Weight matrices on the GPU: the packed layout of every supported GGML type, the repack from GGUF block bytes,
 * and the streaming upload (split by rows when a tensor exceeds the storage-binding limit).
 *
 * Packed layout (what the WGSL in matmul.wgsl.ts reads as `array<u32>`): rows are contiguous and every row starts
 * on a u32 word (`rowWords` words per row). ggml blocks are byte-exact copies of the GGUF block except that blocks
 * whose size is 2 mod 4 get two zero bytes inserted at `padAt`, so every field the kernels read starts on a word:
 *
 * | type | words | word layout of one packed block (byte offsets are the GGUF block's)                        |
 * | ---- | ----- | ------------------------------------------------------------------------------------------ |
 * | F32  | -     | row = K words                                                                               |
 * | F16  | -     | row = ceil(K/2) words, element 2i in the low half of word i; odd K pads the row with 0    |
 * | BF16 | -     | as F16 (bf16 bits; the kernel shifts them into f32 bits)                                    |
 * | Q4_0 | 5     | w0 = d (low 16 bits, pad above) · w1..4 = qs[16]                                            |
 * | Q4_1 | 5     | w0 = d | m << 16 · w1..4 = qs[16]                  (unchanged)                              |
 * | Q5_0 | 6     | w0 = d (pad above) · w1 = qh · w2..5 = qs[16]                                               |
 * | Q5_1 | 6     | w0 = d | m << 16 · w1 = qh · w2..5 = qs[16]        (unchanged)                              |
 * | Q8_0 | 9     | w0 = d (pad above) · w1..8 = qs[32] (int8)                                                  |
 * | Q4_K | 36    | w0 = d | dmin << 16 · w1..3 = scales[12] · w4..35 = qs[128]      (unchanged)               |
 * | Q5_K | 44    | w0 = d | dmin << 16 · w1..3 = scales[12] · w4..11 = qh[32] · w12..43 = qs[128] (unchanged)   |
 * | Q6_K | 53    | w0..31 = ql[128] · w32..47 = qh[64] · w48..51 = scales[16] (int8) · w52 = d (pad above)   |
 * | Q2_K | 21    | w0..3 = scales[16] · w4..19 = qs[64] · w20 = d | dmin << 16               (unchanged)          |
 * | Q3_K | 28    | w0..7 = hmask[32] · w8..23 = qs[64] · w24..26 = scales[12] · w27 = d (pad above)           |
 * | IQ4_NL | 5   | w0 = d (pad above) · w1..4 = qs[16]                                                         |
 * | IQ4_XS | 34  | w0 = d | scales_h << 16 · w1 = scales_l[4] · w2..33 = qs[128]                (unchanged)     |
 */
import { GpuOutOfMemoryError, UnsupportedModelError } from '../core/errors.ts';
import {
  type ByteSource,
  GGML_TYPE_INFO,
  GgmlType,
  type GgufTensorInfo,
  unsupportedWeightTypeAdvice,
} from '../core/gguf-types.ts';
import type { GpuContext } from '../core/gpu/device.ts';

export interface WeightLayout {
  /** Elements per ggml block (1 for F32/F16/BF16). */
  blockSize: number;
  /** Bytes per block in the GGUF file. */
  rawBlockBytes: number;
  /** u32 words per packed block (quantized types only; dense rows are packed per row). */
  packedBlockWords: number;
  /** Byte offset in the raw block where two zero bytes are inserted (-1: the block is copied as is). */
  padAt: number;
}

const Q = (blockSize: number, rawBlockBytes: number, padAt: number): WeightLayout => ({
  blockSize,
  rawBlockBytes,
  packedBlockWords: (rawBlockBytes + (padAt >= 0 ? 2 : 0)) / 4,
  padAt,
});

export const WEIGHT_LAYOUTS: Readonly<Partial<Record<GgmlType, WeightLayout>>> = {
  [GgmlType.F32]: { blockSize: 1, rawBlockBytes: 4, packedBlockWords: 1, padAt: -1 },
  [GgmlType.F16]: { blockSize: 1, rawBlockBytes: 2, packedBlockWords: 0, padAt: -1 },
  [GgmlType.BF16]: { blockSize: 1, rawBlockBytes: 2, packedBlockWords: 0, padAt: -1 },
  [GgmlType.Q4_0]: Q(32, 18, 2),
  [GgmlType.Q4_1]: Q(32, 20, -1),
  [GgmlType.Q5_0]: Q(32, 22, 2),
  [GgmlType.Q5_1]: Q(32, 24, -1),
  [GgmlType.Q8_0]: Q(32, 34, 2),
  [GgmlType.Q4_K]: Q(256, 144, -1),
  [GgmlType.Q5_K]: Q(256, 176, -1),
  [GgmlType.Q6_K]: Q(256, 210, 210),
  [GgmlType.Q2_K]: Q(256, 84, -1),
  [GgmlType.Q3_K]: Q(256, 110, 110),
  [GgmlType.IQ4_NL]: Q(32, 18, 2),
  [GgmlType.IQ4_XS]: Q(256, 136, -1),
};

export interface GpuWeightPart {
  buffer: GPUBuffer;
  firstRow: number;
  rowCount: number;
}

export interface GpuWeight {
  name: string;
  type: GgmlType;
  /** K = shape[0]: elements per row. */
  rowLength: number;
  /** N = shape[1]: number of rows. */
  rows: number;
  parts: GpuWeightPart[];
  /** Packed bytes on the GPU, all parts together. */
  byteLength: number;
}

export interface UploadWeightOptions {
  /** Caps the rows per GPU buffer (tests force splits on small tensors); the binding limit caps it anyway. */
  maxRowsPerPart?: number;
  /** Largest read from the source, in bytes (default 8 MiB); reads end on row boundaries. */
  maxChunkBytes?: number;
}

const DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024;

function typeName(type: GgmlType): string {
  return GGML_TYPE_INFO[type]?.name ?? `type ${type}`;
}

export function weightLayout(type: GgmlType): WeightLayout {
  const layout = WEIGHT_LAYOUTS[type];
  if (!layout) {
    throw new UnsupportedModelError(
      `Weights of type ${typeName(type)} are not supported; ${unsupportedWeightTypeAdvice(type)}.`,
      { type },
    );
  }
  return layout;
}

/** Bytes of one row in the GGUF file. */
export function rawRowBytes(type: GgmlType, rowLength: number): number {
  const l = weightLayout(type);
  return (rowLength / l.blockSize) * l.rawBlockBytes;
}

/** u32 words of one packed row on the GPU. */
export function packedRowWords(type: GgmlType, rowLength: number): number {
  if (type === GgmlType.F32) return rowLength;
  if (type === GgmlType.F16 || type === GgmlType.BF16) return Math.ceil(rowLength / 2);
  const l = weightLayout(type);
  return (rowLength / l.blockSize) * l.packedBlockWords;
}

/** Repacks `rows` whole rows of GGUF bytes into the packed layout above. */
export function packRows(type: GgmlType, rowLength: number, raw: Uint8Array, rows: number): Uint32Array {
  const l = weightLayout(type);
  const rowWords = packedRowWords(type, rowLength);
  const rawRow = rawRowBytes(type, rowLength);
  const out = new Uint32Array(rows * rowWords);
  const bytes = new Uint8Array(out.buffer);
  if (rawRow === rowWords * 4 && l.padAt < 0) {
    bytes.set(raw.subarray(0, rows * rawRow));
    return out;
  }
  if (l.padAt < 0) {
    // F16/BF16 with odd K: only the row stride changes.
    for (let r = 0; r < rows; r++) bytes.set(raw.subarray(r * rawRow, (r + 1) * rawRow), r * rowWords * 4);
    return out;
  }
  const blocks = rows * (rowLength / l.blockSize);
  const packedBytes = l.packedBlockWords * 4;
  for (let b = 0; b < blocks; b++) {
    const src = b * l.rawBlockBytes;
    const dst = b * packedBytes;
    bytes.set(raw.subarray(src, src + l.padAt), dst);
    if (l.padAt < l.rawBlockBytes) bytes.set(raw.subarray(src + l.padAt, src + l.rawBlockBytes), dst + l.padAt + 2);
  }
  return out;
}

interface WeightPlan {
  rowLength: number;
  rows: number;
  rowWords: number;
  rawRow: number;
  rowsPerPart: number;
  rowsPerChunk: number;
}

function planWeight(
  gpu: GpuContext,
  name: string,
  type: GgmlType,
  shape: readonly number[],
  byteLength: number,
  options: UploadWeightOptions,
): WeightPlan {
  const l = weightLayout(type);
  if (shape.length < 1 || shape.length > 4 || shape.slice(2).some((d) => d !== 1)) {
    throw new UnsupportedModelError(`Tensor '${name}' has shape [${shape.join(', ')}]; a weight matrix must be 2-D.`, {
      name,
      shape,
    });
  }
  const rowLength = shape[0];
  const rows = shape[1] ?? 1;
  if (rowLength % l.blockSize !== 0) {
    throw new UnsupportedModelError(
      `Tensor '${name}' has rows of ${rowLength} elements, not a multiple of the ${typeName(type)} block (${l.blockSize}).`,
      { name, shape },
    );
  }
  const rawRow = rawRowBytes(type, rowLength);
  if (byteLength !== rawRow * rows) {
    throw new UnsupportedModelError(
      `Tensor '${name}' (${typeName(type)} [${shape.join(', ')}]) should hold ${rawRow * rows} bytes but has ${byteLength}.`,
      { name, shape, byteLength },
    );
  }
  const rowWords = packedRowWords(type, rowLength);
  const limit = Math.min(gpu.limits.maxStorageBufferBindingSize, gpu.limits.maxBufferSize);
  const byLimit = Math.floor(limit / (rowWords * 4));
  if (byLimit < 1) {
    throw new GpuOutOfMemoryError(
      `One row of '${name}' needs ${rowWords * 4} bytes, more than this GPU can bind (${limit}).`,
      { name, limit },
    );
  }
  const rowsPerPart = Math.max(1, Math.min(byLimit, options.maxRowsPerPart ?? Number.POSITIVE_INFINITY, rows));
  const rowsPerChunk = Math.max(1, Math.floor((options.maxChunkBytes ?? DEFAULT_CHUNK_BYTES) / rawRow));
  return { rowLength, rows, rowWords, rawRow, rowsPerPart, rowsPerChunk };
}

/** Creates one GPU buffer per run of at most `rowsPerPart` rows. */
function allocateParts(gpu: GpuContext, name: string, plan: WeightPlan): GpuWeightPart[] {
  const parts: GpuWeightPart[] = [];
  for (let firstRow = 0; firstRow < plan.rows; firstRow += plan.rowsPerPart) {
    const rowCount = Math.min(plan.rowsPerPart, plan.rows - firstRow);
    const buffer = gpu.allocator.createBuffer({
      label: parts.length === 0 && firstRow + rowCount === plan.rows ? name : `${name}#${parts.length}`,
      category: 'weights',
      size: rowCount * plan.rowWords * 4,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC,
    });
    parts.push({ buffer, firstRow, rowCount });
  }
  return parts;
}

/** Row ranges of at most `rowsPerChunk` rows that never cross a part boundary. */
function* chunksOf(plan: WeightPlan, parts: GpuWeightPart[]) {
  for (const part of parts) {
    for (let r = 0; r < part.rowCount; r += plan.rowsPerChunk) {
      yield {
        part,
        localRow: r,
        firstRow: part.firstRow + r,
        rowCount: Math.min(plan.rowsPerChunk, part.rowCount - r),
      };
    }
  }
}

function writeChunk(
  gpu: GpuContext,
  type: GgmlType,
  plan: WeightPlan,
  buffer: GPUBuffer,
  localRow: number,
  raw: Uint8Array,
  rowCount: number,
) {
  const packed = packRows(type, plan.rowLength, raw, rowCount);
  gpu.device.queue.writeBuffer(buffer, localRow * plan.rowWords * 4, packed.buffer, 0, packed.byteLength);
}

function weightOf(name: string, type: GgmlType, plan: WeightPlan, parts: GpuWeightPart[]): GpuWeight {
  return {
    name,
    type,
    rowLength: plan.rowLength,
    rows: plan.rows,
    parts,
    byteLength: plan.rows * plan.rowWords * 4,
  };
}

/**
 * Streams a tensor's GGUF bytes into GPU buffers (category 'weights'), repacking on the way. Reads are at most
 * `maxChunkBytes` (8 MiB) and end on row boundaries, so a large tensor is never held whole in memory.
 */
export async function uploadWeight(
  gpu: GpuContext,
  tensor: GgufTensorInfo,
  source: ByteSource,
  options: UploadWeightOptions = {},
): Promise<GpuWeight> {
  const plan = planWeight(gpu, tensor.name, tensor.type, tensor.shape, tensor.byteLength, options);
  const parts = allocateParts(gpu, tensor.name, plan);
  try {
    for (const c of chunksOf(plan, parts)) {
      const raw = await source.read(tensor.offset + c.firstRow * plan.rawRow, c.rowCount * plan.rawRow);
      writeChunk(gpu, tensor.type, plan, c.part.buffer, c.localRow, raw, c.rowCount);
    }
  } catch (error) {
    for (const p of parts) gpu.allocator.release(p.buffer);
    throw error;
  }
  return weightOf(tensor.name, tensor.type, plan, parts);
}

/** Uploads a weight whose GGUF bytes are already in memory (tests, tools). */
export function uploadWeightFromBytes(
  gpu: GpuContext,
  name: string,
  type: GgmlType,
  shape: readonly number[],
  bytes: Uint8Array,
  options: UploadWeightOptions = {},
): GpuWeight {
  const plan = planWeight(gpu, name, type, shape, bytes.byteLength, options);
  const parts = allocateParts(gpu, name, plan);
  for (const c of chunksOf(plan, parts)) {
    const start = c.firstRow * plan.rawRow;
    writeChunk(
      gpu,
      type,
      plan,
      c.part.buffer,
      c.localRow,
      bytes.subarray(start, start + c.rowCount * plan.rawRow),
      c.rowCount,
    );
  }
  return weightOf(name, type, plan, parts);
}

export function releaseWeight(gpu: GpuContext, weight: GpuWeight): void {
  for (const p of weight.parts) gpu.allocator.release(p.buffer);
  weight.parts = [];
}
