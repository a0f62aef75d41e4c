/**
 * Typed reads of GGUF metadata. A model that lacks a key the runtime needs, or stores it with the wrong type, fails
 * here with the key's name instead of as a NaN somewhere in the model code.
 */
import { CorruptModelFileError, UnsupportedModelError } from '../../core/errors.ts';
import type { GgufMetadata, GgufValue } from '../../core/gguf-types.ts';

function describeValue(value: GgufValue): string {
  if (Array.isArray(value)) return `an array of ${value.length}`;
  return `${typeof value} ${String(value)}`.slice(0, 80);
}

function lookup(meta: GgufMetadata, key: string): GgufValue | undefined {
  return Object.hasOwn(meta, key) ? meta[key] : undefined;
}

function missing(key: string): CorruptModelFileError {
  return new CorruptModelFileError(
    `The model file has no "${key}" metadata, which longtab needs to run it. The file may be incomplete or made by an old converter; convert it again with a current llama.cpp.`,
    { key },
  );
}

function wrongType(key: string, expected: string, value: GgufValue): CorruptModelFileError {
  return new CorruptModelFileError(
    `The model file's "${key}" metadata should be ${expected} but is ${describeValue(value)}. The file is damaged or was made by a broken converter.`,
    { key, expected },
  );
}

/** A number from any numeric GGUF type; 64-bit values beyond 2^53 are refused rather than rounded. */
function toNumber(key: string, value: GgufValue): number {
  if (typeof value === 'number') return value;
  if (typeof value === 'bigint') {
    throw new UnsupportedModelError(
      `The model file's "${key}" is ${value}, too large for longtab to handle exactly. The model is not supported.`,
      { key, value: value.toString() },
    );
  }
  throw wrongType(key, 'a number', value);
}

export function metaHas(meta: GgufMetadata, key: string): boolean {
  return Object.hasOwn(meta, key);
}

export function metaString(meta: GgufMetadata, key: string): string {
  const value = metaOptionalString(meta, key);
  if (value === undefined) throw missing(key);
  return value;
}

export function metaOptionalString(meta: GgufMetadata, key: string): string | undefined {
  const value = lookup(meta, key);
  if (value === undefined) return undefined;
  if (typeof value !== 'string') throw wrongType(key, 'a string', value);
  return value;
}

export function metaNumber(meta: GgufMetadata, key: string): number {
  const value = metaOptionalNumber(meta, key);
  if (value === undefined) throw missing(key);
  return value;
}

export function metaOptionalNumber(meta: GgufMetadata, key: string): number | undefined {
  const value = lookup(meta, key);
  return value === undefined ? undefined : toNumber(key, value);
}

/** A count, length or id: a non-negative integer (sizes and token ids are never fractional or negative). */
export function metaCount(meta: GgufMetadata, key: string): number {
  const value = metaOptionalCount(meta, key);
  if (value === undefined) throw missing(key);
  return value;
}

export function metaOptionalCount(meta: GgufMetadata, key: string): number | undefined {
  const value = metaOptionalNumber(meta, key);
  if (value !== undefined && (!Number.isSafeInteger(value) || value < 0)) {
    throw wrongType(key, 'a non-negative integer', value);
  }
  return value;
}

export function metaBoolean(meta: GgufMetadata, key: string): boolean {
  const value = metaOptionalBoolean(meta, key);
  if (value === undefined) throw missing(key);
  return value;
}

export function metaOptionalBoolean(meta: GgufMetadata, key: string): boolean | undefined {
  const value = lookup(meta, key);
  if (value === undefined) return undefined;
  if (typeof value !== 'boolean') throw wrongType(key, 'a bool', value);
  return value;
}

export function metaArray(meta: GgufMetadata, key: string): GgufValue[] {
  const value = metaOptionalArray(meta, key);
  if (value === undefined) throw missing(key);
  return value;
}

export function metaOptionalArray(meta: GgufMetadata, key: string): GgufValue[] | undefined {
  const value = lookup(meta, key);
  if (value === undefined) return undefined;
  if (!Array.isArray(value)) throw wrongType(key, 'an array', value);
  return value;
}

export function metaStringArray(meta: GgufMetadata, key: string): string[] {
  const value = metaOptionalStringArray(meta, key);
  if (value === undefined) throw missing(key);
  return value;
}

export function metaOptionalStringArray(meta: GgufMetadata, key: string): string[] | undefined {
  const value = metaOptionalArray(meta, key);
  if (value === undefined) return undefined;
  if (!value.every((item) => typeof item === 'string')) throw wrongType(key, 'an array of strings', value);
  return value as string[];
}

export function metaNumberArray(meta: GgufMetadata, key: string): number[] {
  const value = metaOptionalNumberArray(meta, key);
  if (value === undefined) throw missing(key);
  return value;
}

export function metaOptionalNumberArray(meta: GgufMetadata, key: string): number[] | undefined {
  const value = metaOptionalArray(meta, key);
  return value?.map((item) => toNumber(key, item));
}

/** `general.architecture`, the prefix of the model's hyperparameter keys (`llama.embedding_length`, …). */
export function metaArchitecture(meta: GgufMetadata): string {
  return metaString(meta, 'general.architecture');
}
