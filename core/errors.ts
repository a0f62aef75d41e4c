/**
 * Typed errors for everything a user can hit. Each carries a stable `code` so it survives the worker boundary
 * (structured clone drops the prototype) and a message that says what to do about it.
 */
export type LongtabErrorCode =
  | 'webgpu-unavailable'
  | 'gpu-validation'
  | 'device-lost'
  | 'out-of-memory'
  | 'corrupt-model-file'
  | 'unsupported-model'
  | 'context-overflow'
  | 'invalid-request'
  | 'model-not-loaded'
  | 'aborted'
  | 'download-failed'
  | 'storage-quota';

export class LongtabError extends Error {
  readonly code: LongtabErrorCode;
  readonly details: Record<string, unknown>;
  constructor(code: LongtabErrorCode, message: string, details: Record<string, unknown> = {}) {
    super(message);
    this.code = code;
    this.details = details;
    this.name = new.target.name;
  }
}

/** No WebGPU implementation, or no adapter behind it. */
export class WebGpuUnavailableError extends LongtabError {
  constructor(message: string, details: Record<string, unknown> = {}) {
    super('webgpu-unavailable', message, details);
  }
}

/** A WebGPU validation or internal error: always a bug in longtab, never the user's fault. */
export class GpuValidationError extends LongtabError {
  constructor(message: string, details: Record<string, unknown> = {}) {
    super('gpu-validation', message, details);
  }
}

export class DeviceLostError extends LongtabError {
  constructor(message: string, details: Record<string, unknown> = {}) {
    super('device-lost', message, details);
  }
}

export class GpuOutOfMemoryError extends LongtabError {
  constructor(message: string, details: Record<string, unknown> = {}) {
    super('out-of-memory', message, details);
  }
}

/** The bytes are not a valid GGUF file, or contradict themselves. */
export class CorruptModelFileError extends LongtabError {
  constructor(message: string, details: Record<string, unknown> = {}) {
    super('corrupt-model-file', message, details);
  }
}

/** A valid file that uses an architecture, tensor type or tokenizer this runtime does not implement. */
export class UnsupportedModelError extends LongtabError {
  constructor(message: string, details: Record<string, unknown> = {}) {
    super('unsupported-model', message, details);
  }
}

/** A model download or an HTTP Range read failed: network error, HTTP status, or a server without Range support. */
export class DownloadFailedError extends LongtabError {
  constructor(message: string, details: Record<string, unknown> = {}) {
    super('download-failed', message, details);
  }
}

/**
 * What bounds a sequence's tokens, so the advice names it: the model's context length, the KV budget in the pool's
 * mode, or (internal bookkeeping) a sentence of its own.
 */
export type ContextLimit =
  | { kind: 'model-context'; contextLength: number }
  | { kind: 'kv-budget'; kv: 'f16' | 'int2' }
  | { kind: 'other'; hint: string };

const SHORTEN =
  "Shorten the prompt or the conversation (a chat request may pass context_overflow: 'drop_oldest_turns')";

function overflowMessage(needed: number, available: number, limit: ContextLimit, atLeast: boolean): string {
  const count = `${atLeast ? 'at least ' : ''}${needed}`;
  switch (limit.kind) {
    case 'model-context':
      return `This request needs ${count} tokens, but the model's context is ${limit.contextLength} tokens. ${SHORTEN}.`;
    case 'kv-budget':
      return (
        `This request needs ${count} tokens of KV cache, but only ${available} fit the KV budget in the ${limit.kv} KV mode. ` +
        (limit.kv === 'f16'
          ? `${SHORTEN}, raise kvBudgetBytes, or load with kv: 'int2', which holds several times the tokens in the same budget.`
          : `${SHORTEN}, or raise kvBudgetBytes.`)
      );
    case 'other':
      return `This request needs ${count} tokens of KV cache, but only ${available} are available. ${limit.hint}`;
  }
}

export class ContextOverflowError extends LongtabError {
  readonly tokensNeeded: number;
  readonly tokensAvailable: number;
  readonly limit: ContextLimit;
  /**
   * `atLeast`: tokensNeeded is a lower bound, found without tokenizing (a prompt far too long to be worth it), and
   * the message says so.
   */
  constructor(tokensNeeded: number, tokensAvailable: number, limit: ContextLimit, options: { atLeast?: boolean } = {}) {
    super('context-overflow', overflowMessage(tokensNeeded, tokensAvailable, limit, options.atLeast ?? false), {
      tokensNeeded,
      tokensAvailable,
      limit,
      ...(options.atLeast ? { atLeast: true } : {}),
    });
    this.tokensNeeded = tokensNeeded;
    this.tokensAvailable = tokensAvailable;
    this.limit = limit;
  }
}

export class InvalidRequestError extends LongtabError {
  constructor(message: string, details: Record<string, unknown> = {}) {
    super('invalid-request', message, details);
  }
}

export class ModelNotLoadedError extends LongtabError {
  constructor(message = 'No model is loaded: call engine.load(source) first.') {
    super('model-not-loaded', message);
  }
}

export class AbortedError extends LongtabError {
  constructor(message = 'The request was aborted.') {
    super('aborted', message);
  }
}
