/** The library entry (`npm run build:lib`): the worker-backed engine, its types and the typed errors. */

export * from '../core/errors.ts';
export type * from '../runtime/engine/api-types.ts';
export { type CreateEngineOptions, createEngine, type EngineClient } from './client.ts';
