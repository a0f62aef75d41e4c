/**
 * Typed errors across a structured-clone boundary (the engine worker): the prototype does not survive, so errors
 * travel as plain objects and are rebuilt as the LongtabError subclass their `code` names.
 */
import {
  AbortedError,
  type ContextLimit,
  ContextOverflowError,
  CorruptModelFileError,
  DeviceLostError,
  DownloadFailedError,
  GpuOutOfMemoryError,
  GpuValidationError,
  InvalidRequestError,
  LongtabError,
  type LongtabErrorCode,
  ModelNotLoadedError,
  UnsupportedModelError,
  WebGpuUnavailableError,
} from '../../core/errors.ts';

export interface WireError {
  longtabError: true;
  /** null for errors that are not LongtabErrors (bugs): rebuilt as a plain Error with the same name and message. */
  code: LongtabErrorCode | null;
  name: string;
  message: string;
  details: Record<string, unknown>;
  stack?: string;
}

export function isWireError(value: unknown): value is WireError {
  return typeof value === 'object' && value !== null && (value as WireError).longtabError === true;
}

/** Details must survive structured clone: keep only JSON-like values. */
function cloneableDetails(details: Record<string, unknown>): Record<string, unknown> {
  try {
    return JSON.parse(JSON.stringify(details)) as Record<string, unknown>;
  } catch {
    return {};
  }
}

export function toWireError(error: unknown): WireError {
  if (isWireError(error)) return error;
  if (error instanceof LongtabError) {
    return {
      longtabError: true,
      code: error.code,
      name: ERROR_NAMES[error.code] ?? error.name,
      message: error.message,
      details: cloneableDetails(error.details),
      stack: error.stack,
    };
  }
  const e = error instanceof Error ? error : new Error(String(error));
  return { longtabError: true, code: null, name: e.name, message: e.message, details: {}, stack: e.stack };
}

/**
 * Class names by code, as string literals: `new.target.name` is mangled by minifiers (a production worker bundle
 * reports 'p'), so names are restored from the code on both sides.
 */
const ERROR_NAMES: Record<LongtabErrorCode, string> = {
  'webgpu-unavailable': 'WebGpuUnavailableError',
  'gpu-validation': 'GpuValidationError',
  'device-lost': 'DeviceLostError',
  'out-of-memory': 'GpuOutOfMemoryError',
  'corrupt-model-file': 'CorruptModelFileError',
  'unsupported-model': 'UnsupportedModelError',
  'context-overflow': 'ContextOverflowError',
  'invalid-request': 'InvalidRequestError',
  'model-not-loaded': 'ModelNotLoadedError',
  aborted: 'AbortedError',
  'download-failed': 'DownloadFailedError',
  'storage-quota': 'LongtabError',
};

/** The limit a context-overflow error carried across the wire (its own message as the hint if it is malformed). */
function wireLimit(limit: unknown, message: string): ContextLimit {
  const l = limit as Partial<Record<string, unknown>> | null;
  if (l?.kind === 'model-context' && typeof l.contextLength === 'number') {
    return { kind: 'model-context', contextLength: l.contextLength };
  }
  if (l?.kind === 'kv-budget' && (l.kv === 'f16' || l.kv === 'int2')) return { kind: 'kv-budget', kv: l.kv };
  return { kind: 'other', hint: typeof l?.hint === 'string' ? l.hint : message };
}

const BUILDERS: Record<LongtabErrorCode, (w: WireError) => LongtabError> = {
  'webgpu-unavailable': (w) => new WebGpuUnavailableError(w.message, w.details),
  'gpu-validation': (w) => new GpuValidationError(w.message, w.details),
  'device-lost': (w) => new DeviceLostError(w.message, w.details),
  'out-of-memory': (w) => new GpuOutOfMemoryError(w.message, w.details),
  'corrupt-model-file': (w) => new CorruptModelFileError(w.message, w.details),
  'unsupported-model': (w) => new UnsupportedModelError(w.message, w.details),
  'context-overflow': (w) =>
    new ContextOverflowError(
      Number(w.details.tokensNeeded ?? 0),
      Number(w.details.tokensAvailable ?? 0),
      wireLimit(w.details.limit, w.message),
      { atLeast: w.details.atLeast === true },
    ),
  'invalid-request': (w) => new InvalidRequestError(w.message, w.details),
  'model-not-loaded': (w) => new ModelNotLoadedError(w.message),
  aborted: (w) => new AbortedError(w.message),
  'download-failed': (w) => new DownloadFailedError(w.message, w.details),
  'storage-quota': (w) => new LongtabError('storage-quota', w.message, w.details),
};

/** The error as it was thrown on the other side: same class (by code), message and details. */
export function fromWireError(wire: WireError): Error {
  const build = wire.code ? BUILDERS[wire.code] : undefined;
  const error: Error = build ? build(wire) : Object.assign(new Error(wire.message), { name: wire.name });
  // Messages are kept verbatim (ContextOverflowError composes its own; the sender's may carry a hint).
  error.message = wire.message;
  if (wire.code && ERROR_NAMES[wire.code]) error.name = ERROR_NAMES[wire.code];
  if (error instanceof LongtabError) Object.assign(error.details, wire.details);
  if (wire.stack) error.stack = `${error.name}: ${wire.message}\n    (in the engine worker)\n${wire.stack}`;
  return error;
}
