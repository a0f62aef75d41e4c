/**
 * The engine's life in the page: start it once, load the selected model (again when the model or the KV settings
 * change, or after the device was lost), follow its live stats. Conversations never live here: they are in IndexedDB.
 * Their KV persists in the engine's KV store (OPFS) where the engine has one, so a conversation resumes after a
 * reload without reading its history again; the page reaches that store through the engine while one runs, else
 * directly (workers/stored-kv.ts).
 *
 * The latest request wins. The engine cannot stop a load half way, so a load that a newer request supersedes runs to
 * its end unseen (it never shows as ready, and its progress and errors are not shown), then the newer load, queued
 * behind it, replaces it: the engine's load() frees the previous model's GPU memory before it reads the next one.
 * Requests superseded before their turn came are skipped.
 */
import { useCallback, useEffect, useRef, useState } from 'react';
import { clearStoredKvInOrigin, removeStoredConversationKv, storedKvInOrigin } from '../../workers/stored-kv.ts';
import { type EngineHandle, errorCode, errorMessage, startEngine } from './engine-client.ts';
import type { ChatEngine, EngineStats, KvMode, LoadProgress, ModelInfo, StoredKvUsage } from './types.ts';

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
  /** Key and label of the request whose model is loaded (status 'ready'). */
  loadedKey: string | null;
  loadedLabel: string | null;
  /** Key of the request being loaded (status 'loading'); `progress` is that load's. */
  loadingKey: string | null;
  progress: LoadProgress | null;
  error: { code: string | null; message: string } | null;
  /**
   * Key of the request whose load failed last (null once a load starts, or once the page asks for another key or
   * none): the page does not load it again by itself, only for a message or another choice.
   */
  failedKey: string | null;
  stats: EngineStats | null;
}

/** The page's state while `key` is the model coming: no error, no failure held, no progress yet. */
function loadingState(s: EngineState, key: string): EngineState {
  return { ...s, status: 'loading', loadingKey: key, error: null, failedKey: null, progress: null };
}

