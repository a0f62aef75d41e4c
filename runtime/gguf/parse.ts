/**
 * GGUF v2/v3 header parser (little-endian). It reads the header through a bounded window over the ByteSource and
 * never touches tensor data. Files come from anywhere, so every count and length is checked against the bytes left
 * in the file before anything is allocated for it.
 */
import { CorruptModelFileError, InvalidRequestError, UnsupportedModelError } from '../../core/errors.ts';
import {
  type ByteSource,
  type ByteSourcePart,
  GGML_TYPE_INFO,
  GGUF_MAGIC,
  type GgmlType,
  type GgufFile,
  type GgufMetadata,
  type GgufMetadataType,
  type GgufTensorInfo,
  type GgufValue,
  GgufValueType,
} from '../../core/gguf-types.ts';
import {
  alignUp,
  arrayTypeOf,
  GGML_MAX_DIMS,
  GGUF_ALIGNMENT_KEY,
  GGUF_DEFAULT_ALIGNMENT,
  isValidAlignment,
  SCALAR_BYTE_SIZES,
  SCALAR_TYPE_NAMES,
  tensorByteLength,
  tensorLayoutProblem,
} from './format.ts';
import { metaOptionalNumber } from './metadata.ts';
import { SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY, shardName } from './split.ts';

export interface ParseGgufOptions {
  /** Bytes fetched per header read; 1 MiB keeps URL sources to a few requests for typical vocabularies. */
  windowBytes?: number;
  /**
   * Items all metadata arrays may hold together (default 2^24, some 16 times a 256k-token vocabulary's tokens,
   * scores, types and merges).
   */
  maxArrayItems?: number;
  /**
   * Memory the parsed header may take, as estimated before each allocation (default 512 MiB; a 256k-token
   * vocabulary takes a few tens of MiB): a file's claims cannot make parsing take more than this.
   */
  maxHeapBytes?: number;
}

const DEFAULT_WINDOW_BYTES = 1024 * 1024;
/** Real files nest arrays at most once or twice; a limit keeps hostile nesting from exhausting the stack. */
const MAX_ARRAY_NESTING = 8;
/** Chat templates are tens of kilobytes; a string this long is damage, not data, and would only waste memory. */
const MAX_STRING_BYTES = 64 * 1024 * 1024;
/**
 * A parsed item costs far more memory than its bytes in the file (a u8 becomes an 8-byte array slot, a tensor info a
 * JS object), so counts are also capped well above any real model (vocabularies reach ~10^6 entries, models ~10^4
 * tensors) to keep a hostile multi-gigabyte file from exhausting memory.
 */
const MAX_ARRAY_ITEMS = 1 << 24;
const MAX_ENTRIES = 1 << 20;
const DEFAULT_MAX_TOTAL_ARRAY_ITEMS = 1 << 24;
const DEFAULT_MAX_HEAP_BYTES = 512 * 1024 * 1024;
/**
 * Estimated heap bytes per parsed item, charged before it is allocated: an array slot (8), plus a heap number where a
 * value may not fit a small integer, plus a string's header and its characters (2 bytes each at worst), a tensor
 * info's object and shape.
 */
const HEAP_SLOT = 8;
const HEAP_NUMBER = 16;
const HEAP_STRING = 32;
const HEAP_ARRAY = 32;
const HEAP_TENSOR_INFO = 160;
/** Smallest encodings, used to reject counts that cannot fit in the bytes left. */
const MIN_STRING_BYTES = 8;
const MIN_KV_BYTES = MIN_STRING_BYTES + 4 + 1;
const MIN_TENSOR_INFO_BYTES = MIN_STRING_BYTES + 4 + 8 + 4 + 8;
const MIN_NESTED_ARRAY_BYTES = 4 + 8;

/**
 * The header of a GGUF model: of one file, or of a split model's shards joined in one source (`source.parts`, as
 * sourceFromPath and sourceFromUrl open them), whose tensors then lie where the join has them. One shard alone is
 * refused with an InvalidRequestError saying how to load the whole model.
 */
