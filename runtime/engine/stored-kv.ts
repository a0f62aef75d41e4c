/**
 * Conversations' KV in a KvFileStore (OPFS in the browser, a directory in Node): the tier below host memory. A record
 * holds one conversation's pages as the pool holds them (2-bit pages at 2 bits, f16 ones at f16) and the token ids
 * they encode, so a conversation that comes back (after an eviction, a reload, a new tab) copies its pages in and
 * prefills only its new turn.
 *
 * A record is two files:
 * - `pages`: page bytes, appended. A save copies out only the pages that changed since the last one (those past the
 *   point where a turn rewrote the sequence, and window pages demoted since), so a long conversation's turn costs a
 *   few pages, not the whole history; the copies they replace stay until the file holds twice the live bytes, then
 *   the file is rewritten.
 * - `header`: a line with the SHA-256 of the JSON that follows it: the format, the binding, the conversation, its
 *   token ids and, per page, its kind, where it lies in `pages` and the SHA-256 of its bytes. It is written after the
 *   pages it names.
 *
 * The binding (`kvBinding`) is a digest of everything that gives the bytes their meaning: the model, the pool's
 * layout (formats, precision plan, page size, sink and window) and the rotation K and V were stored under. A record
 * is used only when its header's own checksum, its binding, its conversation, its ids and every page's checksum
 * agree; anything else (another model or setting, a file cut short or changed, a save that did not finish) is
 * refused with the reason, and the conversation is prefilled again: a stored copy never makes a wrong answer.
 */
import { sha256Hex } from '../../core/sha256.ts';
import { decodePageEntry, KV_PAGE_KIND, type KvPagePool, type KvSequence, type KvSequenceImage } from '../kv/pool.ts';
import type { KvRotation } from '../kv/rotation.ts';
import type { KvFileStore } from './kv-file-store.ts';

export const STORED_KV_FORMAT = 'longtab-kv-1';
const HEADER = 'header';
const PAGES = 'pages';

export interface StoredPage {
  /** KV_PAGE_KIND. */
  kind: number;
  /** Byte offset in the record's `pages` file. */
  at: number;
  sha256: string;
}

export interface StoredKvHeader {
  format: typeof STORED_KV_FORMAT;
  binding: string;
  conversation: string;
  /** Kept after the engine ends (persist), or only while it runs (a spill from host memory). */
  persist: boolean;
  length: number;
  /** Token ids of positions [0, length). */
  ids: number[];
  pageBytes: { f16: number; quant: number };
  pages: StoredPage[];
  /** Bytes of the `pages` file: live pages and the copies later saves replaced. */
  fileBytes: number;
}

/** What a conversation has in the store, as its last save left it. */
export interface StoredCopy {
  record: string;
  header: StoredKvHeader;
  /** Pages from this index on may differ from the sequence now (a turn rewrote them since the save). */
  changedFrom: number;
}

/** Why a stored record was not used: what the person reads in the note. */
export class StoredKvRefused extends Error {
  override name = 'StoredKvRefused';
}

/** SHA-256 of what gives stored pages their meaning: the model, the pool's layout, the rotation. */
export async function kvBinding(modelDigest: string, pool: KvPagePool, rotation: KvRotation): Promise<string> {
  let rotationKey = rotation.kind as string;
  if (rotation.kind === 'calibrated') {
    const bytes = new Uint8Array(rotation.key.byteLength + rotation.value.byteLength);
    bytes.set(new Uint8Array(rotation.key.buffer, rotation.key.byteOffset, rotation.key.byteLength), 0);
    bytes.set(
      new Uint8Array(rotation.value.buffer, rotation.value.byteOffset, rotation.value.byteLength),
      rotation.key.byteLength,
    );
    rotationKey = `calibrated:${await sha256Hex(bytes)}`;
  }
  const text = JSON.stringify({
    format: STORED_KV_FORMAT,
    model: modelDigest,
    layout: pool.layoutKey(),
    rotation: rotationKey,
  });
  return sha256Hex(new TextEncoder().encode(text));
}

/** The record name of a conversation: a digest, so any id is a valid file name. */
export async function storedRecordName(conversation: string): Promise<string> {
  return `c-${(await sha256Hex(new TextEncoder().encode(conversation))).slice(0, 40)}`;
}

function pageSlice(bytes: Uint8Array<ArrayBuffer>, at: number, length: number): Uint8Array<ArrayBuffer> {
  return new Uint8Array(bytes.buffer, bytes.byteOffset + at, length);
}

/** Pages to store: a sequence's in the pool or a copy's in host memory. */
export interface PageSource {
  length: number;
  /** KV_PAGE_KIND of each page. */
  kinds: Uint8Array;
  /** The bytes of pages (indexes), in the order given. */
  read(pages: readonly number[]): Promise<Uint8Array<ArrayBuffer>>;
}

