/**
 * The ByteSource for a local file in Node (CLI, tools, tests). Only Node entry points import this module, so browser
 * bundles never pull in `node:fs`.
 */
import { type FileHandle, open } from 'node:fs/promises';
import { basename } from 'node:path';
import { CorruptModelFileError, InvalidRequestError } from '../../core/errors.ts';
import type { ByteSource } from '../../core/gguf-types.ts';
import { checkReadRange } from './sources.ts';

/** Opens `path` for positioned reads; call `close()` when done with it. */
export async function sourceFromPath(path: string): Promise<ByteSource> {
  let handle: FileHandle;
  try {
    handle = await open(path, 'r');
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code;
    const reason =
      code === 'ENOENT'
        ? 'there is no file at that path'
        : code === 'EACCES' || code === 'EPERM'
          ? 'permission denied'
          : code === 'EISDIR'
            ? 'it is a directory'
            : (error as Error).message;
    throw new InvalidRequestError(`Cannot open the model file ${path}: ${reason}.`, { path, code });
  }
  let size: number;
  try {
    size = (await handle.stat()).size;
  } catch (error) {
    await handle.close();
    throw error;
  }
  const name = basename(path);
  return {
    name,
    size,
    async read(offset, length) {
      checkReadRange({ name, size }, offset, length);
      const bytes = new Uint8Array(length);
      // A positioned read may return fewer bytes than asked (large reads, some file systems): loop until full.
      let filled = 0;
      while (filled < length) {
        const { bytesRead } = await handle.read(bytes, filled, length - filled, offset + filled);
        if (bytesRead === 0) {
          throw new CorruptModelFileError(
            `${name} ended at byte ${offset + filled} while reading ${length} bytes at ${offset}: the file was truncated while loading.`,
          );
        }
        filled += bytesRead;
      }
      return bytes;
    },
    async close() {
      await handle.close();
    },
  };
}
