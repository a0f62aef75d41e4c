/**
 * Conversations' KV sequences in the pool: each conversation keeps the token ids whose K/V its sequence holds, so a
 * follow-up turn truncates to the common prefix and prefills only the rest. System prompts are prefilled once into
 * their own sequence and forked copy-on-write into each conversation that starts with them. When the pool runs out
 * of pages or sequence slots, the least recently used sequence is evicted; its conversation is re-prefilled when it
 * comes back.
 */
import { InvalidRequestError } from '../errors.ts';
import type { KvSequence } from '../kv/pool.ts';
import type { Engine } from './engine.ts';

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
  private readonly engine: Engine;
  private readonly conversations = new Map<string, CachedSequence>();
  private readonly systems = new Map<string, CachedSequence>();
  private clock = 0;
  evictions = 0;

  constructor(engine: Engine) {
    this.engine = engine;
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
    const pool = this.engine.pool;
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
      this.makeRoom([entry], Math.ceil(systemIds.length / pool.pageTokens) + 1);
      system.seq = pool.createSequence();
      this.systems.set(key, system);
      try {
        await this.engine.prefillSequence(system.seq, systemIds);
      } catch (error) {
        this.evict(system);
        throw error;
      }
      system.ids = systemIds.slice();
      prefilled = systemIds.length;
    }
    this.touch(system);
    this.ensureSlot([entry, system]);
    this.makeRoom([entry, system], 1); // a partly filled last page is copied at the fork
    entry.seq = pool.fork(system.seq!);
    entry.ids = system.ids.slice(0, entry.seq.length);
    return prefilled;
  }

  /** Evicts least recently used sequences (never `keep`) until `pages` pages are free or nothing is left to evict. */
  makeRoom(keep: CachedSequence[], pages: number): void {
    const pool = this.engine.pool;
    for (;;) {
      const s = pool.stats();
      if (s.pagesBudget - s.pagesUsed >= pages) return;
      const victim = this.leastRecentlyUsed(keep);
      if (!victim) return;
      this.evict(victim);
    }
  }

  /** Frees a sequence slot if all are taken. */
  ensureSlot(keep: CachedSequence[]): void {
    const pool = this.engine.pool;
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
    if (entry.seq?.alive) this.engine.pool.free(entry.seq);
    if (entry.seq && entry.kind !== 'temporary') this.evictions++;
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

  delete(id: string): void {
    const entry = this.conversations.get(id);
    if (!entry) return;
    this.evict(entry);
    this.conversations.delete(id);
  }

  /** Forgets everything (the pool itself is destroyed by the caller). */
  clear(): void {
    this.conversations.clear();
    this.systems.clear();
    this.evictions = 0;
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
