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
 */
import { ContextOverflowError, DeviceLostError, InvalidRequestError } from '../../core/errors.ts';
import type { KvPageCounts, KvPagePool, KvSequence, KvSequenceImage } from '../kv/pool.ts';
import type { ModelRunner } from './model-runner.ts';

export interface CachedSequence {
  readonly key: string;
  readonly kind: 'conversation' | 'system' | 'temporary';
  seq: KvSequence | null;
  /** Token ids of positions [0, seq.length): always `ids.length === seq.length`. */
  ids: number[];
  lastUsed: number;
  /** While evicted: its sequence in host memory and the ids it holds (null when none was kept). */
  saved: { image: KvSequenceImage; ids: number[] } | null;
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

  /** `hostBudgetBytes`: host memory for evicted conversations' pages (0: none are kept). */
  constructor(runner: ModelRunner, hostBudgetBytes = 0) {
    this.runner = runner;
    this.hostBudgetBytes = hostBudgetBytes;
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

  get size(): number {
    return this.conversations.size;
  }

  conversation(id: string): CachedSequence {
    let entry = this.conversations.get(id);
    if (!entry) {
      entry = { key: id, kind: 'conversation', seq: null, ids: [], lastUsed: 0, saved: null };
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
    const entry: CachedSequence = { key: '', kind: 'temporary', seq: null, ids: [], lastUsed: 0, saved: null };
    this.touch(entry);
    return entry;
  }

  /**
   * Gives `entry` a sequence if it has none: a fork of the cached system prefix `systemIds` (prefilled now if it is
   * not cached) or an empty one. Returns the tokens prefilled for the system prefix (0 when it was cached).
   */
  async attach(entry: CachedSequence, systemIds: number[] | null): Promise<number> {
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
      system = { key, kind: 'system', seq: null, ids: [], lastUsed: 0, saved: null };
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

  /** Frees the entry's K/V, and any copy of it in host memory (the conversation is re-prefilled if it comes back). */
  evict(entry: CachedSequence): void {
    if (entry.seq && entry.kind !== 'temporary') this.evictions++;
    this.forget(entry);
    this.drop(entry);
  }

  /**
   * Evicts the entry to make room: a conversation's pages are copied to host memory first where the host budget
   * holds them (the least recently used saved ones give way), so its next turn restores them.
   */
  private async displace(entry: CachedSequence): Promise<void> {
    const seq = entry.seq;
    const pool = this.runner.pool;
    if (entry.kind !== 'conversation' || !seq?.alive || seq.length === 0) return this.evict(entry);
    const held = pool.stats();
    const bytes = Math.ceil(seq.length / pool.pageTokens) * Math.max(held.pageBytes, held.quant?.pageBytes ?? 0);
    if (bytes > this.hostBudgetBytes) return this.evict(entry);
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
    this.trimHost(entry);
  }

  /** Drops the least recently used saved conversations until the rest fit the host budget (`keep` last of all). */
  private trimHost(keep: CachedSequence): void {
    const saved = [...this.conversations.values()]
      .filter((e) => e.saved && e !== keep)
      .sort((a, b) => a.lastUsed - b.lastUsed);
    for (const entry of [...saved, keep]) {
      if (this.hostBytes <= this.hostBudgetBytes) return;
      this.forget(entry);
    }
  }

  /**
   * Brings an evicted conversation's saved pages back into the pool, making room as for a write. Returns false, its
   * copy dropped, when it has none or the pool cannot hold them (the conversation is then re-prefilled).
   */
  private async restore(entry: CachedSequence): Promise<boolean> {
    const saved = entry.saved;
    if (!saved) return false;
    const pool = this.runner.pool;
    // A copy from before the pool was replaced (other rotations) is not this pool's to restore.
    if (saved.image.pool !== pool) {
      this.forget(entry);
      return false;
    }
    await this.ensureSlot([entry]);
    await this.roomFor([entry], () => pool.pagesToRestore(saved.image));
    try {
      entry.seq = pool.restoreSequence(saved.image);
    } catch (error) {
      if (!(error instanceof ContextOverflowError)) throw error;
      this.forget(entry);
      return false;
    }
    entry.ids = saved.ids;
    this.forget(entry);
    this.restores++;
    return true;
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
   * Forgets a conversation (not counted as an eviction). The last one to go takes the cached system prefixes with it
   * (only conversations fork them) and the pool's slabs are returned, so the memory is back to its level after load.
   */
  delete(id: string): void {
    const entry = this.conversations.get(id);
    if (!entry) return;
    this.forget(entry);
    this.drop(entry);
    this.conversations.delete(id);
    if (this.conversations.size > 0) return;
    for (const system of [...this.systems.values()]) this.drop(system);
    this.runner.pool.releaseFreeSlabs();
  }

  /** Forgets everything (the pool itself is destroyed by the caller). */
  clear(): void {
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