/** A sequence's pages as the KV store reads them: from the pool, after the pending page work. */
export function sequencePages(pool: KvPagePool, seq: KvSequence): PageSource {
  const count = Math.ceil(seq.length / pool.pageTokens);
  return {
    length: seq.length,
    kinds: Uint8Array.from(seq.pages.slice(0, count), (entry) => decodePageEntry(entry).kind),
    read: (pages) => pool.readSequencePages(seq, pages),
  };
}

/** A host-memory copy's pages as the KV store reads them. */
export function imagePages(image: KvSequenceImage): PageSource {
  const offsets: number[] = [];
  let at = 0;
  for (const kind of image.kinds) {
    offsets.push(at);
    at += image.pool.pageBytesByKind[kind === KV_PAGE_KIND.quant ? 'quant' : 'f16'];
  }
  return {
    length: image.length,
    kinds: image.kinds,
    read: async (pages) => {
      const sizes = pages.map(
        (page) => image.pool.pageBytesByKind[image.kinds[page] === KV_PAGE_KIND.quant ? 'quant' : 'f16'],
      );
      const out = new Uint8Array(sizes.reduce((a, b) => a + b, 0));
      let to = 0;
      for (const [i, page] of pages.entries()) {
        out.set(image.bytes.subarray(offsets[page], offsets[page] + sizes[i]), to);
        to += sizes[i];
      }
      return out;
    },
  };
}

/** The conversations' KV records of one loaded model (one binding) in `store`. */
export class StoredKv {
  readonly store: KvFileStore;
  readonly binding: string;

  constructor(store: KvFileStore, binding: string) {
    this.store = store;
    this.binding = binding;
  }

  /**
   * Writes `source`'s pages (holding `ids`) to the conversation's record: the pages that changed since `previous` (all of them
   * without one, or when the file would hold more replaced copies than live ones), then the header. Returns the new
   * copy. Fails as the store fails (a full quota among them); the record is then in no state to trust, and the caller
   * removes it.
   */
  async save(
    pool: KvPagePool,
    conversation: string,
    source: PageSource,
    ids: readonly number[],
    previous: StoredCopy | null,
    persist: boolean,
  ): Promise<StoredCopy> {
    const record = previous?.record ?? (await storedRecordName(conversation));
    const count = source.kinds.length;
    const pageBytes = pool.pageBytesByKind;
    const kindOf = (page: number) => source.kinds[page];
    const sizeOf = (kind: number) => (kind === KV_PAGE_KIND.quant ? pageBytes.quant : pageBytes.f16);
    const usable = previous && previous.header.binding === this.binding ? previous : null;
    const unchanged = (page: number) =>
      usable !== null &&
      page < usable.changedFrom &&
      page < usable.header.pages.length &&
      usable.header.pages[page].kind === kindOf(page);
    let liveBytes = 0;
    for (let page = 0; page < count; page++) liveBytes += sizeOf(kindOf(page));
    const copy: number[] = [];
    for (let page = 0; page < count; page++) if (!unchanged(page)) copy.push(page);
    let newBytes = 0;
    for (const page of copy) newBytes += sizeOf(kindOf(page));
    // Rewrite from the start when there is no copy to add to or the replaced copies would outweigh the live ones.
    const rewrite = usable === null || usable.header.fileBytes + newBytes > 2 * liveBytes;
    const pagesToCopy = rewrite ? Array.from({ length: count }, (_, page) => page) : copy;
    const bytes = await source.read(pagesToCopy);
    const start = rewrite ? 0 : usable.header.fileBytes;
    const pages: StoredPage[] = rewrite ? [] : usable.header.pages.slice(0, count);
    let at = 0;
    const sums = await Promise.all(
      pagesToCopy.map((page) => {
        const size = sizeOf(kindOf(page));
        const slice = pageSlice(bytes, at, size);
        at += size;
        return sha256Hex(slice);
      }),
    );
    at = 0;
    for (const [i, page] of pagesToCopy.entries()) {
      const kind = kindOf(page);
      pages[page] = { kind, at: start + at, sha256: sums[i] };
      at += sizeOf(kind);
    }
    if (rewrite) await this.store.write(record, PAGES, bytes);
    else if (bytes.byteLength > 0) await this.store.write(record, PAGES, bytes, start);
    const header: StoredKvHeader = {
      format: STORED_KV_FORMAT,
      binding: this.binding,
      conversation,
      persist,
      length: source.length,
      ids: ids.slice(0, source.length),
      pageBytes,
      pages,
      fileBytes: start + bytes.byteLength,
    };
    const json = JSON.stringify(header);
    await this.store.write(
      record,
      HEADER,
      new TextEncoder().encode(`${await sha256Hex(new TextEncoder().encode(json))}\n${json}`),
    );
    return { record, header, changedFrom: count };
  }

