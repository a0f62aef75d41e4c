/**
 * Split GGUF models as llama.cpp's gguf-split writes them: shards `NAME-00001-of-0000N.gguf` … `NAME-0000N-of-0000N.gguf`,
 * each a GGUF file of its own. The first holds all the model's metadata plus `split.no` = 0, `split.count` = N and
 * `split.tensors.count`; the others hold only those three keys (their own `split.no`) and their tensors; the first may
 * hold no tensors at all. llama.cpp finds the other shards from the first one's name, as longtab does here: a source
 * over all of them joined end to end (joinSources) parses as one model (parseGguf).
 */
import type { ByteSource } from '../../core/gguf-types.ts';

/** The shard's index from 0 (u16). */
export const SPLIT_NO_KEY = 'split.no';
/** How many shards the model has (u16; 0 or absent in a single file). */
export const SPLIT_COUNT_KEY = 'split.count';
/** How many tensors all the shards hold together (i32). */
export const SPLIT_TENSORS_COUNT_KEY = 'split.tensors.count';

/** gguf-split's `%s-%05d-of-%05d.gguf`, numbered from 1. */
const SHARD_NAME = /^(.+)-(\d{5,})-of-(\d{5,})\.gguf$/;

export interface ShardName {
  /** The name before `-0000i-of-0000N.gguf`. */
  prefix: string;
  /** From 1, as in the name. */
  index: number;
  count: number;
}

/** The shard a file name says it is, or null for a name gguf-split does not write (a single file's, or one part). */
export function parseShardName(name: string): ShardName | null {
  const match = SHARD_NAME.exec(name);
  if (!match) return null;
  const index = Number(match[2]);
  const count = Number(match[3]);
  if (count < 2 || index < 1 || index > count) return null;
  return { prefix: match[1], index, count };
}

/** The file name of shard `index` (from 1) of `count`. */
export function shardName(prefix: string, index: number, count: number): string {
  const pad = (n: number) => String(n).padStart(5, '0');
  return `${prefix}-${pad(index)}-of-${pad(count)}.gguf`;
}

/**
 * Every shard of the split model that `name` (any one of its shards) belongs to, opened in order by `open`, or null
 * where `name` is not a shard's name. When one fails to open, those already open are closed and its error (which
 * `open` words, naming the shard) propagates.
 */
export async function openShards(
  name: string,
  open: (shard: string, index: number, count: number) => Promise<ByteSource>,
): Promise<ByteSource[] | null> {
  const shard = parseShardName(name);
  if (!shard) return null;
  const opened: ByteSource[] = [];
  try {
    for (let i = 1; i <= shard.count; i++)
      opened.push(await open(shardName(shard.prefix, i, shard.count), i, shard.count));
    return opened;
  } catch (error) {
    await Promise.all(opened.map((s) => s.close?.()));
    throw error;
  }
}
