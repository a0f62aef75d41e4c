/** Node's stored KV: one directory per record under LONGTAB_CACHE_DIR/kv or ~/.cache/longtab/kv. */
import { mkdir, open, readdir, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { homedir } from 'node:os';
import { join } from 'node:path';
import type { KvFileRecord, KvFileStore } from './kv-file-store.ts';

export function nodeKvFileStore(
  dir = join(process.env.LONGTAB_CACHE_DIR ?? join(homedir(), '.cache', 'longtab'), 'kv'),
): KvFileStore {
  const folder = (record: string) => join(dir, record);
  const missing = (error: unknown) => (error as { code?: string }).code === 'ENOENT';
  return {
    where: dir,
    async records() {
      let names: string[];
      try {
        names = await readdir(dir);
      } catch (error) {
        if (missing(error)) return [];
        throw error;
      }
      const records: KvFileRecord[] = [];
      for (const name of names) {
        let bytes = 0;
        let modified = 0;
        try {
          for (const file of await readdir(folder(name))) {
            const s = await stat(join(folder(name), file));
            bytes += s.size;
            modified = Math.max(modified, s.mtimeMs);
          }
        } catch (error) {
          if (missing(error)) continue; // removed meanwhile
          throw error;
        }
        records.push({ name, bytes, modified });
      }
      return records;
    },
    async read(record, file) {
      try {
        const bytes = await readFile(join(folder(record), file));
        // A file's own buffer is taken as it is (a page file is hundreds of MB); a pooled one is copied out.
        const whole = bytes.byteOffset === 0 && bytes.byteLength === bytes.buffer.byteLength;
        return whole ? new Uint8Array(bytes.buffer as ArrayBuffer) : new Uint8Array(bytes);
      } catch (error) {
        if (missing(error)) return null;
        throw error;
      }
    },
    async write(record, file, bytes, at) {
      await mkdir(folder(record), { recursive: true });
      const path = join(folder(record), file);
      if (at === undefined) {
        await writeFile(path, bytes);
        return;
      }
      let handle: Awaited<ReturnType<typeof open>>;
      try {
        handle = await open(path, 'r+');
      } catch (error) {
        if (!missing(error)) throw error;
        handle = await open(path, 'w+');
      }
      try {
        await handle.write(bytes, 0, bytes.byteLength, at);
      } finally {
        await handle.close();
      }
    },
    async remove(record) {
      await rm(folder(record), { recursive: true, force: true });
    },
  };
}
