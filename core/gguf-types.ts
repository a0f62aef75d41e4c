/**
 * GGUF and GGML type declarations shared by the parser, the writer, the weight kernels and the tools.
 * Shapes use GGUF order: shape[0] (ne0) is the innermost, contiguous dimension.
 */

/** "GGUF" read as a little-endian u32: the first four bytes of every GGUF file. */
export const GGUF_MAGIC = 0x46554747;

export enum GgmlType {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
}

/** Elements per block and bytes per block of each type, as laid out by ggml. */
export interface GgmlTypeInfo {
  name: string;
  blockSize: number;
  blockBytes: number;
}

export const GGML_TYPE_INFO: Readonly<Partial<Record<GgmlType, GgmlTypeInfo>>> = {
  [GgmlType.F32]: { name: 'F32', blockSize: 1, blockBytes: 4 },
  [GgmlType.F16]: { name: 'F16', blockSize: 1, blockBytes: 2 },
  [GgmlType.BF16]: { name: 'BF16', blockSize: 1, blockBytes: 2 },
  [GgmlType.Q4_0]: { name: 'Q4_0', blockSize: 32, blockBytes: 18 },
  [GgmlType.Q4_1]: { name: 'Q4_1', blockSize: 32, blockBytes: 20 },
  [GgmlType.Q5_0]: { name: 'Q5_0', blockSize: 32, blockBytes: 22 },
  [GgmlType.Q5_1]: { name: 'Q5_1', blockSize: 32, blockBytes: 24 },
  [GgmlType.Q8_0]: { name: 'Q8_0', blockSize: 32, blockBytes: 34 },
  [GgmlType.Q8_1]: { name: 'Q8_1', blockSize: 32, blockBytes: 36 },
  [GgmlType.Q2_K]: { name: 'Q2_K', blockSize: 256, blockBytes: 84 },
  [GgmlType.Q3_K]: { name: 'Q3_K', blockSize: 256, blockBytes: 110 },
  [GgmlType.Q4_K]: { name: 'Q4_K', blockSize: 256, blockBytes: 144 },
  [GgmlType.Q5_K]: { name: 'Q5_K', blockSize: 256, blockBytes: 176 },
  [GgmlType.Q6_K]: { name: 'Q6_K', blockSize: 256, blockBytes: 210 },
  [GgmlType.Q8_K]: { name: 'Q8_K', blockSize: 256, blockBytes: 292 },
  [GgmlType.IQ2_XXS]: { name: 'IQ2_XXS', blockSize: 256, blockBytes: 66 },
  [GgmlType.IQ2_XS]: { name: 'IQ2_XS', blockSize: 256, blockBytes: 74 },
  [GgmlType.IQ3_XXS]: { name: 'IQ3_XXS', blockSize: 256, blockBytes: 98 },
  [GgmlType.IQ1_S]: { name: 'IQ1_S', blockSize: 256, blockBytes: 50 },
  [GgmlType.IQ4_NL]: { name: 'IQ4_NL', blockSize: 32, blockBytes: 18 },
  [GgmlType.IQ3_S]: { name: 'IQ3_S', blockSize: 256, blockBytes: 110 },
  [GgmlType.IQ2_S]: { name: 'IQ2_S', blockSize: 256, blockBytes: 82 },
  [GgmlType.IQ4_XS]: { name: 'IQ4_XS', blockSize: 256, blockBytes: 136 },
  [GgmlType.IQ1_M]: { name: 'IQ1_M', blockSize: 256, blockBytes: 56 },
  [GgmlType.I8]: { name: 'I8', blockSize: 1, blockBytes: 1 },
  [GgmlType.I16]: { name: 'I16', blockSize: 1, blockBytes: 2 },
  [GgmlType.I32]: { name: 'I32', blockSize: 1, blockBytes: 4 },
  [GgmlType.I64]: { name: 'I64', blockSize: 1, blockBytes: 8 },
  [GgmlType.F64]: { name: 'F64', blockSize: 1, blockBytes: 8 },
};

