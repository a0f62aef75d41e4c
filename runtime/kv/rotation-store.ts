/**
 * Calibrated KV rotations at rest: keyed by a digest of the model, kept in GGUF metadata (the demo model ships its
 * own), in a file cache (Node) or IndexedDB (browser). Metadata keys, not tensors: llama.cpp refuses files with
 * tensors it does not expect but ignores unknown metadata, so a file with rotations still runs in llama.cpp.
 */
import { CorruptModelFileError } from '../../core/errors.ts';
import type { ByteSource, GgufFile, GgufMetadata } from '../../core/gguf-types.ts';
import { sha256Hex } from '../../core/sha256.ts';
import type { ModelConfig } from '../model/config.ts';
import type { KvPoolOptions } from './pool.ts';
import { type KvPrecisionPlan, validatePlan } from './precision-plan.ts';
import type { KvRotation } from './rotation.ts';

export const ROTATION_KEY_METADATA = 'longtab.kv.rotation_key';
export const ROTATION_VALUE_METADATA = 'longtab.kv.rotation_value';
export const ROTATION_TOKENS_METADATA = 'longtab.kv.calibration_tokens';
/** Fitted clip quantiles of the K and V row format (optional: files and caches written before them lack them). */
export const CLIP_KEY_METADATA = 'longtab.kv.clip_key';
export const CLIP_VALUE_METADATA = 'longtab.kv.clip_value';
/**
 * The precision plan chosen with them (optional: written since plans exist): f32[layers × 4], per layer K bits, K
 * clip quantile, V bits, V clip quantile (runtime/kv/precision-plan.ts).
 */
export const PLAN_METADATA = 'longtab.kv.plan';

/**
 * The clip quantiles fitted with the rotations (runtime/kv/clip-fit.ts `fitClipQuantiles`): the `clipQuantile` of
 * the K and V row formats (runtime/kv/quant-format.ts), in (0.5, 1]; 1 = plain min/max.
 */
export interface ClipQuantiles {
  key: number;
  value: number;
}

export interface StoredRotations {
  /** f32 [layers × kvHeads × headDim × headDim]. */
  key: Float32Array;
  value: Float32Array;
  /** Calibration tokens the rotations were fitted on. */
  tokens: number;
  /** Absent in rotations stored before clip quantiles were fitted: the quantizer then uses 1 (min/max). */
  clip?: ClipQuantiles;
  /** Per layer K and V precision chosen by the calibration; absent in rotations stored before plans existed. */
  plan?: KvPrecisionPlan;
}

/** A plan as stored: per layer K bits, K clip, V bits, V clip. */
function planWords(plan: KvPrecisionPlan): number[] {
  return plan.flatMap((l) => [l.key.bits, l.key.clipQuantile, l.value.bits, l.value.clipQuantile]);
}

