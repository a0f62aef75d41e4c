/** The adapter lines of the page from AdapterStats as the engine fills them (no GPU, no DOM). */
import { describe, expect, it } from 'vitest';
import type { EngineStats } from '../engine/types.ts';
import { adapterLabel, softwareAdapterName, softwareAdapterNote } from './adapter-note.ts';

type Adapter = NonNullable<EngineStats['adapter']>;

function adapter(info: Partial<Adapter>): Adapter {
  return { vendor: '', architecture: '', device: '', description: '', isFallbackAdapter: false, ...info } as Adapter;
}

describe('the adapter note', () => {
  it('names SwiftShader, lavapipe and llvmpipe from whichever field carries them, and a fallback adapter', () => {
    // Chromium's SwiftShader (info sanitized: no description), Dawn's lavapipe in Node, Firefox's llvmpipe.
    expect(softwareAdapterName(adapter({ vendor: 'google', architecture: 'swiftshader' }))).toBe('SwiftShader');
    expect(softwareAdapterName(adapter({ description: 'llvmpipe (LLVM 15.0.6, 256 bits)' }))).toBe('llvmpipe');
    expect(softwareAdapterName(adapter({ vendor: 'mesa', device: 'lavapipe' }))).toBe('lavapipe');
    expect(softwareAdapterName(adapter({ vendor: 'x', isFallbackAdapter: true }))).toBe('a fallback adapter');
    expect(softwareAdapterNote(adapter({ architecture: 'swiftshader' }))).toBe(
      'WebGPU runs in software here (SwiftShader), on the CPU: expect replies many times slower than on a GPU.',
    );
  });

  it('says nothing on a hardware GPU or before the engine has one', () => {
    const nvidia = adapter({ vendor: 'nvidia', architecture: 'hopper', description: 'NVIDIA H100 80GB HBM3' });
    expect(softwareAdapterName(nvidia)).toBeNull();
    expect(softwareAdapterNote(nvidia)).toBeNull();
    expect(softwareAdapterNote(null)).toBeNull();
    expect(adapterLabel(nvidia)).toBe('NVIDIA H100 80GB HBM3');
    expect(adapterLabel(adapter({ vendor: 'google', architecture: 'swiftshader' }))).toBe('google swiftshader');
  });
});
