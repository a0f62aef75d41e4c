/**
 * The project's one GGUF writer (v3, little-endian): test fixtures, tools and converted models all go through it.
 * llama.cpp checks metadata types exactly (a u32 key stored as i32 fails to load), so numbers carry an explicit type;
 * only strings, bools and string arrays are inferred.
 */
import { InvalidRequestError } from '../../core/errors.ts';
import {
  GGML_TYPE_INFO,
  GGUF_MAGIC,
  type GgmlType,
  type GgufFile,
  type GgufMetadataType,
  type GgufScalarTypeName,
  type GgufValue,
  GgufValueType,
} from '../../core/gguf-types.ts';
import {
  alignUp,
  arrayItemType,
  arrayTypeOf,
  GGML_MAX_TENSOR_NAME_BYTES,
  GGUF_ALIGNMENT_KEY,
  GGUF_DEFAULT_ALIGNMENT,
  GGUF_WRITE_VERSION,
  isValidAlignment,
  SCALAR_TYPE_IDS,
  tensorByteLength,
  tensorLayoutProblem,
} from './format.ts';

export interface GgufMetadataEntry {
  key: string;
  value: GgufValue;
  /** Required for numbers and bigints; inferred for strings, bools and (nested) arrays of strings. */
  type?: GgufMetadataType;
}

export interface TypedGgufValue {
  type: GgufMetadataType;
  value: GgufValue;
}

/** Entries in file order, or a record (insertion order) whose numeric values are `{ type, value }`. */
export type GgufMetadataInput =
  | readonly GgufMetadataEntry[]
  | Readonly<Record<string, string | boolean | string[] | TypedGgufValue>>;

export interface GgufTensorInput {
  name: string;
  /** GGUF order: shape[0] is the innermost, contiguous dimension. */
  shape: readonly number[];
  type: GgmlType;
  /** Exactly the bytes ggml stores for this shape and type. */
  data: Uint8Array;
}

export interface WriteGgufInput {
  metadata: GgufMetadataInput;
  tensors?: readonly GgufTensorInput[];
  /** Tensor data alignment; written as `general.alignment` when not the default 32. */
  alignment?: number;
}

/** A tensor to be written later, for files too large to assemble in memory. */
export type GgufTensorDescription = Omit<GgufTensorInput, 'data'>;

export interface GgufLayout {
  /** Magic, metadata and tensor infos, zero-padded to where tensor data begins. */
  header: Uint8Array<ArrayBuffer>;
  /** Absolute file offset of each tensor's data, in input order. */
  tensorOffsets: number[];
  /** Bytes each tensor's data must have. */
  tensorByteLengths: number[];
  /** Total file size; the bytes between and after tensors are zero padding. */
  fileSize: number;
}

/** Serializes a complete GGUF v3 file. Throws InvalidRequestError when the input could not make a valid file. */
export function writeGguf(input: WriteGgufInput): Uint8Array<ArrayBuffer> {
  const tensors = input.tensors ?? [];
  const layout = planGguf({ metadata: input.metadata, tensors, alignment: input.alignment });
  tensors.forEach((tensor, i) => {
    if (tensor.data.byteLength !== layout.tensorByteLengths[i]) {
      throw new InvalidRequestError(
        `Tensor ${tensor.name} has ${tensor.data.byteLength} bytes of data, but shape [${tensor.shape.join(', ')}] of ${GGML_TYPE_INFO[tensor.type]!.name} needs ${layout.tensorByteLengths[i]}.`,
        { tensor: tensor.name, expected: layout.tensorByteLengths[i], actual: tensor.data.byteLength },
      );
    }
  });
  const file = new Uint8Array(layout.fileSize);
  file.set(layout.header);
  tensors.forEach((tensor, i) => {
    file.set(tensor.data, layout.tensorOffsets[i]);
  });
  return file;
}

/**
 * The streaming form of writeGguf: the header bytes and where each tensor's data goes, without the data. A tool
 * writes `header` at 0 and each tensor at its offset (a file handle or a WritableStream with zero padding between)
 * and gets byte for byte what writeGguf would have produced.
 */
