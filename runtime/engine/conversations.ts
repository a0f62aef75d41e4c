/**
 * Conversations' KV sequences in the pool: each conversation keeps the token ids whose K/V its sequence holds, so a
 * follow-up turn truncates to the common prefix and prefills only the rest. System prompts are prefilled once into
 * their own sequence and forked copy-on-write into each conversation that starts with them.
 *
 * Before a request writes, `makeRoom` asks the pool for the pages of each kind the run may need at its peak
 * (`pagesNeeded`) against what it can give (`pagesObtainable`). An int2 pool keeps f16 pages (sinks and recent
 * windows) in a share of its own, which idle conversations fill while 2-bit pages are free: when f16 pages are short
 * and 2-bit ones are not, the least recently used idle sequences are flushed first (their window demoted to 2 bits
 * now: they keep their contents and are not re-prefilled). When that is not enough, or sequence slots run out, the
 * least recently used sequence is evicted. An evicted conversation's pages are copied to host memory as they are
 * (its 2-bit pages at 2 bits, its f16 window at f16: KvPagePool.saveSequence) while the host tier's budget allows,
 * least recently used saved ones dropped first; its next turn copies them back and prefills only what is new. A
 * conversation without a saved copy is re-prefilled. Once every conversation is deleted, the cached system prefixes
 * go too and the pool returns its slabs.
 *
 * Below host memory is the engine's KV store (OPFS in the browser, a directory in Node: runtime/engine/stored-kv.ts).
 * A conversation that persists is written there after each turn (only its changed pages) and read back when it
 * returns to an engine that does not hold it (a reload); one that does not persist goes there only when host memory
 * drops it (least recently used first) and is removed once read back or when the engine ends. A stored copy that
 * does not match (another model or setting, a damaged file) is removed and the conversation re-prefilled, with a note.
 */
import { ContextOverflowError, DeviceLostError, InvalidRequestError } from '../../core/errors.ts';
import type { KvPageCounts, KvPagePool, KvSequence, KvSequenceImage } from '../kv/pool.ts';
import { isStorageFull, type KvFileStore } from './kv-file-store.ts';
import type { ModelRunner } from './model-runner.ts';
import {
  imagePages,
  type PageSource,
  type StoredCopy,
  StoredKv,
  StoredKvRefused,
  sequencePages,
  storedRecordName,
} from './stored-kv.ts';

export interface CachedSequence {
  readonly key: string;
  readonly kind: 'conversation' | 'system' | 'temporary';
  seq: KvSequence | null;
  /** Token ids of positions [0, seq.length): always `ids.length === seq.length`. */
  ids: number[];
  lastUsed: number;
  /** While evicted: its sequence in host memory and the ids it holds (null when none was kept). */
  saved: { image: KvSequenceImage; ids: number[] } | null;
  /** Its record in the KV store as the last save left it (null: none). */
  stored: StoredCopy | null;
  /** Whether it is written to the KV store after each turn and kept there after the engine ends. */
  persist: boolean;
  /** Where the last attach found its KV ('gpu': it had a sequence), and why a stored copy was refused. */
  resumed: { from: 'gpu' | 'host' | 'storage' | 'none'; note: string | null };
}

/** What the conversation cache was asked to keep, and where. */
export interface ConversationCacheOptions {
  /** Host memory for evicted conversations' pages (0: none are kept there). */
  hostBudgetBytes?: number;
  /** The KV store below host memory (null: none). */
  store?: KvFileStore | null;
}

/** The KV store's counts in stats(). */
export interface StoredKvCounts {
  saves: number;
  restores: number;
  /** Stored copies found unusable (and removed). */
  refused: number;
  /** The last thing that went wrong with the store, for a person to read (null: nothing). */
  note: string | null;
}

function emptyEntry(): Omit<CachedSequence, 'key' | 'kind'> {
  return {
    seq: null,
    ids: [],
    lastUsed: 0,
    saved: null,
    stored: null,
    persist: false,
    resumed: { from: 'none', note: null },
  };
}

export function commonPrefixLength(a: readonly number[], b: readonly number[]): number {
  const n = Math.min(a.length, b.length);
  let i = 0;
  while (i < n && a[i] === b[i]) i++;
  return i;
}

