/**
 * Downloads run here so the bytes go to OPFS through a sync access handle (in-place writes, cheap flushes), off the
 * main thread. One download per worker; the page starts one worker per running download (download-client.ts).
 */
import { type DownloadProgress, downloadModel, ModelDownloadError, type StoredModel } from './models.ts';

export type DownloadRequest = { type: 'start'; id: string } | { type: 'abort' };
export type DownloadReply =
  | { type: 'progress'; progress: DownloadProgress }
  | { type: 'done'; model: StoredModel }
  | { type: 'error'; code: ModelDownloadError['code']; message: string };

const scope = self as unknown as { postMessage(message: DownloadReply): void; onmessage: unknown };
const controller = new AbortController();

scope.onmessage = async (event: MessageEvent<DownloadRequest>) => {
  const request = event.data;
  if (request.type === 'abort') {
    controller.abort();
    return;
  }
  try {
    const model = await downloadModel(
      request.id,
      (progress) => scope.postMessage({ type: 'progress', progress }),
      controller.signal,
    );
    scope.postMessage({ type: 'done', model });
  } catch (error) {
    scope.postMessage({
      type: 'error',
      code: error instanceof ModelDownloadError ? error.code : 'download-failed',
      message: error instanceof Error ? error.message : String(error),
    });
  }
};