export function planGguf(input: {
  metadata: GgufMetadataInput;
  tensors?: readonly GgufTensorDescription[];
  alignment?: number;
}): GgufLayout {
  const entries = normalizeMetadata(input.metadata);
  const alignment = resolveAlignment(entries, input.alignment);
  const tensors = input.tensors ?? [];
  checkTensorDescriptions(tensors);

  const header = new ByteSink();
  header.u32(GGUF_MAGIC);
  header.u32(GGUF_WRITE_VERSION);
  header.u64(tensors.length);
  header.u64(entries.length);
  for (const entry of entries) {
    header.string(entry.key);
    writeTypedValue(header, entry.key, entry.type, entry.value);
  }
  const relativeOffsets: number[] = [];
  const tensorByteLengths: number[] = [];
  let dataLength = 0;
  for (const tensor of tensors) {
    const byteLength = tensorByteLength(tensor.shape, tensor.type);
    header.string(tensor.name);
    header.u32(tensor.shape.length);
    for (const dim of tensor.shape) header.u64(dim);
    header.u32(tensor.type);
    header.u64(dataLength);
    relativeOffsets.push(dataLength);
    tensorByteLengths.push(byteLength);
    // Every tensor, the last included, is padded so each offset and the file's end stay aligned (as ggml writes it).
    dataLength = alignUp(dataLength + byteLength, alignment);
  }

  const dataOffset = alignUp(header.length, alignment);
  const paddedHeader = new Uint8Array(dataOffset);
  paddedHeader.set(header.bytes());
  return {
    header: paddedHeader,
    tensorOffsets: relativeOffsets.map((offset) => dataOffset + offset),
    tensorByteLengths,
    fileSize: dataOffset + dataLength,
  };
}

/**
 * The metadata of a parsed file as writer entries with their original types, so a tool can copy a model's tokenizer
 * or hyperparameters into a new file. `keep` selects keys (all by default).
 */
export function metadataEntriesOf(file: GgufFile, keep: (key: string) => boolean = () => true): GgufMetadataEntry[] {
  const types = file.metadataTypes;
  if (!types) {
    throw new InvalidRequestError(
      'This GgufFile carries no metadataTypes; parse it with parseGguf to copy its metadata.',
    );
  }
  return Object.keys(file.metadata)
    .filter(keep)
    .map((key) => ({ key, value: file.metadata[key], type: types[key] }));
}

type ResolvedEntry = { key: string; value: GgufValue; type: GgufMetadataType };

function normalizeMetadata(metadata: GgufMetadataInput): ResolvedEntry[] {
  const entries: GgufMetadataEntry[] = Array.isArray(metadata)
    ? [...(metadata as readonly GgufMetadataEntry[])]
    : Object.entries(metadata).map(([key, item]) =>
        typeof item === 'object' && !Array.isArray(item) ? { key, ...item } : { key, value: item },
      );
  const seen = new Set<string>();
  return entries.map(({ key, value, type }) => {
    if (typeof key !== 'string' || key.length === 0) throw new InvalidRequestError('A GGUF metadata key is empty.');
    if (seen.has(key)) throw new InvalidRequestError(`The GGUF metadata key "${key}" is given twice.`, { key });
    seen.add(key);
    return { key, value, type: type ?? inferType(key, value) };
  });
}

function inferType(key: string, value: GgufValue): GgufMetadataType {
  if (typeof value === 'string') return 'string';
  if (typeof value === 'boolean') return 'bool';
  if (Array.isArray(value) && value.length > 0) {
    const first = inferType(key, value[0]);
    return arrayTypeOf(first);
  }
  throw new InvalidRequestError(
    `GGUF metadata "${key}" needs an explicit type (for example 'u32', 'f32' or 'i32[]'): llama.cpp checks the stored type exactly, and an empty array or a number does not say which.`,
    { key },
  );
}

