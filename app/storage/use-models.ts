/** Stored models and running downloads, shared by the models panel and the model picker. */
import { useCallback, useEffect, useRef, useState } from 'react';
import { DEMO_MODEL_ID, DEMO_MODEL_NAME, DEMO_MODEL_PATH, hubUrl, type ModelPreset } from '../models/presets.ts';
import { downloadInWorker } from './download-client.ts';
import {
  addRemoteModel,
  type DownloadProgress,
  deleteModel,
  ggufExistsAt,
  importLocalFile,
  listModels,
  ModelDownloadError,
  modelIdForUrl,
  type StorageQuota,
  type StoredModel,
  storageQuota,
} from './models.ts';

export interface DownloadState extends DownloadProgress {
  running: boolean;
}

export function useModels(hubBaseUrl: string) {
  const [models, setModels] = useState<StoredModel[]>([]);
  /** False until the stored models have been read once (an empty list before that means nothing). */
  const [listed, setListed] = useState(false);
  const [downloads, setDownloads] = useState<Record<string, DownloadState>>({});
  const [quota, setQuota] = useState<StorageQuota | null>(null);
  const [demoAvailable, setDemoAvailable] = useState<boolean | null>(null);
  const [error, setError] = useState<string | null>(null);
  const controllers = useRef(new Map<string, AbortController>());

  const refresh = useCallback(async () => {
    setModels(await listModels());
    setListed(true);
    setQuota(await storageQuota());
  }, []);

  useEffect(() => {
    void refresh();
    void ggufExistsAt(new URL(DEMO_MODEL_PATH, document.baseURI).href).then(setDemoAvailable);
  }, [refresh]);

  const run = useCallback(
    async (id: string): Promise<StoredModel | null> => {
      if (controllers.current.has(id)) return null;
      const controller = new AbortController();
      controllers.current.set(id, controller);
      setError(null);
      setDownloads((d) => ({
        ...d,
        [id]: { bytesDone: 0, bytesTotal: null, speed: 0, secondsLeft: null, running: true },
      }));
      try {
        const done = await downloadInWorker(
          id,
          (progress) => setDownloads((d) => ({ ...d, [id]: { ...progress, running: true } })),
          controller.signal,
        );
        setDownloads(({ [id]: _, ...rest }) => rest);
        return done;
      } catch (caught) {
        const message = caught instanceof Error ? caught.message : String(caught);
        if (!(caught instanceof ModelDownloadError && caught.code === 'aborted')) setError(message);
        setDownloads(({ [id]: _, ...rest }) => rest);
        return null;
      } finally {
        controllers.current.delete(id);
        await refresh();
      }
    },
    [refresh],
  );

  const downloadPreset = useCallback(
    async (preset: ModelPreset) => {
      const model = await addRemoteModel({
        id: preset.id,
        name: preset.label,
        fileName: preset.file,
        url: hubUrl(hubBaseUrl, preset.repo, preset.file),
        origin: 'preset',
      });
      await refresh();
      return run(model.id);
    },
    [hubBaseUrl, refresh, run],
  );

  const downloadUrl = useCallback(
    async (url: string) => {
      let parsed: URL;
      try {
        parsed = new URL(url, document.baseURI);
      } catch {
        setError(`Not a URL: ${url}`);
        return null;
      }
      const fileName = decodeURIComponent(parsed.pathname.split('/').pop() || 'model.gguf');
      const model = await addRemoteModel({
        id: modelIdForUrl(parsed.href),
        name: fileName,
        fileName,
        url: parsed.href,
        origin: 'url',
      });
      await refresh();
      return run(model.id);
    },
    [refresh, run],
  );

  const downloadDemo = useCallback(async () => {
    const model = await addRemoteModel({
      id: DEMO_MODEL_ID,
      name: DEMO_MODEL_NAME,
      fileName: 'longtab-demo.gguf',
      url: new URL(DEMO_MODEL_PATH, document.baseURI).href,
      origin: 'demo',
    });
    await refresh();
    return run(model.id);
  }, [refresh, run]);

  const importFile = useCallback(
    async (file: File) => {
      setError(null);
      try {
        return await importLocalFile(file);
      } catch (caught) {
        setError(caught instanceof Error ? caught.message : String(caught));
        return null;
      } finally {
        await refresh();
      }
    },
    [refresh],
  );

  const pause = useCallback((id: string) => controllers.current.get(id)?.abort(), []);

  const remove = useCallback(
    async (id: string) => {
      controllers.current.get(id)?.abort();
      await deleteModel(id);
      await refresh();
    },
    [refresh],
  );

  return {
    models,
    listed,
    downloads,
    quota,
    demoAvailable,
    error,
    setError,
    downloadPreset,
    downloadUrl,
    downloadDemo,
    importFile,
    resume: run,
    pause,
    remove,
    refresh,
  };
}

export type ModelsApi = ReturnType<typeof useModels>;
