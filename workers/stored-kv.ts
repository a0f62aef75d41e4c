/**
 * The engine worker's KV store (conversations' KV in the origin private file system, under `longtab-kv/`) as a page
 * reaches it with no worker running: the same records, through the same store (runtime/engine/kv-file-store-opfs.ts)
 * and names (runtime/engine/stored-kv.ts), counted, removed for one conversation, or cleared. While a worker runs, ask
 * it instead (`storedKv()`, `deleteConversation()`, `clearStoredKv()`): it may be writing a record at that moment.
 */
import type { StoredKvUsage } from '../runtime/engine/api-types.ts';
import { opfsKvFileStore } from '../runtime/engine/kv-file-store-opfs.ts';
import { storedRecordName } from '../runtime/engine/stored-kv.ts';

/** Whether this context has an origin private file system (the worker's test for its store is the same). */
function hasOpfs(): boolean {
  return typeof navigator.storage?.getDirectory === 'function';
}

/** Records and bytes of every model's stored KV in this origin; null where there is no OPFS. */
export async function storedKvInOrigin(): Promise<StoredKvUsage | null> {
  if (!hasOpfs()) return null;
  const store = opfsKvFileStore();
  const records = await store.records();
  return { records: records.length, bytes: records.reduce((sum, r) => sum + r.bytes, 0), where: store.where };
}

/** Removes one conversation's stored KV (nothing happens when it has none). */
export async function removeStoredConversationKv(conversationId: string): Promise<void> {
  if (!hasOpfs()) return;
  await opfsKvFileStore().remove(await storedRecordName(conversationId));
}

/** Removes every conversation's stored KV in this origin, of every model. */
export async function clearStoredKvInOrigin(): Promise<void> {
  if (!hasOpfs()) return;
  const store = opfsKvFileStore();
  for (const record of await store.records()) await store.remove(record.name);
}
