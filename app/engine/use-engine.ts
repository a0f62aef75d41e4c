/**
 * The engine's life in the page: start it once, load the selected model (again when the model or the KV settings
 * change, or after the device was lost), follow its live stats. Conversations never live here: they are in IndexedDB.
 */
import { useCallback, useEffect, useRef, useState } from 'react';
import { type EngineHandle, errorCode, errorMessage, startEngine } from './engine-client.ts';
import type { ChatEngine, EngineStats, KvMode, LoadProgress, ModelInfo } from './types.ts';

export type EngineStatus = 'idle' | 'loading' | 'ready' | 'error';

export interface LoadRequest {
  key: string;
  label: string;
  open: () => Promise<Blob | string>;
  kv: KvMode;
  kvBudgetBytes: number;
}

export interface EngineState {
  status: EngineStatus;
  model: ModelInfo | null;
  loadedKey: string | null;
  progress: LoadProgress | null;
  error: { code: string | null; message: string } | null;
  stats: EngineStats | null;
}

export function useEngine() {
  const handleRef = useRef<Promise<EngineHandle> | null>(null);
  const unsubscribeRef = useRef<(() => void) | null>(null);
  const loadedKeyRef = useRef<string | null>(null);
  const loadingRef = useRef<{ key: string; done: Promise<ChatEngine | null> } | null>(null);
  const [state, setState] = useState<EngineState>({
    status: 'idle',
    model: null,
    loadedKey: null,
    progress: null,
    error: null,
    stats: null,
  });

  const handle = useCallback(async (): Promise<EngineHandle> => {
    if (!handleRef.current) {
      const started = startEngine();
      handleRef.current = started;
      started.catch(() => {
        handleRef.current = null;
      });
      const engineHandle = await started;
      const unsubscribe = await engineHandle.engine.subscribeStats((stats) => setState((s) => ({ ...s, stats })));
      unsubscribeRef.current = unsubscribe;
    }
    return handleRef.current;
  }, []);

  /** After a lost device (or a broken worker) the engine is thrown away; the next load starts a fresh one. */
  const discard = useCallback(async () => {
    const old = handleRef.current;
    handleRef.current = null;
    unsubscribeRef.current?.();
    unsubscribeRef.current = null;
    loadedKeyRef.current = null;
    setState((s) => ({ ...s, status: 'idle', model: null, loadedKey: null, stats: null }));
    if (old) await (await old.catch(() => null))?.dispose().catch(() => {});
  }, []);

  const load = useCallback(
    async (request: LoadRequest): Promise<ChatEngine | null> => {
      setState((s) => ({ ...s, status: 'loading', error: null, progress: null }));
      loadedKeyRef.current = null;
      try {
        const { engine } = await handle();
        const source = await request.open();
        const model = await engine.load(source, {
          kv: request.kv,
          kvBudgetBytes: request.kvBudgetBytes,
          onProgress: (progress) => setState((s) => ({ ...s, progress })),
        });
        loadedKeyRef.current = request.key;
        setState((s) => ({ ...s, status: 'ready', model, loadedKey: request.key, progress: null }));
        return engine;
      } catch (error) {
        const code = errorCode(error);
        setState((s) => ({
          ...s,
          status: 'error',
          model: null,
          loadedKey: null,
          error: { code, message: `Could not load ${request.label}: ${errorMessage(error)}` },
        }));
        if (code === 'device-lost') await discard();
        else {
          // A failed load leaves no model behind: show the engine's numbers as they are now, not the old model's.
          const current = await handleRef.current?.catch(() => null);
          const stats = await current?.engine.stats().catch(() => null);
          if (stats) setState((s) => ({ ...s, stats }));
        }
        return null;
      }
    },
    [handle, discard],
  );

  /** The engine with this model and KV setup loaded: reuses the loaded one, joins a load in flight, or loads. */
  const ensure = useCallback(
    async (request: LoadRequest): Promise<ChatEngine | null> => {
      if (loadedKeyRef.current === request.key && handleRef.current) return (await handleRef.current).engine;
      if (loadingRef.current?.key === request.key) return loadingRef.current.done;
      const previous = loadingRef.current?.done;
      const done = (async () => {
        await previous?.catch(() => null);
        if (loadedKeyRef.current === request.key && handleRef.current) return (await handleRef.current).engine;
        return load(request);
      })();
      loadingRef.current = { key: request.key, done };
      try {
        return await done;
      } finally {
        if (loadingRef.current?.done === done) loadingRef.current = null;
      }
    },
    [load],
  );

  const engine = useCallback(async (): Promise<ChatEngine> => (await handle()).engine, [handle]);

  const reportError = useCallback(
    async (error: unknown) => {
      const code = errorCode(error);
      if (code === 'device-lost') {
        await discard();
        setState((s) => ({
          ...s,
          status: 'error',
          error: {
            code,
            message: `${errorMessage(error)} Your conversation is saved; the model reloads on the next message.`,
          },
        }));
      }
    },
    [discard],
  );

  /** Frees a deleted conversation's KV cache, if an engine is running (never starts one for that). */
  const forget = useCallback(async (conversationId: string) => {
    const current = await handleRef.current?.catch(() => null);
    await current?.engine.deleteConversation(conversationId).catch(() => {});
  }, []);

  useEffect(
    () => () => {
      unsubscribeRef.current?.();
      void handleRef.current?.then((h) => h.dispose()).catch(() => {});
    },
    [],
  );

  return { state, load, ensure, engine, reportError, discard, forget };
}
