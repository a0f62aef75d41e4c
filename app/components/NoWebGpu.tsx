/** Shown instead of the chat when the browser has no WebGPU (no navigator.gpu, or no adapter behind it). */
export function NoWebGpu({ reason }: { reason: string | null }) {
  return (
    <main className="no-webgpu" data-testid="webgpu-status" data-state="unavailable">
      <img src="/favicon.svg" alt="" width={48} height={48} />
      <h1>longtab needs WebGPU</h1>
      <p>
        <strong>WebGPU is not available in this browser, so longtab cannot run here.</strong> longtab runs language
        models on your own GPU, inside this tab; nothing is sent to a server.
      </p>
      {reason && <p className="muted">{reason}</p>}
      <p>Open this page in one of:</p>
      <ul>
        <li>Chrome or Edge 113 or newer (desktop; Android 121+)</li>
        <li>Safari 26 (macOS, iOS, iPadOS)</li>
        <li>Firefox 141 or newer on Windows</li>
      </ul>
      <p>with hardware acceleration turned on in the browser settings, over HTTPS or from localhost.</p>
    </main>
  );
}

export type WebGpuCheck =
  | { state: 'checking' }
  | { state: 'available' }
  | { state: 'unavailable'; reason: string | null };

/** Asks for an adapter only (the engine owns the device): enough to know whether chatting can work. */
export async function checkWebGpu(): Promise<WebGpuCheck> {
  if (!('gpu' in navigator) || !navigator.gpu) return { state: 'unavailable', reason: null };
  try {
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) {
      return {
        state: 'unavailable',
        reason:
          'This browser has WebGPU, but it offered no GPU adapter (it may be turned off, or the GPU is blocklisted).',
      };
    }
    return { state: 'available' };
  } catch (error) {
    return { state: 'unavailable', reason: error instanceof Error ? error.message : String(error) };
  }
}