function resolveAlignment(entries: ResolvedEntry[], requested: number | undefined): number {
  const existing = entries.find((entry) => entry.key === GGUF_ALIGNMENT_KEY);
  if (existing && (existing.type !== 'u32' || typeof existing.value !== 'number')) {
    throw new InvalidRequestError(`${GGUF_ALIGNMENT_KEY} must be a u32.`);
  }
  const alignment = requested ?? (existing?.value as number | undefined) ?? GGUF_DEFAULT_ALIGNMENT;
  if (!isValidAlignment(alignment)) {
    throw new InvalidRequestError(`The GGUF alignment must be a power of two; got ${alignment}.`, { alignment });
  }
  if (existing && existing.value !== alignment) {
    throw new InvalidRequestError(
      `The alignment option (${alignment}) contradicts the ${GGUF_ALIGNMENT_KEY} metadata (${existing.value}).`,
    );
  }
  if (!existing && alignment !== GGUF_DEFAULT_ALIGNMENT) {
    entries.push({ key: GGUF_ALIGNMENT_KEY, value: alignment, type: 'u32' });
  }
  return alignment;
}

function checkTensorDescriptions(tensors: readonly GgufTensorDescription[]): void {
  const names = new Set<string>();
  const encoder = new TextEncoder();
  for (const tensor of tensors) {
    const nameBytes = encoder.encode(tensor.name).byteLength;
    if (nameBytes === 0 || nameBytes > GGML_MAX_TENSOR_NAME_BYTES) {
      throw new InvalidRequestError(
        `Tensor name "${tensor.name}" is ${nameBytes} bytes; ggml needs 1 to ${GGML_MAX_TENSOR_NAME_BYTES}.`,
        { tensor: tensor.name },
      );
    }
    if (names.has(tensor.name)) {
      throw new InvalidRequestError(`Tensor ${tensor.name} is given twice.`, { tensor: tensor.name });
    }
    names.add(tensor.name);
    const problem = tensorLayoutProblem(tensor.shape, tensor.type);
    if (problem) throw new InvalidRequestError(`Tensor ${tensor.name} cannot be written: ${problem}.`);
  }
}

function writeTypedValue(sink: ByteSink, key: string, type: GgufMetadataType, value: GgufValue): void {
  const itemType = arrayItemType(type);
  if (itemType === null) {
    const scalar = type as GgufScalarTypeName;
    const typeId = SCALAR_TYPE_IDS[scalar];
    if (typeId === undefined) throw new InvalidRequestError(`GGUF metadata "${key}" has unknown type ${String(type)}.`);
    sink.u32(typeId);
    writeScalar(sink, key, scalar, value);
    return;
  }
  sink.u32(GgufValueType.ARRAY);
  writeArrayBody(sink, key, itemType, value);
}

/** An array's item type id, count and items (nested arrays repeat this without the outer type id). */
function writeArrayBody(sink: ByteSink, key: string, itemType: GgufMetadataType, value: GgufValue): void {
  if (!Array.isArray(value)) throw typeMismatch(key, 'an array', value);
  const nested = arrayItemType(itemType);
  const itemTypeId = nested === null ? SCALAR_TYPE_IDS[itemType as GgufScalarTypeName] : GgufValueType.ARRAY;
  if (itemTypeId === undefined)
    throw new InvalidRequestError(`GGUF metadata "${key}" has unknown type ${String(itemType)}.`);
  sink.u32(itemTypeId);
  sink.u64(value.length);
  for (const item of value) {
    if (nested === null) writeScalar(sink, key, itemType as GgufScalarTypeName, item);
    else writeArrayBody(sink, key, nested, item);
  }
}

const INTEGER_RANGES: Partial<Record<GgufScalarTypeName, readonly [number, number]>> = {
  u8: [0, 0xff],
  i8: [-0x80, 0x7f],
  u16: [0, 0xffff],
  i16: [-0x8000, 0x7fff],
  u32: [0, 0xffffffff],
  i32: [-0x80000000, 0x7fffffff],
};

