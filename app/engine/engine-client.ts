/**
 * The one place the chat page meets the engine. It prefers the worker client (`createEngine()` from
 * workers/client.ts); while that module is not in the tree it falls back to the same OpenAI-shaped engine run
 * in-process (runtime/engine/api.ts). Both are found with import.meta.glob so a build never depends on either file
 * existing, and both are used only through the ChatEngine interface from ./types.ts.
 */
import type { ChatEngine } from './types.ts';

type WorkerClientModule = { createEngine: () => ChatEngine | Promise<ChatEngine> };
type InProcessModule = { LongtabEngine: new () => ChatEngine };

const workerClients = import.meta.glob<WorkerClientModule>('../../workers/client.ts');
const inProcessEngines = import.meta.glob<InProcessModule>('../../runtime/engine/api.ts');

export type EngineTransport = 'worker' | 'in-process';

export interface EngineHandle {
  engine: ChatEngine;
  transport: EngineTransport;
  /** Ends the engine for good (terminates the worker, or unloads the in-process model). */
  dispose(): Promise<void>;
}

export async function startEngine(): Promise<EngineHandle> {
  const workerModule = Object.values(workerClients)[0];
  if (workerModule) {
    const engine = await (await workerModule()).createEngine();
    const disposable = engine as ChatEngine & { terminate?: () => void; dispose?: () => void | Promise<void> };
    return {
      engine,
      transport: 'worker',
      async dispose() {
        await engine.unload().catch(() => {});
        disposable.terminate?.();
        await disposable.dispose?.();
      },
    };
  }
  const inProcess = Object.values(inProcessEngines)[0];
  if (!inProcess) throw new Error('This build has no engine: neither workers/client.ts nor runtime/engine/api.ts.');
  const engine = new (await inProcess()).LongtabEngine();
  const destroyable = engine as ChatEngine & { destroy?: () => void };
  return {
    engine,
    transport: 'in-process',
    async dispose() {
      await engine.unload().catch(() => {});
      destroyable.destroy?.();
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