  /**
   * The conversation's record as an image for `pool.restoreSequence`, its ids and the copy it is; null when there is
   * none. Throws StoredKvRefused, with the reason, for a record this pool must not read. The pages' checksums are
   * still being computed when it returns: `checked` rejects with StoredKvRefused when one does not match, so the
   * caller can copy the pages to the GPU meanwhile and must not use them before it resolves.
   */
  async load(
    pool: KvPagePool,
    conversation: string,
    vocab: number,
  ): Promise<{ image: KvSequenceImage; ids: number[]; copy: StoredCopy; checked: Promise<void> } | null> {
    const record = await storedRecordName(conversation);
    const headerBytes = await this.store.read(record, HEADER);
    if (headerBytes === null) return null;
    const header = await this.readHeader(headerBytes, pool, conversation, vocab);
    const file = await this.store.read(record, PAGES);
    if (file === null || file.byteLength < header.fileBytes) {
      throw new StoredKvRefused('its pages file is missing or shorter than its header says');
    }
    const sizeOf = (kind: number) => (kind === KV_PAGE_KIND.quant ? header.pageBytes.quant : header.pageBytes.f16);
    let total = 0;
    let inOrder = true; // the pages lie one after the other from the file's start (as a rewrite leaves them)
    for (const page of header.pages) {
      inOrder &&= page.at === total;
      total += sizeOf(page.kind);
    }
    const bytes = inOrder ? pageSlice(file, 0, total) : new Uint8Array(total);
    let at = 0;
    const checks = header.pages.map((page) => {
      const slice = pageSlice(file, page.at, sizeOf(page.kind));
      if (!inOrder) bytes.set(slice, at);
      at += slice.byteLength;
      return sha256Hex(slice).then((sum) => sum === page.sha256);
    });
    const checked = Promise.all(checks).then((matches) => {
      const bad = matches.indexOf(false);
      if (bad >= 0) {
        throw new StoredKvRefused(`page ${bad} does not match its checksum (the file was changed or cut short)`);
      }
    });
    // Handled by the caller's await; this keeps a rejection that lands before it from being reported as unhandled.
    checked.catch(() => {});
    const image: KvSequenceImage = {
      pool,
      length: header.length,
      kinds: Uint8Array.from(header.pages, (page) => page.kind),
      bytes,
    };
    return { image, ids: header.ids.slice(), copy: { record, header, changedFrom: header.pages.length }, checked };
  }

  /** Parses and checks a header against its own checksum, this binding and `pool`'s geometry. */
  private async readHeader(
    bytes: Uint8Array<ArrayBuffer>,
    pool: KvPagePool,
    conversation: string,
    vocab: number,
  ): Promise<StoredKvHeader> {
    const text = new TextDecoder().decode(bytes);
    const newline = text.indexOf('\n');
    const json = text.slice(newline + 1);
    if (newline < 0 || (await sha256Hex(new TextEncoder().encode(json))) !== text.slice(0, newline)) {
      throw new StoredKvRefused('its header does not match its checksum (the file was changed or cut short)');
    }
    let h: StoredKvHeader;
    try {
      h = JSON.parse(json) as StoredKvHeader;
    } catch {
      throw new StoredKvRefused('its header is not readable');
    }
    if (h?.format !== STORED_KV_FORMAT) throw new StoredKvRefused(`it is in another format (${String(h?.format)})`);
    if (h.binding !== this.binding) {
      throw new StoredKvRefused('it was made with another model, KV format, precision plan or rotation');
    }
    if (h.conversation !== conversation) throw new StoredKvRefused('it belongs to another conversation');
    const expected = pool.pageBytesByKind;
    const count = Math.ceil(h.length / pool.pageTokens);
    const wellFormed =
      Number.isInteger(h.length) &&
      h.length > 0 &&
      h.length <= pool.maxPagesPerSequence * pool.pageTokens &&
      Array.isArray(h.ids) &&
      h.ids.length === h.length &&
      h.ids.every((id) => Number.isInteger(id) && id >= 0 && id < vocab) &&
      h.pageBytes?.f16 === expected.f16 &&
      h.pageBytes?.quant === expected.quant &&
      Number.isInteger(h.fileBytes) &&
      Array.isArray(h.pages) &&
      h.pages.length === count &&
      h.pages.every(
        (p) =>
          (p.kind === KV_PAGE_KIND.f16 || (p.kind === KV_PAGE_KIND.quant && expected.quant > 0)) &&
          Number.isInteger(p.at) &&
          p.at >= 0 &&
          p.at + (p.kind === KV_PAGE_KIND.quant ? expected.quant : expected.f16) <= h.fileBytes &&
          typeof p.sha256 === 'string',
      );
    if (!wellFormed) throw new StoredKvRefused('its header does not describe pages of this cache');
    return h;
  }
}
