/**
 * Where conversations' KV goes when it leaves the GPU and host memory: a folder of records, each a few files. The
 * browser's is in the origin private file system (kv-file-store-opfs.ts), Node's in a directory
 * (kv-file-store-node.ts). What the records hold, and every check on them, is runtime/engine/stored-kv.ts's.
 */
export interface KvFileRecord {
  name: string;
  /** Bytes of all its files. */
  bytes: number;
  /** Last change, ms since the epoch. */
  modified: number;
}

export interface KvFileStore {
  /** Where the records are, for messages (e.g. "the origin private file system", a directory path). */
  readonly where: string;
  records(): Promise<KvFileRecord[]>;
  /** A file of a record; null when the record or the file does not exist. */
  read(record: string, file: string): Promise<Uint8Array<ArrayBuffer> | null>;
  /**
   * Writes `bytes` into a record's file (both made if missing): at byte `at` keeping the rest, or, without `at`,
   * replacing the whole file. Fails as the platform fails (a full quota or disk among them).
   */
  write(record: string, file: string, bytes: Uint8Array, at?: number): Promise<void>;
  /** Removes a record and its files; nothing happens when there is none. */
  remove(record: string): Promise<void>;
}

/** Whether an error is the platform saying the storage is full (OPFS QuotaExceededError, ENOSPC, EDQUOT). */
export function isStorageFull(error: unknown): boolean {
  if (typeof error !== 'object' || error === null) return false;
  const { name, code } = error as { name?: unknown; code?: unknown };
  return name === 'QuotaExceededError' || code === 'ENOSPC' || code === 'EDQUOT';
}
