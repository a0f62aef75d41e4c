/** The library entry (`npm run build:lib`): the worker-backed engine, its types and the typed errors. */

export * from '../core/errors.ts';
export type * from '../runtime/engine/api-types.ts';
/** The engine's limits on a request's `stop`: strings, and characters of each. */
export { MAX_STOP_CHARS, MAX_STOP_STRINGS } from '../runtime/engine/validate.ts';
/** Buffers the KV cache binds (each at most the adapter's maxStorageBufferBindingSize): they cap its budget. */
export { MAX_KV_SLABS } from '../runtime/kv/page-ledger.ts';
export { type CreateEngineOptions, createEngine, type EngineClient } from './client.ts';