export class ConversationCache {
  private readonly runner: ModelRunner;
  private readonly conversations = new Map<string, CachedSequence>();
  private readonly systems = new Map<string, CachedSequence>();
  private clock = 0;
  evictions = 0;
  /** Pages of idle sequences demoted to make room (int2 pools). */
  flushes = 0;
  /** Evicted conversations copied to host memory, and copied back. */
  saves = 0;
  restores = 0;
  readonly hostBudgetBytes: number;
  readonly store: KvFileStore | null;
  readonly storedCounts: StoredKvCounts = { saves: 0, restores: 0, refused: 0, note: null };
  /** Records this cache wrote for conversations that do not persist: removed when read back or by `releaseStore`. */
  private readonly spilled = new Set<string>();

  constructor(runner: ModelRunner, options: ConversationCacheOptions = {}) {
    this.runner = runner;
    this.hostBudgetBytes = options.hostBudgetBytes ?? 0;
    this.store = options.store ?? null;
  }

  /** Saved conversations (in host memory). */
  get savedCount(): number {
    let n = 0;
    for (const entry of this.conversations.values()) if (entry.saved) n++;
    return n;
  }

  /** Bytes of host memory that saved conversations hold. */
  get hostBytes(): number {
    let bytes = 0;
    for (const entry of this.conversations.values()) bytes += entry.saved?.image.bytes.byteLength ?? 0;
    return bytes;
  }

  /** This model's conversations with a copy in the KV store, and its bytes. */
  get storedCount(): number {
    let n = 0;
    for (const entry of this.conversations.values()) if (entry.stored) n++;
    return n;
  }

  get storedBytes(): number {
    let bytes = 0;
    for (const entry of this.conversations.values()) bytes += entry.stored?.header.fileBytes ?? 0;
    return bytes;
  }

  /** The KV store was emptied: no conversation has a copy there any more (they stay resident otherwise). */
  forgetStored(): void {
    for (const entry of this.conversations.values()) entry.stored = null;
    this.spilled.clear();
  }

  get size(): number {
    return this.conversations.size;
  }

  conversation(id: string): CachedSequence {
    let entry = this.conversations.get(id);
    if (!entry) {
      entry = { key: id, kind: 'conversation', ...emptyEntry() };
      this.conversations.set(id, entry);
    }
    this.touch(entry);
    return entry;
  }

  /** The entry of a conversation, if any, without touching it (tests and stats). */
  peek(id: string): CachedSequence | undefined {
    return this.conversations.get(id);
  }

  temporary(): CachedSequence {
    const entry: CachedSequence = { key: '', kind: 'temporary', ...emptyEntry() };
    this.touch(entry);
    return entry;
  }

  /**
   * Gives `entry` a sequence if it has none: a fork of the cached system prefix `systemIds` (prefilled now if it is
   * not cached) or an empty one. Returns the tokens prefilled for the system prefix (0 when it was cached).
   */
  async attach(entry: CachedSequence, systemIds: number[] | null): Promise<number> {
    entry.resumed = { from: entry.seq ? 'gpu' : 'none', note: null };
    if (entry.seq) return 0;
    const pool = this.runner.pool;
    if (await this.restore(entry)) return 0;
    if (!systemIds || systemIds.length === 0) {
      await this.ensureSlot([entry]);
      entry.seq = pool.createSequence();
      entry.ids = [];
      return 0;
    }
    const key = systemIds.join(',');
    let system = this.systems.get(key);
    let prefilled = 0;
    if (!system?.seq) {
      system = { key, kind: 'system', ...emptyEntry() };
      await this.ensureSlot([entry]);
      await this.makeRoom([entry], null, 0, systemIds.length);
      system.seq = pool.createSequence();
      this.systems.set(key, system);
      try {
        await this.runner.prefillSequence(system.seq, systemIds);
      } catch (error) {
        this.evict(system);
        throw error;
      }
      system.ids = systemIds.slice();
      prefilled = systemIds.length;
    }
    this.touch(system);
    await this.ensureSlot([entry, system]);
    await this.makeRoom([entry, system], null, 0, 1); // a partly filled last page (f16) is copied at the fork
    entry.seq = pool.fork(system.seq!);
    entry.ids = system.ids.slice(0, entry.seq.length);
    return prefilled;
  }

  /**
   * Makes room for writing `seq` (null: a sequence created next) from `position` up to `length`: while the pool
   * cannot give the pages of either kind the run may need, flushes idle sequences (f16 pages short, 2-bit pages to
   * spare; least recently used first, only as many pages as are missing), then evicts least recently used ones.
   * Never touches `keep`. Returns when both kinds fit or nothing is left to flush or evict (the pool's own check
   * then throws ContextOverflowError: the request alone does not fit).
   */
  makeRoom(keep: CachedSequence[], seq: KvSequence | null, position: number, length: number): Promise<void> {
    const pool = this.runner.pool;
    return this.roomFor(keep, () => pool.pagesNeeded(seq, position, length));
  }

