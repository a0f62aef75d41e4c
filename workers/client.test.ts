/** The client hands the worker model URLs resolved against the page, not against the worker's script. */
import { describe, expect, it } from 'vitest';
import { resolveModelSource } from './client.ts';

describe('resolveModelSource', () => {
  const page = 'https://example.org/app/chat/index.html';
  it('resolves a relative URL against the page', () => {
    expect(resolveModelSource('models/demo.gguf', page)).toBe('https://example.org/app/chat/models/demo.gguf');
    expect(resolveModelSource('../m.gguf', page)).toBe('https://example.org/app/m.gguf');
    expect(resolveModelSource('/m.gguf', page)).toBe('https://example.org/m.gguf');
  });
  it('keeps absolute URLs, URL objects and Blobs as they are (the worker checks the scheme)', () => {
    expect(resolveModelSource('https://hub.example/m.gguf', page)).toBe('https://hub.example/m.gguf');
    expect(resolveModelSource('ftp://example.com/m.gguf', page)).toBe('ftp://example.com/m.gguf');
    expect(resolveModelSource(new URL('https://hub.example/a b.gguf'), page)).toBe('https://hub.example/a%20b.gguf');
    const blob = new Blob([new Uint8Array(4)]);
    expect(resolveModelSource(blob, page)).toBe(blob);
    expect(resolveModelSource('models/demo.gguf', null)).toBe('models/demo.gguf');
  });
});
