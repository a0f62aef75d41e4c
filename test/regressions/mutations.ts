/**
 * Damaged model files as data: a mutation of stories260K is a truncation and/or (offset, bytes) patches, applied to the
 * shared model at test time, so regression inputs stay a few hundred bytes of JSON and never copy shared/ files.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { GgufFile } from '../../core/gguf-types.ts';

export interface BytePatch {
  offset: number;
  /** Bytes written at `offset`, as hex. Bytes past the end of the (truncated) file are dropped. */
  hex: string;
}

export interface ModelMutation {
  /** What was damaged, in words (goes into docs/faults.md). */
  description: string;
  /** Keep only the first `truncate` bytes. */
  truncate?: number;
  patches: BytePatch[];
}

export const LOADER_REGRESSIONS_DIR = resolve(dirname(fileURLToPath(import.meta.url)), 'loader');

export function applyMutation(original: Uint8Array, mutation: ModelMutation): Uint8Array<ArrayBuffer> {
  const length = Math.min(mutation.truncate ?? original.length, original.length);
  const bytes = new Uint8Array(length);
  bytes.set(original.subarray(0, length));
  for (const patch of mutation.patches) {
    const data = hexToBytes(patch.hex);
    for (let i = 0; i < data.length && patch.offset + i < length; i++) bytes[patch.offset + i] = data[i];
  }
  return bytes;
}

export function hexToBytes(hex: string): Uint8Array {
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = Number.parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}

export function bytesToHex(bytes: Uint8Array): string {
  return [...bytes].map((b) => b.toString(16).padStart(2, '0')).join('');
}

export function u32Hex(value: number): string {
  const b = new Uint8Array(4);
  new DataView(b.buffer).setUint32(0, value >>> 0, true);
  return bytesToHex(b);
}

export function u64Hex(value: bigint): string {
  const b = new Uint8Array(8);
  new DataView(b.buffer).setBigUint64(0, BigInt.asUintN(64, value), true);
  return bytesToHex(b);
}

/** The regression inputs kept in test/regressions/loader/, by file name. */
export function loaderRegressions(): Array<{ file: string; mutation: ModelMutation }> {
  return readdirSync(LOADER_REGRESSIONS_DIR)
    .filter((f) => f.endsWith('.json'))
    .sort()
    .map((file) => ({
      file,
      mutation: JSON.parse(readFileSync(join(LOADER_REGRESSIONS_DIR, file), 'utf8')) as ModelMutation,
    }));
}

/** Byte positions of the header fields a fuzzer aims at, found in the real file's bytes. */
export interface HeaderFields {
  /** Metadata key → where its u32 value type and its value start. */
  keys: Map<string, { typeAt: number; valueAt: number }>;
  /** Tensor name → where its dimension count, dimensions (u64 each), type and data offset sit. */
  tensors: Map<string, { dimCountAt: number; dimsAt: number; typeAt: number; offsetAt: number }>;
  /** Every u64 length or count in the header: tensor and entry counts, key and name lengths, string and array lengths. */
  lengths: number[];
}

export function locateHeaderFields(bytes: Uint8Array, file: GgufFile): HeaderFields {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const header = bytes.subarray(0, file.dataOffset);
  const find = (text: string): number => {
    const encoded = new TextEncoder().encode(text);
    const needle = new Uint8Array(8 + encoded.length);
    new DataView(needle.buffer).setBigUint64(0, BigInt(encoded.length), true);
    needle.set(encoded, 8);
    const at = Buffer.from(header).indexOf(Buffer.from(needle));
    if (at < 0) throw new Error(`header field '${text}' not found`);
    return at;
  };
  const lengths = [8, 16];
  const keys = new Map<string, { typeAt: number; valueAt: number }>();
  for (const key of Object.keys(file.metadata)) {
    const at = find(key);
    lengths.push(at);
    const typeAt = at + 8 + new TextEncoder().encode(key).length;
    const valueAt = typeAt + 4;
    keys.set(key, { typeAt, valueAt });
    const type = view.getUint32(typeAt, true);
    if (type === 8) lengths.push(valueAt); // string length
    if (type === 9) lengths.push(valueAt + 4); // array count
  }
  const tensors = new Map<string, { dimCountAt: number; dimsAt: number; typeAt: number; offsetAt: number }>();
  for (const tensor of file.tensors) {
    const at = find(tensor.name);
    lengths.push(at);
    const dimCountAt = at + 8 + new TextEncoder().encode(tensor.name).length;
    const dims = view.getUint32(dimCountAt, true);
    const dimsAt = dimCountAt + 4;
    const typeAt = dimsAt + 8 * dims;
    tensors.set(tensor.name, { dimCountAt, dimsAt, typeAt, offsetAt: typeAt + 4 });
  }
  return { keys, tensors, lengths };
}
