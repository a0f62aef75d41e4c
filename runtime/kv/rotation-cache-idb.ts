/** The browser's cache of calibrated rotations, in IndexedDB (works in pages and workers). */
import { createStore, get, set } from 'idb-keyval';
import type { RotationCache } from './rotation-store.ts';

export function indexedDbRotationCache(): RotationCache {
  const store = createStore('longtab-kv-rotations', 'rotations');
  return {
    get: (digest) => get<Uint8Array>(digest, store),
    set: (digest, bytes) => set(digest, bytes, store),
  };
}