export async function parseGguf(source: ByteSource, options: ParseGgufOptions = {}): Promise<GgufFile> {
  if (source.parts && source.parts.length > 1) return parseSplitGguf(source, source.parts, options);
  const file = await parseOneGguf(source, options);
  const split = splitOf(file);
  if (split.count > 1) {
    throw new InvalidRequestError(
      `${source.name} is part ${split.no + 1} of ${split.count} of a split GGUF model; its other parts hold the rest of the model. Load it by URL or file path with all its parts side by side under the names llama.cpp's gguf-split gives them (${shardName('NAME', 1, split.count)} …), so longtab finds them; or merge the parts into one file (llama-gguf-split --merge ${shardName('NAME', 1, split.count)} NAME.gguf) and pick that, or pick a single-file GGUF of the model.`,
      { splitNo: split.no, splitCount: split.count },
    );
  }
  return file;
}

/**
 * The shards of a split model, joined in `source` as `parts` (in order), as one file: the first shard's metadata,
 * every shard's tensors at their offsets in the join. Shards that are not this model's parts in this order, or do not
 * add up to its tensor count, are refused as llama.cpp's loader refuses them.
 */
async function parseSplitGguf(
  source: ByteSource,
  parts: readonly ByteSourcePart[],
  options: ParseGgufOptions,
): Promise<GgufFile> {
  const partSource = (part: ByteSourcePart): ByteSource => ({
    name: part.name,
    size: part.size,
    read: (offset, length) => source.read(part.offset + offset, length),
  });
  const first = await parseOneGguf(partSource(parts[0]), options);
  const split = splitOf(first);
  // Named as a shard but not one: a single file, whatever lies beside it.
  if (split.count <= 1) return first;
  const notTogether = (part: ByteSourcePart, no: number, count: number, problem: string) =>
    new CorruptModelFileError(
      `${part.name} is part ${no + 1} of ${count} by its metadata${problem}: the files do not belong together. Download all the parts of the model again, under the names they were published with.`,
      { part: part.name, splitNo: no, splitCount: count },
    );
  if (split.no !== 0 || split.count !== parts.length) {
    throw notTogether(parts[0], split.no, split.count, `, but part 1 of ${parts.length} by its name`);
  }
  const tensors = [...first.tensors];
  const names = new Set(tensors.map((t) => t.name));
  for (let i = 1; i < parts.length; i++) {
    const part = parts[i];
    const shard = await parseOneGguf(partSource(part), options);
    const { no, count } = splitOf(shard);
    if (no !== i || count !== parts.length) {
      throw notTogether(part, no, count, `, but part ${i + 1} of ${parts.length} by its name`);
    }
    for (const t of shard.tensors) {
      if (names.has(t.name)) throw notTogether(part, no, count, ` and holds tensor ${t.name} again`);
      names.add(t.name);
      tensors.push({ ...t, offset: part.offset + t.offset });
    }
  }
  const expected = metaOptionalNumber(first.metadata, SPLIT_TENSORS_COUNT_KEY);
  if (expected !== undefined && expected !== tensors.length) {
    throw new CorruptModelFileError(
      `The ${parts.length} parts of ${source.name} hold ${tensors.length} tensors, but its metadata says ${expected} (${SPLIT_TENSORS_COUNT_KEY}): a part is incomplete or from another model. Download the parts again.`,
      { tensors: tensors.length, expected },
    );
  }
  return { ...first, tensors, fileSize: source.size };
}

/** Which shard a file is by its metadata: `split.no` from 0 and `split.count` (1 for a single file). */
function splitOf(file: GgufFile): { no: number; count: number } {
  const count = metaOptionalNumber(file.metadata, SPLIT_COUNT_KEY) ?? 0;
  return { no: metaOptionalNumber(file.metadata, SPLIT_NO_KEY) ?? 0, count: Math.max(1, count) };
}

