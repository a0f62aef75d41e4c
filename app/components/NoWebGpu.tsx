/**
 * Shown instead of the chat when chatting cannot work here: the browser offers no WebGPU (or hides it outside a
 * secure context), or it has WebGPU but no adapter behind it. The page states the one cause that applies and what
 * to do about it.
 */
export type WebGpuUnavailable =
  | { cause: 'no-webgpu' }
  | { cause: 'insecure-context' }
  | { cause: 'no-adapter' }
  | { cause: 'adapter-error'; detail: string };

const BROWSERS = (
  <>
    <p>Open this page in one of:</p>
    <ul>
      <li>Chrome or Edge 113 or newer (desktop; Android 121+)</li>
      <li>Safari 26 (macOS, iOS, iPadOS)</li>
      <li>Firefox 141 or newer on Windows</li>
    </ul>
    <p>with hardware acceleration turned on in the browser settings, over HTTPS or from localhost.</p>
  </>
);

const ADAPTER_ADVICE = (
  <p>
    Turn on hardware acceleration in the browser settings and restart it; if it is on, the GPU or its driver may be
    blocklisted (Chrome and Edge list the reason at chrome://gpu), and a driver update usually helps.
  </p>
);

function headline(unavailable: WebGpuUnavailable): string {
  switch (unavailable.cause) {
    case 'no-webgpu':
      return 'This browser does not offer WebGPU, so longtab cannot run in it.';
    case 'insecure-context':
      return 'This page is not served over HTTPS or from localhost, so the browser hides WebGPU from it.';
    case 'no-adapter':
      return 'This browser has WebGPU, but it offered no GPU adapter, so longtab cannot run here yet.';
    case 'adapter-error':
      return `This browser has WebGPU, but asking it for a GPU adapter failed: ${unavailable.detail}`;
  }
}

export function NoWebGpu({ unavailable }: { unavailable: WebGpuUnavailable }) {
  const browserCause = unavailable.cause === 'no-webgpu' || unavailable.cause === 'insecure-context';
  return (
    <main className="no-webgpu" data-testid="webgpu-status" data-state="unavailable" data-cause={unavailable.cause}>
      <img src="/favicon.svg" alt="" width={48} height={48} />
      <h1>longtab needs WebGPU</h1>
      <p>
        <strong>{headline(unavailable)}</strong> longtab runs language models on your own GPU, inside this tab; nothing
        is sent to a server.
      </p>
      {unavailable.cause === 'insecure-context' && (
        <p>Open it at an https:// address, or at http://localhost on this machine.</p>
      )}
      {browserCause ? BROWSERS : ADAPTER_ADVICE}
    </main>
  );
}

export type WebGpuCheck =
  | { state: 'checking' }
  | { state: 'available' }
  | ({ state: 'unavailable' } & WebGpuUnavailable);

/** Asks for an adapter only (the engine owns the device): enough to know whether chatting can work. */
export async function checkWebGpu(): Promise<WebGpuCheck> {
  if (!('gpu' in navigator) || !navigator.gpu) {
    return { state: 'unavailable', cause: window.isSecureContext === false ? 'insecure-context' : 'no-webgpu' };
  }
  try {
    const adapter = await navigator.gpu.requestAdapter();
    return adapter ? { state: 'available' } : { state: 'unavailable', cause: 'no-adapter' };
  } catch (error) {
    return {
      state: 'unavailable',
      cause: 'adapter-error',
      detail: error instanceof Error ? error.message : String(error),
    };
  }
}
