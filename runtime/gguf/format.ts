/**
 * Facts about the GGUF container that the parser and the writer must agree on: magic, alignment, value type ids,
 * and how many bytes a tensor of a given shape and type occupies.
 */
import {
  GGML_TYPE_INFO,
  type GgmlType,
  type GgufMetadataType,
  type GgufScalarTypeName,
  GgufValueType,
} from '../../core/gguf-types.ts';

export const GGUF_WRITE_VERSION = 3;
export const GGUF_DEFAULT_ALIGNMENT = 32;
export const GGUF_ALIGNMENT_KEY = 'general.alignment';
/** ggml tensors have at most four dimensions. */
export const GGML_MAX_DIMS = 4;
/** ggml's GGML_MAX_NAME is 64 including the terminating NUL; llama.cpp rejects longer tensor names. */
export const GGML_MAX_TENSOR_NAME_BYTES = 63;

export const SCALAR_TYPE_IDS: Readonly<Record<GgufScalarTypeName, GgufValueType>> = {
  u8: GgufValueType.UINT8,
  i8: GgufValueType.INT8,
  u16: GgufValueType.UINT16,
  i16: GgufValueType.INT16,
  u32: GgufValueType.UINT32,
  i32: GgufValueType.INT32,
  f32: GgufValueType.FLOAT32,
  bool: GgufValueType.BOOL,
  string: GgufValueType.STRING,
  u64: GgufValueType.UINT64,
  i64: GgufValueType.INT64,
  f64: GgufValueType.FLOAT64,
};

export const SCALAR_TYPE_NAMES: Readonly<Partial<Record<GgufValueType, GgufScalarTypeName>>> = Object.fromEntries(
  Object.entries(SCALAR_TYPE_IDS).map(([name, id]) => [id, name]),
);

/** Bytes of a fixed-size scalar value; strings and arrays are variable. */
export const SCALAR_BYTE_SIZES: Readonly<Partial<Record<GgufValueType, number>>> = {
  [GgufValueType.UINT8]: 1,
  [GgufValueType.INT8]: 1,
  [GgufValueType.BOOL]: 1,
  [GgufValueType.UINT16]: 2,
  [GgufValueType.INT16]: 2,
  [GgufValueType.UINT32]: 4,
  [GgufValueType.INT32]: 4,
  [GgufValueType.FLOAT32]: 4,
  [GgufValueType.UINT64]: 8,
  [GgufValueType.INT64]: 8,
  [GgufValueType.FLOAT64]: 8,
};

/** Splits `'f32[]'` / `{ array: … }` into the array's item type; null for scalars. */
export function arrayItemType(type: GgufMetadataType): GgufMetadataType | null {
  if (typeof type === 'object') return type.array;
  return type.endsWith('[]') ? (type.slice(0, -2) as GgufScalarTypeName) : null;
}

/** Canonical spelling: one level of array as `'x[]'`, deeper nesting as `{ array: … }`. */
export function arrayTypeOf(item: GgufMetadataType): GgufMetadataType {
  return typeof item === 'string' && !item.endsWith('[]') ? `${item as GgufScalarTypeName}[]` : { array: item };
}

export function alignUp(offset: number, alignment: number): number {
  return Math.ceil(offset / alignment) * alignment;
}

export function isValidAlignment(alignment: number): boolean {
  return Number.isInteger(alignment) && alignment > 0 && alignment <= 2 ** 30 && (alignment & (alignment - 1)) === 0;
}

/**
 * Why a shape cannot hold a tensor of this type (null when it can): dims must be positive integers, the innermost one
 * a whole number of blocks, and the byte size must stay an exact JS number.
 */
export function tensorLayoutProblem(shape: readonly number[], type: GgmlType): string | null {
  const info = GGML_TYPE_INFO[type];
  if (!info) return `GGML type ${type} is unknown`;
  if (shape.length < 1 || shape.length > GGML_MAX_DIMS) {
    return `it has ${shape.length} dimensions (ggml allows 1 to ${GGML_MAX_DIMS})`;
  }
  let elements = 1;
  for (const dim of shape) {
    if (!Number.isSafeInteger(dim) || dim <= 0) return `dimension ${dim} is not a positive integer`;
    elements *= dim;
    if (!Number.isSafeInteger(elements)) return `its shape [${shape.join(', ')}] has too many elements`;
  }
  if (shape[0] % info.blockSize !== 0) {
    return `its innermost dimension ${shape[0]} is not a multiple of the ${info.name} block size ${info.blockSize}`;
  }
  if (!Number.isSafeInteger((elements / info.blockSize) * info.blockBytes)) {
    return `its shape [${shape.join(', ')}] is too large`;
  }
  return null;
}

/** Bytes of a tensor whose layout `tensorLayoutProblem` accepted. */
export function tensorByteLength(shape: readonly number[], type: GgmlType): number {
  const info = GGML_TYPE_INFO[type]!;
  const elements = shape.reduce((product, dim) => product * dim, 1);
  return (elements / info.blockSize) * info.blockBytes;
}