export function useEngine() {
  const handleRef = useRef<Promise<EngineHandle> | null>(null);
  const unsubscribeRef = useRef<(() => void) | null>(null);
  /** What the engine holds (also a superseded load's model, until the next load replaces it). */
  const loadedRef = useRef<{ key: string; label: string; model: ModelInfo } | null>(null);
  /** What the last failed load said (null once a load succeeds): a reply that could not run names it. */
  const loadErrorRef = useRef<string | null>(null);
  const loadingRef = useRef<{ key: string; done: Promise<ChatEngine | null> } | null>(null);
  /** Key of the latest request: only its load may change what the page shows. */
  const wantedRef = useRef<string | null>(null);
  const [state, setState] = useState<EngineState>({
    status: 'idle',
    model: null,
    loadedKey: null,
    loadedLabel: null,
    loadingKey: null,
    progress: null,
    error: null,
    failedKey: null,
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
    loadedRef.current = null;
    setState((s) => ({
      ...s,
      status: 'idle',
      model: null,
      loadedKey: null,
      loadedLabel: null,
      loadingKey: null,
      stats: null,
    }));
    if (old) await (await old.catch(() => null))?.dispose().catch(() => {});
  }, []);

  const load = useCallback(
    async (request: LoadRequest): Promise<ChatEngine | null> => {
      wantedRef.current = request.key;
      const wanted = () => wantedRef.current === request.key;
      setState((s) => loadingState(s, request.key));
      loadedRef.current = null;
      try {
        const { engine } = await handle();
        const source = await request.open();
        // Every conversation persists where the engine has a KV store (storedKv() is null without one, and a load
        // that asked for persist there would be refused).
        const persist = (await engine.storedKv().catch(() => null)) !== null;
        const model = await engine.load(source, {
          // The page's int2 is the engine's default (kv omitted): int2 where the model allows it, else f16, rather than
          // a failed load; the chip and the stats show the mode the model got.
          kv: request.kv === 'f16' ? 'f16' : undefined,
          kvBudgetBytes: request.kvBudgetBytes,
          persist,
          onProgress: (progress) => {
            if (wanted()) setState((s) => ({ ...s, progress }));
          },
        });
        loadedRef.current = { key: request.key, label: request.label, model };
        loadErrorRef.current = null;
        // Superseded meanwhile: the newer load, queued behind this one, replaces this model; never show it as ready.
        if (!wanted()) return null;
        setState((s) => ({
          ...s,
          status: 'ready',
          model,
          loadedKey: request.key,
          loadedLabel: request.label,
          loadingKey: null,
          progress: null,
        }));
        return engine;
      } catch (error) {
        const code = errorCode(error);
        const message = `Could not load ${request.label}: ${errorMessage(error)}`;
        loadErrorRef.current = message;
        if (wanted()) {
          setState((s) => ({
            ...s,
            status: 'error',
            model: null,
            loadedKey: null,
            loadedLabel: null,
            loadingKey: null,
            error: { code, message },
            failedKey: request.key,
          }));
        }
        if (code === 'device-lost') await discard();
        else if (wanted()) {
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

  /**
   * The engine with this model and KV setup loaded: reuses the loaded one, joins a load in flight, or loads (after
   * the load in flight, which this request supersedes). Resolves null when the load failed or a newer request
   * superseded this one before its turn.
   */
  const ensure = useCallback(
    async (request: LoadRequest): Promise<ChatEngine | null> => {
      wantedRef.current = request.key;
      if (loadingRef.current?.key === request.key) return loadingRef.current.done;
      if (!loadingRef.current && loadedRef.current?.key === request.key && handleRef.current) {
        return (await handleRef.current).engine;
      }
      const previous = loadingRef.current?.done;
      if (previous) {
        // Until the superseded load ends, the page shows this one as the model coming.
        setState((s) => loadingState(s, request.key));
      }
      const done = (async () => {
        await previous?.catch(() => null);
        if (wantedRef.current !== request.key) return null;
        const loaded = loadedRef.current;
        if (loaded?.key === request.key && handleRef.current) {
          // Back to the model the engine holds (a load superseded by a request that was itself superseded).
          setState((s) => ({
            ...s,
            status: 'ready',
            model: loaded.model,
            loadedKey: loaded.key,
            loadedLabel: loaded.label,
            loadingKey: null,
            progress: null,
          }));
          return (await handleRef.current).engine;
        }
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

  /** Fault injection (debug pages only): loses the running engine's GPU device. */
  const destroyDevice = useCallback(async () => {
    const current = await handleRef.current;
    if (!current) throw new Error('No engine is running.');
    await current.destroyDevice();
  }, []);

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
            // The engine's message says what was lost and to reload; the page's banner adds the way to do it.
            message: errorMessage(error),
          },
        }));
      }
    },
    [discard],
  );

  /** The running engine, or null (never starts one). */
  const running = useCallback(async (): Promise<ChatEngine | null> => {
    const current = await handleRef.current?.catch(() => null);
    return current?.engine ?? null;
  }, []);

  /**
   * Frees a deleted conversation's KV: its cache and stored copy through the engine when one runs (it may be writing
   * that copy), else the stored copy straight from OPFS (never starts an engine for that).
   */
  const forget = useCallback(
    async (conversationId: string) => {
      const engine = await running();
      const done = await engine?.deleteConversation(conversationId).then(
        () => true,
        () => false,
      );
      if (!done) await removeStoredConversationKv(conversationId).catch(() => {});
    },
    [running],
  );

  /** What the KV store holds, of every model (null: this browser has none). */
  const storedKv = useCallback(async (): Promise<StoredKvUsage | null> => {
    const engine = await running();
    return engine ? engine.storedKv() : storedKvInOrigin();
  }, [running]);

  /** Removes every conversation's stored KV (their next turn reads the history again). */
  const clearStoredKv = useCallback(async (): Promise<void> => {
    const engine = await running();
    await (engine ? engine.clearStoredKv() : clearStoredKvInOrigin());
  }, [running]);

  useEffect(
    () => () => {
      unsubscribeRef.current?.();
      void handleRef.current?.then((h) => h.dispose()).catch(() => {});
    },
    [],
  );

  const lastLoadError = useCallback(() => loadErrorRef.current, []);
  /** Ends what a failed load's key holds back (the page asks for another model, or none, meanwhile). */
  const forgetFailure = useCallback(() => setState((s) => (s.failedKey === null ? s : { ...s, failedKey: null })), []);

  return {
    state,
    load,
    ensure,
    engine,
    reportError,
    discard,
    forget,
    storedKv,
    clearStoredKv,
    destroyDevice,
    lastLoadError,
    forgetFailure,
  };
}
