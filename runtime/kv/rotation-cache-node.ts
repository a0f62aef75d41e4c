/** Node's cache of calibrated rotations: one file per model digest under LONGTAB_CACHE_DIR or ~/.cache/longtab. */
import { mkdir, readFile, rename, writeFile } from 'node:fs/promises';
import { homedir } from 'node:os';
import { join } from 'node:path';
import type { RotationCache } from './rotation-store.ts';

export function nodeRotationCache(
  dir = process.env.LONGTAB_CACHE_DIR ?? join(homedir(), '.cache', 'longtab'),
): RotationCache {
  const path = (digest: string) => join(dir, 'rotations', `${digest}.bin`);
  return {
    async get(digest) {
      try {
        return new Uint8Array(await readFile(path(digest)));
      } catch {
        return undefined;
      }
    },
    async set(digest, bytes) {
      await mkdir(join(dir, 'rotations'), { recursive: true });
      // Write then rename, so a crash never leaves a half-written cache entry behind.
      const temporary = `${path(digest)}.${process.pid}.tmp`;
      await writeFile(temporary, bytes);
      await rename(temporary, path(digest));
    },
  };
}