function writeScalar(sink: ByteSink, key: string, type: GgufScalarTypeName, value: GgufValue): void {
  const range = INTEGER_RANGES[type];
  if (range) {
    if (typeof value !== 'number' || !Number.isInteger(value) || value < range[0] || value > range[1]) {
      throw typeMismatch(key, `an integer in ${type} range [${range[0]}, ${range[1]}]`, value);
    }
  }
  switch (type) {
    case 'u8':
    case 'i8':
      sink.u8(value as number);
      return;
    case 'u16':
    case 'i16':
      sink.u16(value as number);
      return;
    case 'u32':
    case 'i32':
      sink.u32(value as number);
      return;
    case 'f32':
    case 'f64':
      if (typeof value !== 'number') throw typeMismatch(key, 'a number', value);
      if (type === 'f32') sink.f32(value);
      else sink.f64(value);
      return;
    case 'u64':
    case 'i64': {
      const big = toBigInt(value);
      const fits =
        type === 'u64'
          ? big !== null && BigInt.asUintN(64, big) === big
          : big !== null && BigInt.asIntN(64, big) === big;
      if (!fits) throw typeMismatch(key, `an integer in ${type} range`, value);
      sink.u64(BigInt.asUintN(64, big!));
      return;
    }
    case 'bool':
      if (typeof value !== 'boolean') throw typeMismatch(key, 'a boolean', value);
      sink.u8(value ? 1 : 0);
      return;
    case 'string':
      if (typeof value !== 'string') throw typeMismatch(key, 'a string', value);
      sink.string(value);
      return;
  }
}

function toBigInt(value: GgufValue): bigint | null {
  if (typeof value === 'bigint') return value;
  if (typeof value === 'number' && Number.isSafeInteger(value)) return BigInt(value);
  return null;
}

function typeMismatch(key: string, expected: string, value: GgufValue): InvalidRequestError {
  const shown = Array.isArray(value) ? `an array of ${value.length}` : `${typeof value} ${String(value)}`.slice(0, 80);
  return new InvalidRequestError(`GGUF metadata "${key}" must be ${expected}; got ${shown}.`, { key });
}

/** A growable little-endian byte buffer for the header (tensor data is copied once into the final file). */
class ByteSink {
  private buffer = new Uint8Array(4096);
  private view = new DataView(this.buffer.buffer);
  length = 0;
  private readonly encoder = new TextEncoder();

  private reserve(extra: number): number {
    const needed = this.length + extra;
    if (needed > this.buffer.byteLength) {
      const grown = new Uint8Array(Math.max(needed, this.buffer.byteLength * 2));
      grown.set(this.buffer.subarray(0, this.length));
      this.buffer = grown;
      this.view = new DataView(grown.buffer);
    }
    const at = this.length;
    this.length = needed;
    return at;
  }

  // Reserve before touching this.view: growing replaces the buffer and its view.
  u8(value: number): void {
    const at = this.reserve(1);
    this.view.setUint8(at, value & 0xff);
  }
  u16(value: number): void {
    const at = this.reserve(2);
    this.view.setUint16(at, value & 0xffff, true);
  }
  u32(value: number): void {
    const at = this.reserve(4);
    this.view.setUint32(at, value >>> 0, true);
  }
  u64(value: number | bigint): void {
    const at = this.reserve(8);
    this.view.setBigUint64(at, BigInt(value), true);
  }
  f32(value: number): void {
    const at = this.reserve(4);
    this.view.setFloat32(at, value, true);
  }
  f64(value: number): void {
    const at = this.reserve(8);
    this.view.setFloat64(at, value, true);
  }
  string(value: string): void {
    const encoded = this.encoder.encode(value);
    this.u64(encoded.byteLength);
    const at = this.reserve(encoded.byteLength);
    this.buffer.set(encoded, at);
  }
  bytes(): Uint8Array {
    return this.buffer.subarray(0, this.length);
  }
}