  /** makeRoom for any need: `need()` is asked again after each flush or eviction. */
  private async roomFor(keep: CachedSequence[], needed: () => KvPageCounts): Promise<void> {
    const pool = this.runner.pool;
    for (;;) {
      const need = needed();
      const free = pool.pagesObtainable();
      const f16Short = need.f16 - free.f16;
      const quantSpare = free.quant - need.quant;
      if (f16Short <= 0 && quantSpare >= 0) return;
      if (f16Short > 0 && quantSpare > 0 && this.flushIdle(pool, keep, Math.min(f16Short, quantSpare))) continue;
      const victim = this.leastRecentlyUsed(keep);
      if (!victim) return;
      await this.displace(victim);
    }
  }

  /** Flushes up to `pages` pages of the least recently used idle sequences that have any. */
  private flushIdle(pool: KvPagePool, keep: CachedSequence[], pages: number): boolean {
    const idle = [...this.conversations.values(), ...this.systems.values()]
      .filter((entry) => entry.seq?.alive && !keep.includes(entry))
      .sort((a, b) => a.lastUsed - b.lastUsed);
    let flushed = 0;
    for (const entry of idle) {
      if (flushed >= pages) break;
      flushed += pool.flush(entry.seq as KvSequence, pages - flushed);
    }
    this.flushes += flushed;
    return flushed > 0;
  }

  /** Frees a sequence slot if all are taken. */
  async ensureSlot(keep: CachedSequence[]): Promise<void> {
    const pool = this.runner.pool;
    while (pool.stats().sequences >= pool.maxSequences) {
      const victim = this.leastRecentlyUsed(keep);
      if (!victim) {
        throw new InvalidRequestError(
          `All ${pool.maxSequences} KV sequences are in use by the running request; load with a larger maxSequences.`,
        );
      }
      await this.displace(victim);
    }
  }

  /**
   * Frees the entry's K/V and any copy of it in host memory; a copy in the KV store stays (a conversation that comes
   * back reads it, else it is re-prefilled).
   */
  evict(entry: CachedSequence): void {
    if (entry.seq && entry.kind !== 'temporary') this.evictions++;
    this.forget(entry);
    this.drop(entry);
  }

  /**
   * Evicts the entry to make room: a conversation's pages are copied to host memory first where the host budget
   * holds them (the least recently used saved ones go to the KV store, or are dropped without one), else straight to
   * the KV store, so its next turn restores them. A conversation that persists has its stored copy brought up to
   * date first.
   */
  async displace(entry: CachedSequence): Promise<void> {
    const seq = entry.seq;
    const pool = this.runner.pool;
    if (entry.kind !== 'conversation' || !seq?.alive || seq.length === 0) return this.evict(entry);
    if (entry.persist) await this.persistTurn(entry);
    const held = pool.stats();
    const bytes = Math.ceil(seq.length / pool.pageTokens) * Math.max(held.pageBytes, held.quant?.pageBytes ?? 0);
    if (bytes > this.hostBudgetBytes) {
      if (!entry.persist) await this.toStore(entry, sequencePages(pool, seq), entry.ids);
      return this.evict(entry);
    }
    let image: KvSequenceImage;
    try {
      image = await pool.saveSequence(seq);
    } catch (error) {
      // A copy that fails (no memory for its staging) still leaves the eviction, which makes the room; a lost
      // device ends the request.
      if (error instanceof DeviceLostError) throw error;
      return this.evict(entry);
    }
    const ids = entry.ids.slice(0, image.length);
    this.evict(entry);
    entry.saved = { image, ids };
    this.saves++;
    await this.trimHost(entry);
  }

  /**
   * Drops the least recently used saved conversations until the rest fit the host budget (`keep` last of all); each
   * goes to the KV store unless its stored copy is current already (or there is no store).
   */
  private async trimHost(keep: CachedSequence): Promise<void> {
    const saved = [...this.conversations.values()]
      .filter((e) => e.saved && e !== keep)
      .sort((a, b) => a.lastUsed - b.lastUsed);
    for (const entry of [...saved, keep]) {
      if (this.hostBytes <= this.hostBudgetBytes) return;
      const host = entry.saved!;
      if (!entry.persist) await this.toStore(entry, imagePages(host.image), host.ids);
      this.forget(entry);
    }
  }

