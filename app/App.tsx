import { useEffect, useState } from 'react';
import { type AdapterSummary, acquireGpu } from '../runtime/gpu/device.ts';

type WebGpuStatus =
  | { state: 'checking' }
  | { state: 'available'; adapter: AdapterSummary; maxBufferMiB: number; shaderF16: boolean }
  | { state: 'unavailable'; reason: string | null };

/**
 * Asks for a device once and gives it back: this placeholder only reports whether longtab can run here.
 * (The chat page will ask the engine worker instead; it owns the device.)
 */
async function probeWebGpu(): Promise<WebGpuStatus> {
  try {
    const gpu = await acquireGpu();
    const status: WebGpuStatus = {
      state: 'available',
      adapter: gpu.adapter,
      maxBufferMiB: Math.floor(gpu.limits.maxBufferSize / 2 ** 20),
      shaderF16: gpu.features.shaderF16,
    };
    gpu.destroy();
    return status;
  } catch (error) {
    // Without navigator.gpu the list below says it all; otherwise the error tells what failed (no adapter, no device).
    const reason = error instanceof Error ? error.message : String(error);
    return { state: 'unavailable', reason: navigator.gpu ? reason : null };
  }
}

function adapterName(adapter: AdapterSummary): string {
  const name = adapter.description || [adapter.vendor, adapter.architecture, adapter.device].filter(Boolean).join(' ');
  return name || 'unnamed adapter';
}

function StatusPanel({ status }: { status: WebGpuStatus }) {
  if (status.state === 'checking') return <p>Checking for WebGPU…</p>;
  if (status.state === 'available') {
    const { adapter } = status;
    return (
      <>
        <p>
          <strong>WebGPU is available.</strong> Adapter: {adapterName(adapter)}
          {adapter.isFallbackAdapter ? ' (a software fallback: expect it to be slow)' : ''}.
        </p>
        <p>
          Largest buffer: {status.maxBufferMiB} MiB; 16-bit shader math: {status.shaderF16 ? 'yes' : 'no'}.
        </p>
      </>
    );
  }
  return (
    <>
      <p>
        <strong>WebGPU is not available in this browser, so longtab cannot run here.</strong>
      </p>
      {status.reason && <p>{status.reason}</p>}
      <p>longtab needs one of:</p>
      <ul>
        <li>Chrome or Edge 113 or newer (desktop; Android 121+)</li>
        <li>Safari 26 (macOS, iOS, iPadOS)</li>
        <li>Firefox 141 or newer on Windows</li>
      </ul>
      <p>with hardware acceleration turned on in the browser settings.</p>
    </>
  );
}

export function App() {
  const [status, setStatus] = useState<WebGpuStatus>({ state: 'checking' });

  useEffect(() => {
    let current = true;
    probeWebGpu().then((result) => {
      if (current) setStatus(result);
    });
    return () => {
      current = false;
    };
  }, []);

  return (
    <main>
      <h1>longtab</h1>
      <p>A local language model runtime for the browser: models run on your own GPU through WebGPU.</p>
      <p>The chat page is coming. For now this page checks whether your browser can run it.</p>
      <section className="status" data-testid="webgpu-status" data-state={status.state} aria-live="polite">
        <StatusPanel status={status} />
      </section>
    </main>
  );
}