/** The weight types the runtime's kernels implement (the rest parse but are rejected at load). */
export const SUPPORTED_WEIGHT_TYPES: readonly GgmlType[] = [
  GgmlType.F32,
  GgmlType.F16,
  GgmlType.BF16,
  GgmlType.Q8_0,
  GgmlType.Q4_0,
  GgmlType.Q4_1,
  GgmlType.Q5_0,
  GgmlType.Q5_1,
  GgmlType.Q4_K,
  GgmlType.Q5_K,
  GgmlType.Q6_K,
  GgmlType.Q2_K,
  GgmlType.Q3_K,
  GgmlType.IQ4_NL,
  GgmlType.IQ4_XS,
];

/**
 * The supported file to download instead, for the quantizations longtab refuses (their grids and sign tables are
 * not implemented): the nearest in size and quality among the supported ones.
 */
const NEAREST_SUPPORTED_FILE: Readonly<Partial<Record<GgmlType, string>>> = {
  [GgmlType.IQ1_S]: 'a Q2_K file',
  [GgmlType.IQ1_M]: 'a Q2_K file',
  [GgmlType.IQ2_XXS]: 'a Q2_K or Q3_K_S file',
  [GgmlType.IQ2_XS]: 'a Q2_K or Q3_K_S file',
  [GgmlType.IQ2_S]: 'a Q2_K or Q3_K_S file',
  [GgmlType.IQ3_XXS]: 'a Q3_K_M or Q4_K_M file',
  [GgmlType.IQ3_S]: 'a Q3_K_M or Q4_K_M file',
};

/** What a user whose model has weights of an unsupported `type` should do instead, as the end of a sentence. */
export function unsupportedWeightTypeAdvice(type: GgmlType): string {
  const nearest = NEAREST_SUPPORTED_FILE[type];
  if (nearest) return `use ${nearest}`;
  return `use a model quantized as ${SUPPORTED_WEIGHT_TYPES.map((t) => GGML_TYPE_INFO[t]?.name).join(', ')}`;
}

/** The 16 non-linear levels an IQ4_NL or IQ4_XS 4-bit code selects (ggml's kvalues_iq4nl), times the block scale. */
export const IQ4_NL_LEVELS: readonly number[] = [
  -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

export type GgufValue = number | bigint | string | boolean | GgufValue[];
export type GgufMetadata = Record<string, GgufValue>;

/** The type ids GGUF stores before each metadata value (and before an array's items). */
export enum GgufValueType {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
}

/** A metadata value's stored type by name; llama.cpp checks these exactly (a u32 key written as i32 is rejected). */
export type GgufScalarTypeName =
  | 'u8'
  | 'i8'
  | 'u16'
  | 'i16'
  | 'u32'
  | 'i32'
  | 'f32'
  | 'bool'
  | 'string'
  | 'u64'
  | 'i64'
  | 'f64';
/** `'f32[]'` is an array of f32; `{ array: … }` spells nested arrays. */
export type GgufMetadataType = GgufScalarTypeName | `${GgufScalarTypeName}[]` | { array: GgufMetadataType };

export interface GgufTensorInfo {
  name: string;
  /** GGUF order: shape[0] is contiguous. */
  shape: number[];
  type: GgmlType;
  /** Absolute byte offset of the tensor's data in the file. */
  offset: number;
  byteLength: number;
}

export interface GgufFile {
  version: number;
  metadata: GgufMetadata;
  tensors: GgufTensorInfo[];
  alignment: number;
  /** Absolute offset where tensor data begins. */
  dataOffset: number;
  fileSize: number;
  /** The stored type of each metadata value, so tools can rewrite a file without changing its types. */
  metadataTypes?: Record<string, GgufMetadataType>;
}

/**
 * Random-access bytes of a model file: a File/Blob, a URL (HTTP Range requests) or a local path in Node.
 * Reads are bounded so no source ever holds the whole file in memory.
 */
export interface ByteSource {
  readonly name: string;
  readonly size: number;
  read(offset: number, length: number): Promise<Uint8Array>;
  close?(): Promise<void>;
  /**
   * The files this source joins end to end, in order: the shards of a split GGUF model (runtime/gguf/split.ts), each
   * a GGUF file of its own. Absent for a single file.
   */
  readonly parts?: readonly ByteSourcePart[];
}

/** One file of a joined source: its name and where its bytes lie in the join. */
export interface ByteSourcePart {
  readonly name: string;
  readonly offset: number;
  readonly size: number;
}
