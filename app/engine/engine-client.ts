/**
 * The one place the chat page meets the engine: `createEngine()` from workers/client.ts (the engine in a module
 * worker), used only through the ChatEngine interface from ./types.ts so the UI does not depend on its details.
 */
import { createEngine } from '../../workers/client.ts';
import type { ChatEngine } from './types.ts';

export interface EngineHandle {
  engine: ChatEngine;
  /** Ends the engine for good: the worker, its GPU device and everything loaded. */
  dispose(): Promise<void>;
  /** Destroys the worker's GPU device (fault injection; only a debug engine accepts it). */
  destroyDevice(): Promise<void>;
}

/**
 * Debug mode (`?debug=1` in the page's URL): the engine worker accepts fault injection (see workers/protocol.ts)
 * and the page exposes it as `window.longtabDebug` for the e2e tests. Off in every ordinary page load.
 */
export function pageDebug(): boolean {
  return new URLSearchParams(window.location.search).get('debug') === '1';
}

export async function startEngine(): Promise<EngineHandle> {
  const client = createEngine({ debug: pageDebug() });
  const engine: ChatEngine = client;
  return {
    engine,
    destroyDevice: () => client.debug('destroyDevice'),
    async dispose() {
      await engine.unload().catch(() => {});
      client.terminate();
    },
  };
}

/** A typed engine error keeps its `code` across the worker boundary; anything else is a bug or a browser error. */
export function errorCode(error: unknown): string | null {
  if (typeof error === 'object' && error !== null && typeof (error as { code?: unknown }).code === 'string') {
    return (error as { code: string }).code;
  }
  return null;
}

export function errorMessage(error: unknown): string {
  if (error instanceof Error) return error.message;
  if (typeof error === 'object' && error !== null && typeof (error as { message?: unknown }).message === 'string') {
    return (error as { message: string }).message;
  }
  return String(error);
}