  /**
   * Writes a conversation that does not persist to the KV store (a spill: removed when read back or when the engine
   * ends). Without a store, or when the write fails, its pages are simply dropped.
   */
  private async toStore(entry: CachedSequence, pages: PageSource, ids: readonly number[]): Promise<void> {
    const stored = this.storedKv();
    if (!stored) return;
    try {
      entry.stored = await stored.save(this.runner.pool, entry.key, pages, ids, null, false);
      this.spilled.add(entry.stored.record);
      this.storedCounts.saves++;
    } catch (error) {
      if (error instanceof DeviceLostError) throw error;
      await this.storeFailed(entry, error);
    }
  }

  /**
   * Brings the KV store's copy of a conversation that persists up to date with its sequence (only the pages changed
   * since the last save are written). A failed write (a full quota) removes the copy and leaves a note; the
   * conversation itself goes on.
   */
  async persistTurn(entry: CachedSequence): Promise<void> {
    const stored = this.storedKv();
    const seq = entry.seq;
    if (!stored || !entry.persist || !seq?.alive || seq.length === 0) return;
    try {
      entry.stored = await stored.save(
        this.runner.pool,
        entry.key,
        sequencePages(this.runner.pool, seq),
        entry.ids,
        entry.stored,
        true,
      );
      this.storedCounts.saves++;
    } catch (error) {
      if (error instanceof DeviceLostError) throw error;
      await this.storeFailed(entry, error);
    }
  }

  /** Marks the stored copy of `entry` stale from `position` on (a turn rewrites the sequence from there). */
  rewriting(entry: CachedSequence, position: number): void {
    if (entry.stored) {
      const page = Math.floor(position / this.runner.pool.pageTokens);
      entry.stored.changedFrom = Math.min(entry.stored.changedFrom, page);
    }
  }

  private async storeFailed(entry: CachedSequence, error: unknown): Promise<void> {
    this.storedCounts.note = isStorageFull(error)
      ? `The browser's storage for this site is full: a conversation's KV could not be kept on disk, so it will be read again when it returns (${this.store!.where}).`
      : `A conversation's KV could not be kept on disk (${error instanceof Error ? error.message : String(error)}); it will be read again when it returns.`;
    await this.removeStored(entry);
  }

  /** Removes the entry's record from the KV store, if it has one (a failure to remove is left for the next write). */
  private async removeStored(entry: CachedSequence): Promise<void> {
    const store = this.store;
    if (!store || entry.kind !== 'conversation') return;
    const record = entry.stored?.record ?? (await storedRecordName(entry.key));
    entry.stored = null;
    this.spilled.delete(record);
    await store.remove(record).catch(() => {});
  }

  /** The store's view for the loaded model's binding (null without a store). */
  private storedKv(): StoredKv | null {
    const binding = this.runner.loaded?.kv.binding;
    return this.store && binding ? new StoredKv(this.store, binding) : null;
  }

  /**
   * Brings an evicted conversation's pages back into the pool, making room as for a write: from host memory, else
   * from the KV store (where it has a copy there, or persists: a conversation this engine has not seen since a
   * reload). Returns false, the copy dropped, when there is none or the pool cannot hold it (the conversation is then
   * re-prefilled); a stored copy that does not match is removed, with the reason in `entry.resumed.note`.
   */
  private async restore(entry: CachedSequence): Promise<boolean> {
    const pool = this.runner.pool;
    const saved = entry.saved;
    let image: KvSequenceImage;
    let ids: number[];
    let from: 'host' | 'storage';
    let stored: StoredCopy | null = null;
    let checked: Promise<void> | null = null;
    if (saved && saved.image.pool === pool) {
      ({ image, ids } = saved);
      from = 'host';
    } else {
      // A copy from before the pool was replaced (other rotations) is not this pool's to restore.
      this.forget(entry);
      const found = await this.fromStore(entry);
      if (!found) return false;
      ({ image, ids, checked } = found);
      stored = found.copy;
      from = 'storage';
    }
    await this.ensureSlot([entry]);
    await this.roomFor([entry], () => pool.pagesToRestore(image));
    try {
      entry.seq = pool.restoreSequence(image);
    } catch (error) {
      if (!(error instanceof ContextOverflowError)) throw error;
      this.forget(entry);
      return false;
    }
    // The stored pages' checksums were computed while they were copied in; nothing has read them yet.
    if (checked && !(await this.passed(entry, checked))) return false;
    entry.ids = ids;
    this.forget(entry);
    entry.resumed = { from, note: null };
    if (from === 'host') this.restores++;
    else {
      this.storedCounts.restores++;
      // A spill is read once; a conversation that persists keeps its copy (the same pages, now in the pool).
      if (entry.persist) entry.stored = stored;
      else await this.removeStored(entry);
    }
    return true;
  }