/** One GGUF file's header. */
async function parseOneGguf(source: ByteSource, options: ParseGgufOptions): Promise<GgufFile> {
  const reader = new HeaderReader(source, options.windowBytes ?? DEFAULT_WINDOW_BYTES, {
    arrayItems: options.maxArrayItems ?? DEFAULT_MAX_TOTAL_ARRAY_ITEMS,
    heapBytes: options.maxHeapBytes ?? DEFAULT_MAX_HEAP_BYTES,
  });
  const fileName = source.name;

  if (source.size < 4 || (await reader.u32('the magic number')) !== GGUF_MAGIC) {
    throw new CorruptModelFileError(
      `${fileName} is not a GGUF file (it does not start with "GGUF"). longtab loads GGUF models; convert other formats with llama.cpp's convert_hf_to_gguf.py.`,
    );
  }
  const version = await reader.u32('the version');
  checkVersion(version, fileName);

  const tensorCount = await reader.count('the tensor count', MIN_TENSOR_INFO_BYTES, MAX_ENTRIES);
  const kvCount = await reader.count('the metadata count', MIN_KV_BYTES, MAX_ENTRIES);
  if (tensorCount * MIN_TENSOR_INFO_BYTES + kvCount * MIN_KV_BYTES > reader.remaining) {
    throw reader.corrupt(
      `it claims ${kvCount} metadata entries and ${tensorCount} tensors, more than its size can hold`,
    );
  }

  const metadata: GgufMetadata = Object.create(null);
  const metadataTypes: Record<string, GgufMetadataType> = Object.create(null);
  for (let i = 0; i < kvCount; i++) {
    const key = await reader.string(`the key of metadata entry ${i}`);
    if (key.length === 0) throw reader.corrupt(`metadata entry ${i} has an empty key`);
    if (Object.hasOwn(metadata, key)) throw reader.corrupt(`the metadata key "${key}" appears twice`);
    const typeId = await reader.u32(`the value type of "${key}"`);
    const { value, type } = await reader.value(typeId, key, 0);
    metadata[key] = value;
    metadataTypes[key] = type;
  }

  const alignment = readAlignment(metadata, metadataTypes, reader);

  const tensors: GgufTensorInfo[] = [];
  const tensorNames = new Set<string>();
  reader.charge(tensorCount * HEAP_TENSOR_INFO, `${tensorCount} tensor infos`);
  for (let i = 0; i < tensorCount; i++) {
    const name = await reader.string(`the name of tensor ${i}`);
    if (tensorNames.has(name)) throw reader.corrupt(`the tensor name "${name}" appears twice`);
    tensorNames.add(name);
    const dimCount = await reader.u32(`the dimension count of tensor ${name}`);
    if (dimCount < 1 || dimCount > GGML_MAX_DIMS) {
      throw reader.corrupt(`tensor ${name} has ${dimCount} dimensions (ggml allows 1 to ${GGML_MAX_DIMS})`);
    }
    const shape: number[] = [];
    for (let d = 0; d < dimCount; d++) {
      const dim = await reader.u64(`dimension ${d} of tensor ${name}`);
      if (typeof dim !== 'number' || dim <= 0) {
        throw reader.corrupt(`tensor ${name} has dimension ${d} = ${dim}; dimensions must be positive`);
      }
      shape.push(dim);
    }
    const typeId: GgmlType = await reader.u32(`the type of tensor ${name}`);
    if (!GGML_TYPE_INFO[typeId]) {
      throw new UnsupportedModelError(
        `Tensor ${name} in ${fileName} uses GGML type id ${typeId}, which longtab does not know. Re-quantize the model to a common type (Q4_K_M, Q8_0 or F16).`,
        { tensor: name, typeId },
      );
    }
    const layoutProblem = tensorLayoutProblem(shape, typeId);
    if (layoutProblem) throw reader.corrupt(`tensor ${name} is malformed: ${layoutProblem}`);
    const relativeOffset = await reader.u64(`the data offset of tensor ${name}`);
    if (typeof relativeOffset !== 'number' || relativeOffset % alignment !== 0) {
      throw reader.corrupt(
        `tensor ${name} has data offset ${relativeOffset}, not a multiple of the alignment ${alignment}`,
      );
    }
    tensors.push({ name, shape, type: typeId, offset: relativeOffset, byteLength: tensorByteLength(shape, typeId) });
  }

  const dataOffset = alignUp(reader.position, alignment);
  for (const tensor of tensors) {
    tensor.offset += dataOffset;
    if (tensor.offset + tensor.byteLength > source.size) {
      throw new CorruptModelFileError(
        `Tensor ${tensor.name} in ${fileName} needs bytes ${tensor.offset}..${tensor.offset + tensor.byteLength} but the file has ${source.size}: the file is truncated or damaged. Download it again.`,
        { tensor: tensor.name, offset: tensor.offset, byteLength: tensor.byteLength, fileSize: source.size },
      );
    }
  }

  return { version, metadata, tensors, alignment, dataOffset, fileSize: source.size, metadataTypes };
}

