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

export class ContextOverflowError extends LongtabError {
  readonly tokensNeeded: number;
  readonly tokensAvailable: number;
  constructor(tokensNeeded: number, tokensAvailable: number, hint = '') {
    super(
      'context-overflow',
      `This request needs ${tokensNeeded} tokens of KV cache but only ${tokensAvailable} fit the budget.` +
        (hint ? ` ${hint}` : ' Shorten the conversation, raise kvBudgetBytes, or use the int2 KV mode.'),
      { tokensNeeded, tokensAvailable },
    );
    this.tokensNeeded = tokensNeeded;
    this.tokensAvailable = tokensAvailable;
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