function planFromWords(words: ArrayLike<number>, layers: number): KvPrecisionPlan | null {
  if (words.length !== layers * 4) return null;
  // Stored as f32: clips come back to the 6 decimals they were chosen with (0.92, not 0.9200000166893005).
  const clip = (x: number) => Math.round(x * 1e6) / 1e6;
  const plan = Array.from({ length: layers }, (_, l) => ({
    key: { bits: words[4 * l] as 1 | 2 | 4, clipQuantile: clip(words[4 * l + 1]) },
    value: { bits: words[4 * l + 2] as 1 | 2 | 4, clipQuantile: clip(words[4 * l + 3]) },
  }));
  return validatePlan(plan, layers) ? null : plan;
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
  return sha256Hex(joined);
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

const MAGIC = 0x4b56524c; // 'LRVK'

function validClip(x: unknown): x is number {
  return typeof x === 'number' && x > 0.5 && x <= 1;
}

/**
 * Serialized form: magic, version, token count, element count, (versions 2 and 3: K and V clip quantiles as f32;
 * version 3: the plan's layer count as u32 and its f32[layers × 4]), then key and value as little-endian f32.
 * Rotations without clip quantiles are written as version 1 and without a plan as version 2, byte for byte what
 * earlier builds wrote; every version is read.
 */
export function encodeRotations(r: StoredRotations): Uint8Array {
  const n = r.key.length;
  const plan = r.plan ? planWords(r.plan) : null;
  const version = plan ? 3 : r.clip ? 2 : 1;
  const header = version === 1 ? 16 : version === 2 ? 24 : 28 + 4 * (plan?.length ?? 0);
  const bytes = new Uint8Array(header + 8 * n);
  const view = new DataView(bytes.buffer);
  view.setUint32(0, MAGIC, true);
  view.setUint32(4, version, true);
  view.setUint32(8, r.tokens, true);
  view.setUint32(12, n, true);
  if (version >= 2) {
    view.setFloat32(16, r.clip?.key ?? 1, true);
    view.setFloat32(20, r.clip?.value ?? 1, true);
  }
  if (plan) {
    view.setUint32(24, plan.length / 4, true);
    for (const [i, w] of plan.entries()) view.setFloat32(28 + 4 * i, w, true);
  }
  new Float32Array(bytes.buffer, header, n).set(r.key);
  new Float32Array(bytes.buffer, header + 4 * n, n).set(r.value);
  return bytes;
}

export function decodeRotations(bytes: Uint8Array, config: ModelConfig): StoredRotations {
  const copy = bytes.slice();
  const view = new DataView(copy.buffer);
  const damaged = () =>
    new CorruptModelFileError('The cached KV rotations are damaged or belong to another model shape; recalibrate.');
  if (copy.byteLength < 16 || view.getUint32(0, true) !== MAGIC) throw damaged();
  const version = view.getUint32(4, true);
  if (version !== 1 && version !== 2 && version !== 3) throw damaged();
  const planLayers = version === 3 && copy.byteLength >= 28 ? view.getUint32(24, true) : 0;
  if (version === 3 && planLayers !== config.layers) throw damaged();
  const header = version === 1 ? 16 : version === 2 ? 24 : 28 + 16 * planLayers;
  const n = view.getUint32(12, true);
  if (n !== matrixCount(config) || copy.byteLength !== header + 8 * n) throw damaged();
  const clip = version >= 2 ? { key: view.getFloat32(16, true), value: view.getFloat32(20, true) } : undefined;
  if (clip && (!validClip(clip.key) || !validClip(clip.value))) throw damaged();
  const plan =
    version === 3
      ? planFromWords(
          Array.from({ length: 4 * planLayers }, (_, i) => view.getFloat32(28 + 4 * i, true)),
          config.layers,
        )
      : undefined;
  if (plan === null) throw damaged();
  return {
    tokens: view.getUint32(8, true),
    key: new Float32Array(copy.buffer, header, n),
    value: new Float32Array(copy.buffer, header + 4 * n, n),
    ...(clip ? { clip } : {}),
    ...(plan ? { plan } : {}),
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
  const clipKey = meta[CLIP_KEY_METADATA];
  const clipValue = meta[CLIP_VALUE_METADATA];
  if ((clipKey !== undefined || clipValue !== undefined) && !(validClip(clipKey) && validClip(clipValue))) {
    throw new CorruptModelFileError(
      `The model's ${CLIP_KEY_METADATA}/${CLIP_VALUE_METADATA} must both be clip quantiles in (0.5, 1].`,
    );
  }
  const planEntry = meta[PLAN_METADATA];
  const plan =
    planEntry === undefined
      ? undefined
      : Array.isArray(planEntry)
        ? planFromWords(planEntry as number[], config.layers)
        : null;
  if (plan === null) {
    throw new CorruptModelFileError(
      `The model's ${PLAN_METADATA} must hold, per layer (${config.layers}), K bits, K clip, V bits and V clip: bits 1, 2 or 4, clips in (0.5, 1].`,
    );
  }
  return {
    key: Float32Array.from(key as number[]),
    value: Float32Array.from(value as number[]),
    tokens: typeof tokens === 'number' ? tokens : 0,
    ...(validClip(clipKey) && validClip(clipValue) ? { clip: { key: clipKey, value: clipValue } } : {}),
    ...(plan ? { plan } : {}),
  };
}

/**
 * Calibrated rotations for a model: from its own metadata (the demo model ships them), else from `cache` under the
 * model's digest, else null (the digest is returned either way, for the caller to cache fitted ones).
 */
export async function findStoredRotations(
  file: GgufFile,
  source: ByteSource,
  config: ModelConfig,
  cache: RotationCache | undefined,
): Promise<{ rotations: StoredRotations | null; digest: string; from: 'metadata' | 'cache' | null }> {
  const digest = await modelDigest(file, source);
  const embedded = rotationsFromMetadata(file.metadata, config);
  if (embedded) return { rotations: embedded, digest, from: 'metadata' };
  const cached = cache ? await cache.get(digest) : undefined;
  return cached
    ? { rotations: decodeRotations(cached, config), digest, from: 'cache' }
    : { rotations: null, digest, from: null };
}

/** Metadata entries (for writeGguf) that embed rotations in a model file. */
export function rotationMetadataEntries(r: StoredRotations) {
  return [
    { key: ROTATION_KEY_METADATA, value: Array.from(r.key), type: 'f32[]' as const },
    { key: ROTATION_VALUE_METADATA, value: Array.from(r.value), type: 'f32[]' as const },
    { key: ROTATION_TOKENS_METADATA, value: r.tokens, type: 'u32' as const },
    ...(r.clip
      ? [
          { key: CLIP_KEY_METADATA, value: r.clip.key, type: 'f32' as const },
          { key: CLIP_VALUE_METADATA, value: r.clip.value, type: 'f32' as const },
        ]
      : []),
    ...(r.plan ? [{ key: PLAN_METADATA, value: planWords(r.plan), type: 'f32[]' as const }] : []),
  ];
}

/**
 * The cache these rotations make: K/V stored rotated by them and, in quant mode, pool options that quantize with
 * their precision plan, or (`plan: 'uniform'`, rotations without a plan) with their clip quantiles in every layer
 * (rotations without clip quantiles leave the formats' clipQuantile as it was: 1 unless set). A plan applies to
 * the 2-bit cache only: 1-bit codes (the weak control) and boosted layers keep the uniform formats.
 */
export function withStoredRotations(
  options: KvPoolOptions,
  r: StoredRotations,
  plan: 'calibrated' | 'uniform' = 'calibrated',
): { pool: KvPoolOptions; rotation: KvRotation } {
  const pool: KvPoolOptions = { ...options };
  if (pool.kv === 'quant') {
    const twoBit = (pool.keyFormat?.bits ?? 2) === 2 && (pool.valueFormat?.bits ?? 2) === 2;
    if (r.plan && plan === 'calibrated' && twoBit && !pool.boostLayers?.length) pool.plan = r.plan;
    else if (r.clip) {
      pool.keyFormat = { ...pool.keyFormat, clipQuantile: r.clip.key };
      pool.valueFormat = { ...pool.valueFormat, clipQuantile: r.clip.value };
    }
  }
  return { pool, rotation: { kind: 'calibrated', key: r.key, value: r.value } };
}