function checkVersion(version: number, fileName: string): void {
  if (version === 2 || version === 3) return;
  const swapped = ((version & 0xff) << 24) | ((version & 0xff00) << 8) | ((version >>> 8) & 0xff00) | (version >>> 24);
  if (swapped === 2 || swapped === 3) {
    throw new UnsupportedModelError(
      `${fileName} is a big-endian GGUF file; longtab reads little-endian GGUF only. Use the little-endian release of the model.`,
      { version: swapped },
    );
  }
  const hint =
    version === 1 ? ' Version 1 predates August 2023; convert the model again with a current llama.cpp.' : '';
  throw new UnsupportedModelError(`${fileName} is GGUF version ${version}; longtab reads versions 2 and 3.${hint}`, {
    version,
  });
}

function readAlignment(metadata: GgufMetadata, types: Record<string, GgufMetadataType>, reader: HeaderReader): number {
  if (!Object.hasOwn(metadata, GGUF_ALIGNMENT_KEY)) return GGUF_DEFAULT_ALIGNMENT;
  const alignment = metadata[GGUF_ALIGNMENT_KEY];
  if (types[GGUF_ALIGNMENT_KEY] !== 'u32' || typeof alignment !== 'number' || !isValidAlignment(alignment)) {
    throw reader.corrupt(`${GGUF_ALIGNMENT_KEY} is ${String(alignment)}; it must be a u32 power of two`);
  }
  return alignment;
}

/**
 * Sequential little-endian reads through a window of the source. Fixed-size reads are synchronous once the window
 * holds the bytes, which keeps parsing a 150k-entry vocabulary fast; the window refills only when it runs out.
 */
class HeaderReader {
  position = 0;
  private window: Uint8Array = new Uint8Array(0);
  private view: DataView = new DataView(this.window.buffer);
  private windowStart = 0;
  private readonly decoder = new TextDecoder('utf-8');

  /** What is left of the parse's budgets (ParseGgufOptions.maxArrayItems and maxHeapBytes). */
  private arrayItemsLeft: number;
  private heapBytesLeft: number;
  private readonly budget: { arrayItems: number; heapBytes: number };

  constructor(
    private readonly source: ByteSource,
    private readonly windowBytes: number,
    budget: { arrayItems: number; heapBytes: number },
  ) {
    this.budget = budget;
    this.arrayItemsLeft = budget.arrayItems;
    this.heapBytesLeft = budget.heapBytes;
  }

  /** Takes `bytes` of estimated heap from the budget before they are allocated, or refuses the file. */
  charge(bytes: number, what: string): void {
    this.heapBytesLeft -= bytes;
    if (this.heapBytesLeft < 0) {
      throw this.corrupt(
        `its header would take more than ${mib(this.budget.heapBytes)} of memory once parsed (at ${what}), far more than a real model's vocabulary and tensor list`,
      );
    }
  }

  get remaining(): number {
    return this.source.size - this.position;
  }

  corrupt(problem: string): CorruptModelFileError {
    return new CorruptModelFileError(
      `${this.source.name} is not a valid GGUF file: ${problem} (near byte ${this.position}). Download it again; if it persists, the file is damaged at its source.`,
      { position: this.position },
    );
  }

