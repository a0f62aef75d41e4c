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
 * least recently used sequence is evicted; its conversation is re-prefilled when it comes back. Once every
 * conversation is deleted, the cached system prefixes go too and the pool returns its slabs.
 */
import { InvalidRequestError } from '../../core/errors.ts';
import type { KvPagePool, KvSequence } from '../kv/pool.ts';
import type { ModelRunner } from './model-runner.ts';

export interface CachedSequence {
  readonly key: string;
  readonly kind: 'conversation' | 'system' | 'temporary';
  seq: KvSequence | null;
  /** Token ids of positions [0, seq.length): always `ids.length === seq.length`. */
  ids: number[];
  lastUsed: number;
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

  constructor(runner: ModelRunner) {
    this.runner = runner;
  }

  get size(): number {
    return this.conversations.size;
  }

  conversation(id: string): CachedSequence {
    let entry = this.conversations.get(id);
    if (!entry) {
      entry = { key: id, kind: 'conversation', seq: null, ids: [], lastUsed: 0 };
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
    const entry: CachedSequence = { key: '', kind: 'temporary', seq: null, ids: [], lastUsed: 0 };
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
    if (!systemIds || systemIds.length === 0) {
      this.ensureSlot([entry]);
      entry.seq = pool.createSequence();
      entry.ids = [];
      return 0;
    }
    const key = systemIds.join(',');
    let system = this.systems.get(key);
    let prefilled = 0;
    if (!system?.seq) {
      system = { key, kind: 'system', seq: null, ids: [], lastUsed: 0 };
      this.ensureSlot([entry]);
      this.makeRoom([entry], null, 0, systemIds.length);
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
    this.ensureSlot([entry, system]);
    this.makeRoom([entry, system], null, 0, 1); // a partly filled last page (f16) is copied at the fork
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
  makeRoom(keep: CachedSequence[], seq: KvSequence | null, position: number, length: number): void {
    const pool = this.runner.pool;
    for (;;) {
      const need = pool.pagesNeeded(seq, position, length);
      const free = pool.pagesObtainable();
      const f16Short = need.f16 - free.f16;
      const quantSpare = free.quant - need.quant;
      if (f16Short <= 0 && quantSpare >= 0) return;
      if (f16Short > 0 && quantSpare > 0 && this.flushIdle(pool, keep, Math.min(f16Short, quantSpare))) continue;
      const victim = this.leastRecentlyUsed(keep);
      if (!victim) return;
      this.evict(victim);
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
  ensureSlot(keep: CachedSequence[]): void {
    const pool = this.runner.pool;
    while (pool.stats().sequences >= pool.maxSequences) {
      const victim = this.leastRecentlyUsed(keep);
      if (!victim) {
        throw new InvalidRequestError(
          `All ${pool.maxSequences} KV sequences are in use by the running request; load with a larger maxSequences.`,
        );
      }
      this.evict(victim);
    }
  }

  /** Frees the entry's K/V (the conversation is re-prefilled if it comes back). */
  evict(entry: CachedSequence): void {
    if (entry.seq && entry.kind !== 'temporary') this.evictions++;
    this.drop(entry);
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