  /** The entry's copy in the KV store as an image of this pool, or null (none, or refused and removed). */
  private async fromStore(
    entry: CachedSequence,
  ): Promise<{ image: KvSequenceImage; ids: number[]; copy: StoredCopy; checked: Promise<void> } | null> {
    const stored = this.storedKv();
    if (!stored || entry.kind !== 'conversation' || (!entry.stored && !entry.persist)) return null;
    try {
      const found = await stored.load(this.runner.pool, entry.key, this.runner.config.vocab);
      if (!found) entry.stored = null;
      return found;
    } catch (error) {
      await this.refuseStored(entry, error);
      return null;
    }
  }

  /** Whether the restored pages' checksums matched; when not, the entry's sequence and stored copy are dropped. */
  private async passed(entry: CachedSequence, checked: Promise<void>): Promise<boolean> {
    try {
      await checked;
      return true;
    } catch (error) {
      this.drop(entry);
      await this.refuseStored(entry, error);
      return false;
    }
  }

  /** A stored copy that could not be used: the reason as the entry's note, the copy removed. */
  private async refuseStored(entry: CachedSequence, error: unknown): Promise<void> {
    if (error instanceof DeviceLostError) throw error;
    const reason = error instanceof StoredKvRefused ? error.message : `it could not be read (${String(error)})`;
    const note = `This conversation's stored KV was not used (${reason}); its history was read again.`;
    this.storedCounts.refused++;
    this.storedCounts.note = note;
    entry.resumed = { from: 'none', note };
    await this.removeStored(entry);
  }

  /** Drops the entry's copy in host memory. */
  private forget(entry: CachedSequence): void {
    if (!entry.saved) return;
    entry.saved = null;
  }

  /** Frees the entry's K/V without counting an eviction. */
  private drop(entry: CachedSequence): void {
    if (entry.seq?.alive) this.runner.pool.free(entry.seq);
    entry.seq = null;
    entry.ids = [];
    if (entry.kind === 'system') this.systems.delete(entry.key);
  }

  /** Records what the sequence holds after a request: the first seq.length ids of `context`. */
  record(entry: CachedSequence, context: number[]): void {
    entry.ids = entry.seq ? context.slice(0, entry.seq.length) : [];
    this.touch(entry);
  }

  release(entry: CachedSequence): void {
    this.evict(entry);
  }

  /**
   * Forgets a conversation (not counted as an eviction) and removes its record from the KV store, whether or not
   * this engine has seen it. The last one to go takes the cached system prefixes with it (only conversations fork
   * them) and the pool's slabs are returned, so the memory is back to its level after load.
   */
  async delete(id: string): Promise<void> {
    const entry = this.conversations.get(id) ?? { key: id, kind: 'conversation' as const, ...emptyEntry() };
    if (this.conversations.has(id)) {
      this.forget(entry);
      this.drop(entry);
      this.conversations.delete(id);
      if (this.conversations.size === 0) {
        for (const system of [...this.systems.values()]) this.drop(system);
        this.runner.pool.releaseFreeSlabs();
      }
    }
    await this.removeStored(entry);
  }

  /**
   * Stops persisting a conversation (a request that says `persist: false`): its record in the KV store is removed.
   */
  async stopPersisting(entry: CachedSequence): Promise<void> {
    if (!entry.persist) return;
    entry.persist = false;
    await this.removeStored(entry);
  }

  /** Removes the records this cache spilled to the KV store (conversations that do not persist): the engine ends. */
  async releaseStore(): Promise<void> {
    const store = this.store;
    if (!store) return;
    for (const record of [...this.spilled]) await store.remove(record).catch(() => {});
    this.spilled.clear();
  }

  /** Forgets everything (the pool itself is destroyed by the caller). */
  clear(): void {
    void this.releaseStore();
    this.conversations.clear();
    this.systems.clear();
    this.evictions = 0;
    this.flushes = 0;
    this.saves = 0;
    this.restores = 0;
  }

  private touch(entry: CachedSequence): void {
    entry.lastUsed = ++this.clock;
  }

  private leastRecentlyUsed(keep: CachedSequence[]): CachedSequence | null {
    let best: CachedSequence | null = null;
    for (const entry of [...this.conversations.values(), ...this.systems.values()]) {
      if (!entry.seq || keep.includes(entry)) continue;
      if (!best || entry.lastUsed < best.lastUsed) best = entry;
    }
    return best;
  }
}
