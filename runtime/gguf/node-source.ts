/**
 * The ByteSource for a local file in Node (CLI, tools, tests). Only Node entry points import this module, so browser
 * bundles never pull in `node:fs`.
 */
import { readFileSync } from 'node:fs';
import { type FileHandle, open } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { CorruptModelFileError, InvalidRequestError } from '../../core/errors.ts';
import type { ByteSource } from '../../core/gguf-types.ts';
import { checkReadRange, joinSources } from './sources.ts';
import { openShards } from './split.ts';

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
 * file (a directory opens on Linux, and fails only at its first read) is an InvalidRequestError naming it. A file
 * named as a shard of a split model (`NAME-00001-of-00003.gguf`) opens every shard in its folder and joins them
 * (joinSources); a shard missing there fails the open naming it.
 */
export async function sourceFromPath(path: string): Promise<ByteSource> {
  const shards = await openShards(basename(path), async (shard, index, count) => {
    const shardPath = join(dirname(path), shard);
    try {
      return await sourceFromOneFile(shardPath);
    } catch (error) {
      if (!(error instanceof InvalidRequestError)) throw error;
      throw new InvalidRequestError(
        `Part ${index} of ${count} of the split model could not be opened: ${error.message} A split GGUF model loads from all of its parts, kept side by side in one folder under the names llama.cpp's gguf-split gives them.`,
        { ...error.details, path: shardPath, shard: index, shards: count },
      );
    }
  });
  return shards ? joinSources(shards) : sourceFromOneFile(path);
}

async function sourceFromOneFile(path: string): Promise<ByteSource> {
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
