/** Runs a model download in download.worker.ts, or on this thread where module workers are missing. */
import type { DownloadReply, DownloadRequest } from './download.worker.ts';
import { type DownloadProgress, downloadModel, ModelDownloadError, type StoredModel } from './models.ts';

export function downloadInWorker(
  id: string,
  onProgress: (progress: DownloadProgress) => void,
  signal: AbortSignal,
): Promise<StoredModel> {
  let worker: Worker;
  try {
    worker = new Worker(new URL('./download.worker.ts', import.meta.url), { type: 'module', name: 'longtab-download' });
  } catch {
    return downloadModel(id, onProgress, signal);
  }
  return new Promise<StoredModel>((resolve, reject) => {
    const send = (message: DownloadRequest) => worker.postMessage(message);
    const onAbort = () => send({ type: 'abort' });
    signal.addEventListener('abort', onAbort, { once: true });
    const end = () => {
      signal.removeEventListener('abort', onAbort);
      worker.terminate();
    };
    worker.onmessage = (event: MessageEvent<DownloadReply>) => {
      const reply = event.data;
      if (reply.type === 'progress') onProgress(reply.progress);
      else if (reply.type === 'done') {
        end();
        resolve(reply.model);
      } else {
        end();
        reject(new ModelDownloadError(reply.code, reply.message));
      }
    };
    worker.onerror = (event) => {
      end();
      reject(new ModelDownloadError('download-failed', `The download worker failed: ${event.message}`));
    };
    send({ type: 'start', id });
  });
}
