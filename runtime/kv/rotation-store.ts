/**
 * Calibrated KV rotations at rest: keyed by a digest of the model, kept in GGUF metadata (the demo model ships its
 * own), in a file cache (Node) or IndexedDB (browser). Metadata keys, not tensors: llama.cpp refuses files with
 * tensors it does not expect but ignores unknown metadata, so a file with rotations still runs in llama.cpp.
 */
import { CorruptModelFileError } from '../errors.ts';
import type { ByteSource, GgufFile, GgufMetadata } from '../gguf/types.ts';
import type { ModelConfig } from '../model/config.ts';

export const ROTATION_KEY_METADATA = 'longtab.kv.rotation_key';
export const ROTATION_VALUE_METADATA = 'longtab.kv.rotation_value';
export const ROTATION_TOKENS_METADATA = 'longtab.kv.calibration_tokens';

export interface StoredRotations {
  /** f32 [layers × kvHeads × headDim × headDim]. */
  key: Float32Array;
  value: Float32Array;
  /** Calibration tokens the rotations were fitted on. */
  tokens: number;
}

/** Where calibrated rotations are cached between loads, keyed by `modelDigest`. */
export interface RotationCache {
  get(digest: string): Promise<Uint8Array | undefined>;
  set(digest: string, bytes: Uint8Array): Promise<void>;
}

const SAMPLE_TENSORS = 16;
const SAMPLE_BYTES = 4096;

/**
 * SHA-256 over the metadata (minus longtab's own keys), the tensor table and a few KiB sampled from up to 16
 * tensors: identifies a model without reading the whole file.
 */
export async function modelDigest(file: GgufFile, source: ByteSource): Promise<string> {
  const metadata = Object.keys(file.metadata)
    .filter((k) => !k.startsWith('longtab.kv.'))
    .sort()
    .map((k) => [k, summarizeValue(file.metadata[k])]);
  const table = file.tensors.map((t) => [t.name, t.type, t.shape, t.byteLength]);
  const header = new TextEncoder().encode(JSON.stringify({ metadata, table }));
  const step = Math.max(1, Math.floor(file.tensors.length / SAMPLE_TENSORS));
  const samples: Uint8Array[] = [header];
  for (let i = 0; i < file.tensors.length && samples.length <= SAMPLE_TENSORS; i += step) {
    const t = file.tensors[i];
    samples.push(await source.read(t.offset, Math.min(SAMPLE_BYTES, t.byteLength)));
  }
  const total = samples.reduce((n, s) => n + s.byteLength, 0);
  const joined = new Uint8Array(total);
  let offset = 0;
  for (const s of samples) {
    joined.set(s, offset);
    offset += s.byteLength;
  }
  const hash = new Uint8Array(await crypto.subtle.digest('SHA-256', joined));
  return Array.from(hash, (b) => b.toString(16).padStart(2, '0')).join('');
}

/** Long arrays (vocabularies) enter the digest by length and a checksum, so the digest input stays small. */
function summarizeValue(value: unknown): unknown {
  if (!Array.isArray(value)) return typeof value === 'bigint' ? value.toString() : value;
  if (value.length <= 64) return value.map(summarizeValue);
  let checksum = 0;
  for (const v of value) {
    const text = String(v);
    for (let i = 0; i < text.length; i++) checksum = (Math.imul(checksum, 31) + text.charCodeAt(i)) >>> 0;
  }
  return { length: value.length, checksum };
}

function matrixCount(config: ModelConfig): number {
  return config.layers * config.kvHeads * config.headDim * config.headDim;
}

/** Serialized form: magic, version, token count, element count, then key and value as little-endian f32. */
export function encodeRotations(r: StoredRotations): Uint8Array {
  const n = r.key.length;
  const bytes = new Uint8Array(16 + 8 * n);
  const view = new DataView(bytes.buffer);
  view.setUint32(0, 0x4b56524c, true); // 'LRVK'
  view.setUint32(4, 1, true);
  view.setUint32(8, r.tokens, true);
  view.setUint32(12, n, true);
  new Float32Array(bytes.buffer, 16, n).set(r.key);
  new Float32Array(bytes.buffer, 16 + 4 * n, n).set(r.value);
  return bytes;
}

export function decodeRotations(bytes: Uint8Array, config: ModelConfig): StoredRotations {
  const copy = bytes.slice();
  const view = new DataView(copy.buffer);
  const n = copy.byteLength >= 16 ? view.getUint32(12, true) : -1;
  if (
    copy.byteLength < 16 ||
    view.getUint32(0, true) !== 0x4b56524c ||
    view.getUint32(4, true) !== 1 ||
    n !== matrixCount(config) ||
    copy.byteLength !== 16 + 8 * n
  ) {
    throw new CorruptModelFileError(
      'The cached KV rotations are damaged or belong to another model shape; recalibrate.',
    );
  }
  return {
    tokens: view.getUint32(8, true),
    key: new Float32Array(copy.buffer, 16, n),
    value: new Float32Array(copy.buffer, 16 + 4 * n, n),
  };
}

/** Rotations stored in the model file's metadata, or null when it has none. */
export function rotationsFromMetadata(meta: GgufMetadata, config: ModelConfig): StoredRotations | null {
  const key = meta[ROTATION_KEY_METADATA];
  const value = meta[ROTATION_VALUE_METADATA];
  if (key === undefined && value === undefined) return null;
  const n = matrixCount(config);
  if (!Array.isArray(key) || !Array.isArray(value) || key.length !== n || value.length !== n) {
    throw new CorruptModelFileError(
      `The model's ${ROTATION_KEY_METADATA}/${ROTATION_VALUE_METADATA} arrays must each hold layers × kvHeads × headDim² = ${n} floats.`,
    );
  }
  const tokens = meta[ROTATION_TOKENS_METADATA];
  return {
    key: Float32Array.from(key as number[]),
    value: Float32Array.from(value as number[]),
    tokens: typeof tokens === 'number' ? tokens : 0,
  };
}

/** Metadata entries (for writeGguf) that embed rotations in a model file. */
export function rotationMetadataEntries(r: StoredRotations) {
  return [
    { key: ROTATION_KEY_METADATA, value: Array.from(r.key), type: 'f32[]' as const },
    { key: ROTATION_VALUE_METADATA, value: Array.from(r.value), type: 'f32[]' as const },
    { key: ROTATION_TOKENS_METADATA, value: r.tokens, type: 'u32' as const },
  ];
}
