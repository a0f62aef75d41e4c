/**
 * The ByteSource for a local file in Node (CLI, tools, tests). Only Node entry points import this module, so browser
 * bundles never pull in `node:fs`.
 */
import { readFileSync } from 'node:fs';
import { type FileHandle, open } from 'node:fs/promises';
import { basename } from 'node:path';
import { CorruptModelFileError, InvalidRequestError } from '../../core/errors.ts';
import type { ByteSource } from '../../core/gguf-types.ts';
import { checkReadRange } from './sources.ts';

/** Why a path could not be read as a file, in words (a Node error's code). */
function unreadable(error: unknown): string {
  const code = (error as NodeJS.ErrnoException).code;
  if (code === 'ENOENT') return 'there is no file at that path';
  if (code === 'EACCES' || code === 'EPERM') return 'permission denied';
  if (code === 'EISDIR') return 'it is a directory';
  return (error as Error).message;
}

/**
 * Opens `path` for positioned reads; call `close()` when done with it. A path that is missing, unreadable or not a
 * file (a directory opens on Linux, and fails only at its first read) is an InvalidRequestError naming it.
 */
export async function sourceFromPath(path: string): Promise<ByteSource> {
  let handle: FileHandle;
  try {
    handle = await open(path, 'r');
  } catch (error) {
    throw new InvalidRequestError(`Cannot open the model file ${path}: ${unreadable(error)}.`, {
      path,
      code: (error as NodeJS.ErrnoException).code,
    });
  }
  let size: number;
  try {
    const stat = await handle.stat();
    if (!stat.isFile()) {
      throw new InvalidRequestError(
        `Cannot open the model file ${path}: ${stat.isDirectory() ? 'it is a directory' : 'it is not a regular file'}.`,
        { path },
      );
    }
    size = stat.size;
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

/** A text file's contents (UTF-8); a path that cannot be read is an InvalidRequestError naming it and `what` it is. */
export function readTextFromPath(path: string, what: string): string {
  try {
    return readFileSync(path, 'utf8');
  } catch (error) {
    throw new InvalidRequestError(`Cannot read ${what} ${path}: ${unreadable(error)}.`, { path });
  }
}
