/**
 * The browser's stored KV: one directory per record under `longtab-kv/` in the origin private file system (pages and
 * workers alike: the writable-stream API, or the worker-only sync handles where a browser has no writable streams).
 */
import type { KvFileRecord, KvFileStore } from './kv-file-store.ts';

const ROOT = 'longtab-kv';

export function opfsKvFileStore(): KvFileStore {
  const root = async () => (await navigator.storage.getDirectory()).getDirectoryHandle(ROOT, { create: true });
  const folder = async (record: string, create: boolean) => (await root()).getDirectoryHandle(record, { create });
  const missing = (error: unknown) => (error as { name?: string }).name === 'NotFoundError';
  return {
    where: 'the origin private file system',
    async records() {
      const records: KvFileRecord[] = [];
      const dir = await root();
      // entries() is in every browser with OPFS; TypeScript's DOM types do not list it yet.
      const entries = (dir as unknown as { entries(): AsyncIterable<[string, FileSystemHandle]> }).entries();
      for await (const [name, handle] of entries) {
        if (handle.kind !== 'directory') continue;
        let bytes = 0;
        let modified = 0;
        try {
          const files = (handle as unknown as { values(): AsyncIterable<FileSystemHandle> }).values();
          for await (const file of files) {
            if (file.kind !== 'file') continue;
            const f = await (file as FileSystemFileHandle).getFile();
            bytes += f.size;
            modified = Math.max(modified, f.lastModified);
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
        const handle = await (await folder(record, false)).getFileHandle(file);
        return new Uint8Array(await (await handle.getFile()).arrayBuffer());
      } catch (error) {
        if (missing(error)) return null;
        throw error;
      }
    },
    async write(record, file, bytes, at) {
      const handle = await (await folder(record, true)).getFileHandle(file, { create: true });
      if (typeof handle.createWritable !== 'function') {
        // Browsers without writable streams on OPFS files have the worker-only sync handles (where the engine runs).
        const sync = await (
          handle as unknown as {
            createSyncAccessHandle(): Promise<{
              write(data: Uint8Array, options: { at: number }): number;
              truncate(size: number): void;
              flush(): void;
              close(): void;
            }>;
          }
        ).createSyncAccessHandle();
        try {
          if (at === undefined) sync.truncate(0);
          sync.write(bytes, { at: at ?? 0 });
          sync.flush();
        } finally {
          sync.close();
        }
        return;
      }
      const writable = await handle.createWritable({ keepExistingData: at !== undefined });
      try {
        await writable.write({ type: 'write', position: at ?? 0, data: bytes as Uint8Array<ArrayBuffer> });
        await writable.close();
      } catch (error) {
        await writable.abort().catch(() => {});
        throw error;
      }
    },
    async remove(record) {
      try {
        await (await root()).removeEntry(record, { recursive: true });
      } catch (error) {
        if (!missing(error)) throw error;
      }
    },
  };
}