  /** Makes the next `length` bytes available in the window, or reports a truncated file. */
  private async need(length: number, what: string): Promise<number> {
    if (length > this.remaining) {
      throw this.corrupt(`the file ends while reading ${what}`);
    }
    const start = this.position - this.windowStart;
    if (start + length > this.window.byteLength) {
      const readLength = Math.min(Math.max(this.windowBytes, length), this.remaining);
      const bytes = await this.source.read(this.position, readLength);
      this.window = bytes;
      this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
      this.windowStart = this.position;
      return 0;
    }
    return start;
  }

  private has(length: number): boolean {
    return this.position + length <= this.windowStart + this.window.byteLength;
  }

  async u32(what: string): Promise<number> {
    const at = this.has(4) ? this.position - this.windowStart : await this.need(4, what);
    this.position += 4;
    return this.view.getUint32(at, true);
  }

  /** A u64 as a number when exact, otherwise a bigint (callers that need a size treat bigint as too large). */
  async u64(what: string): Promise<number | bigint> {
    const at = this.has(8) ? this.position - this.windowStart : await this.need(8, what);
    this.position += 8;
    return exactNumber(this.view.getBigUint64(at, true));
  }

  /** A u64 count of items each at least `minItemBytes` long, rejected when the rest of the file cannot hold them. */
  async count(what: string, minItemBytes: number, maxItems: number): Promise<number> {
    const count = await this.u64(what);
    if (typeof count !== 'number' || count * minItemBytes > this.remaining) {
      throw this.corrupt(`${what} is ${count}, more than the ${this.remaining} bytes left can hold`);
    }
    if (count > maxItems) throw this.corrupt(`${what} is ${count}, implausibly many (the limit is ${maxItems})`);
    return count;
  }

  async string(what: string): Promise<string> {
    const length = await this.u64(`the length of ${what}`);
    if (typeof length !== 'number' || length > this.remaining) {
      throw this.corrupt(`${what} claims ${length} bytes but only ${this.remaining} are left`);
    }
    if (length > MAX_STRING_BYTES) throw this.corrupt(`${what} is ${length} bytes long, implausibly long`);
    this.charge(HEAP_STRING + 2 * length, what);
    const at = this.has(length) ? this.position - this.windowStart : await this.need(length, what);
    this.position += length;
    return this.decoder.decode(this.window.subarray(at, at + length));
  }

  /** One metadata value of type `typeId`, with its type spelled for `GgufFile.metadataTypes`. */
  async value(typeId: number, key: string, depth: number): Promise<{ value: GgufValue; type: GgufMetadataType }> {
    if (typeId === GgufValueType.STRING) return { value: await this.string(`the value of "${key}"`), type: 'string' };
    if (typeId === GgufValueType.ARRAY) return this.array(key, depth);
    const size = SCALAR_BYTE_SIZES[typeId as GgufValueType];
    const type = SCALAR_TYPE_NAMES[typeId as GgufValueType];
    if (size === undefined || type === undefined) {
      throw this.corrupt(`metadata "${key}" has value type id ${typeId}, which GGUF does not define`);
    }
    const at = this.has(size) ? this.position - this.windowStart : await this.need(size, `the value of "${key}"`);
    this.position += size;
    return { value: this.scalarAt(typeId, at, key), type };
  }

