/** What the page says about the GPU adapter: its name, and a note on speed when WebGPU runs in software on the CPU. */
import type { EngineStats } from '../engine/types.ts';

type Adapter = NonNullable<EngineStats['adapter']>;

/** Software WebGPU implementations, by a word their adapter info carries. */
const SOFTWARE_ADAPTERS: ReadonlyArray<[RegExp, string]> = [
  [/swiftshader/i, 'SwiftShader'],
  [/lavapipe/i, 'lavapipe'],
  [/llvmpipe/i, 'llvmpipe'],
  [/microsoft basic render/i, 'WARP'],
];

/** The adapter as one line: its description where the browser gives one, else vendor and architecture. */
export function adapterLabel(adapter: Adapter): string {
  return (
    adapter.description || adapter.device || [adapter.vendor, adapter.architecture].filter(Boolean).join(' ') || '—'
  );
}

/** The software implementation behind `adapter` ('a fallback adapter' where only isFallbackAdapter says so); null for hardware. */
export function softwareAdapterName(adapter: Adapter | null): string | null {
  if (!adapter) return null;
  const info = [adapter.vendor, adapter.architecture, adapter.device, adapter.description].join(' ');
  for (const [pattern, name] of SOFTWARE_ADAPTERS) if (pattern.test(info)) return name;
  return adapter.isFallbackAdapter ? 'a fallback adapter' : null;
}

/** The note a software adapter gets on the page; null on a hardware GPU. */
export function softwareAdapterNote(adapter: Adapter | null): string | null {
  const name = softwareAdapterName(adapter);
  if (!name) return null;
  return `WebGPU runs in software here (${name}), on the CPU: expect replies many times slower than on a GPU.`;
}