  private async array(key: string, depth: number): Promise<{ value: GgufValue[]; type: GgufMetadataType }> {
    if (depth >= MAX_ARRAY_NESTING)
      throw this.corrupt(`metadata "${key}" nests arrays deeper than ${MAX_ARRAY_NESTING}`);
    const itemTypeId = await this.u32(`the item type of "${key}"`);
    const itemSize = SCALAR_BYTE_SIZES[itemTypeId as GgufValueType];
    const minItemBytes =
      itemTypeId === GgufValueType.STRING
        ? MIN_STRING_BYTES
        : itemTypeId === GgufValueType.ARRAY
          ? MIN_NESTED_ARRAY_BYTES
          : (itemSize ?? 1);
    const count = await this.count(`the item count of "${key}"`, minItemBytes, MAX_ARRAY_ITEMS);
    this.arrayItemsLeft -= count;
    if (this.arrayItemsLeft < 0) {
      throw this.corrupt(
        `its metadata arrays hold more than ${this.budget.arrayItems} items in all (at "${key}", ${count} items), far more than any real model's`,
      );
    }
    const boxed =
      itemTypeId === GgufValueType.FLOAT32 ||
      itemTypeId === GgufValueType.FLOAT64 ||
      itemTypeId === GgufValueType.UINT32 ||
      itemTypeId === GgufValueType.UINT64 ||
      itemTypeId === GgufValueType.INT64;
    this.charge(HEAP_ARRAY + count * (HEAP_SLOT + (boxed ? HEAP_NUMBER : 0)), `"${key}", ${count} items`);
    const items: GgufValue[] = [];

    if (itemSize !== undefined) {
      // Fixed-size items: decode window by window instead of awaiting each item.
      const itemType = SCALAR_TYPE_NAMES[itemTypeId as GgufValueType]!;
      let left = count;
      while (left > 0) {
        const batch = Math.max(1, Math.min(left, Math.floor(this.windowBytes / itemSize)));
        let at = this.has(batch * itemSize)
          ? this.position - this.windowStart
          : await this.need(batch * itemSize, `the items of "${key}"`);
        for (let i = 0; i < batch; i++, at += itemSize) items.push(this.scalarAt(itemTypeId, at, key));
        this.position += batch * itemSize;
        left -= batch;
      }
      return { value: items, type: arrayTypeOf(itemType) };
    }

    let itemType: GgufMetadataType | null = null;
    for (let i = 0; i < count; i++) {
      const item = await this.value(itemTypeId, `${key}[${i}]`, depth + 1);
      items.push(item.value);
      itemType ??= item.type;
    }
    if (itemType === null) {
      // An empty array of strings or arrays: its item type id is all the file says.
      itemType = itemTypeId === GgufValueType.STRING ? 'string' : 'u8[]';
      if (itemTypeId !== GgufValueType.STRING && itemTypeId !== GgufValueType.ARRAY) {
        throw this.corrupt(`metadata "${key}" is an array of value type id ${itemTypeId}, which GGUF does not define`);
      }
    }
    return { value: items, type: arrayTypeOf(itemType) };
  }

  private scalarAt(typeId: GgufValueType, at: number, key: string): GgufValue {
    const view = this.view;
    switch (typeId) {
      case GgufValueType.UINT8:
        return view.getUint8(at);
      case GgufValueType.INT8:
        return view.getInt8(at);
      case GgufValueType.UINT16:
        return view.getUint16(at, true);
      case GgufValueType.INT16:
        return view.getInt16(at, true);
      case GgufValueType.UINT32:
        return view.getUint32(at, true);
      case GgufValueType.INT32:
        return view.getInt32(at, true);
      case GgufValueType.FLOAT32:
        return view.getFloat32(at, true);
      case GgufValueType.FLOAT64:
        return view.getFloat64(at, true);
      case GgufValueType.UINT64:
        return exactNumber(view.getBigUint64(at, true));
      case GgufValueType.INT64:
        return exactNumber(view.getBigInt64(at, true));
      case GgufValueType.BOOL: {
        const byte = view.getUint8(at);
        if (byte > 1) throw this.corrupt(`metadata "${key}" is a bool stored as ${byte}`);
        return byte === 1;
      }
      default:
        throw this.corrupt(`metadata "${key}" has value type id ${typeId}, which GGUF does not define`);
    }
  }
}

function mib(bytes: number): string {
  return `${Math.round(bytes / (1024 * 1024))} MiB`;
}

function exactNumber(value: bigint): number | bigint {
  return value <= BigInt(Number.MAX_SAFE_INTEGER) && value >= BigInt(Number.MIN_SAFE_INTEGER) ? Number(value) : value;
}
