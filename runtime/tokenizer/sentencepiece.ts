/**
 * SentencePiece BPE as llama.cpp runs it for `tokenizer.ggml.model = llama`: start from single characters, repeatedly
 * merge the adjacent pair whose concatenation is the highest-scoring vocabulary piece (leftmost on ties), then emit
 * each final symbol as its token or, when it is not in the vocabulary, as `<0xNN>` byte tokens.
 *
 * Implemented here rather than through @huggingface/tokenizers' BPE model: that model ranks merge *pairs* with unique
 * integer ranks, so pieces with equal scores (or one piece reachable from several pairs) would break ties differently
 * from llama.cpp, and synthesising merges from scores costs O(vocab × length) at load.
 */

interface Bigram {
  left: number;
  right: number;
  score: number;
  /** Length of the merged text when queued; a mismatch later means the bigram is stale. */
  length: number;
}

/** Max-heap on score, leftmost first among equal scores (llama.cpp `llm_bigram_spm::comparator`). */
class BigramQueue {
  private readonly heap: Bigram[] = [];
  get size(): number {
    return this.heap.length;
  }
  private before(a: Bigram, b: Bigram): boolean {
    return a.score > b.score || (a.score === b.score && a.left < b.left);
  }
  push(item: Bigram): void {
    const heap = this.heap;
    heap.push(item);
    let i = heap.length - 1;
    while (i > 0) {
      const parent = (i - 1) >> 1;
      if (!this.before(heap[i], heap[parent])) break;
      [heap[i], heap[parent]] = [heap[parent], heap[i]];
      i = parent;
    }
  }
  pop(): Bigram {
    const heap = this.heap;
    const top = heap[0];
    const last = heap.pop()!;
    if (heap.length > 0) {
      heap[0] = last;
      let i = 0;
      for (;;) {
        const l = 2 * i + 1;
        const r = l + 1;
        let best = i;
        if (l < heap.length && this.before(heap[l], heap[best])) best = l;
        if (r < heap.length && this.before(heap[r], heap[best])) best = r;
        if (best === i) break;
        [heap[i], heap[best]] = [heap[best], heap[i]];
        i = best;
      }
    }
    return top;
  }
}

export interface SentencePieceVocab {
  idByText: ReadonlyMap<string, number>;
  scores: Float32Array;
  /** Token id for each byte value (from `<0xNN>` pieces), -1 where the vocabulary has none. */
  byteIds: Int32Array;
  unkId?: number;
}

const utf8 = new TextEncoder();

/** Tokenizes text that already has spaces escaped as `▁` (and the dummy prefix added, if the model wants one). */
export function sentencePieceEncode(vocab: SentencePieceVocab, text: string, out: number[]): void {
  if (text.length === 0) return;
  // Symbols are code points, held as [start, length) in UTF-16 units; length 0 marks a symbol merged away.
  const start: number[] = [];
  const length: number[] = [];
  for (let i = 0; i < text.length; ) {
    const cp = text.codePointAt(i)!;
    const n = cp > 0xffff ? 2 : 1;
    start.push(i);
    length.push(n);
    i += n;
  }
  const count = start.length;
  const prev = new Int32Array(count);
  const next = new Int32Array(count);
  for (let i = 0; i < count; i++) {
    prev[i] = i - 1;
    next[i] = i + 1 < count ? i + 1 : -1;
  }

  const queue = new BigramQueue();
  const tryAddBigram = (left: number, right: number): void => {
    if (left < 0 || right < 0) return;
    const merged = text.substr(start[left], length[left] + length[right]);
    const id = vocab.idByText.get(merged);
    if (id === undefined) return;
    queue.push({ left, right, score: vocab.scores[id], length: merged.length });
  };
  for (let i = 1; i < count; i++) tryAddBigram(i - 1, i);

  while (queue.size > 0) {
    const bigram = queue.pop();
    const { left, right } = bigram;
    if (length[left] === 0 || length[right] === 0 || length[left] + length[right] !== bigram.length) continue;
    length[left] += length[right];
    length[right] = 0;
    next[left] = next[right];
    if (next[right] >= 0) prev[next[right]] = left;
    tryAddBigram(prev[left], left);
    tryAddBigram(left, next[left]);
  }

  for (let i = 0; i !== -1 && count > 0; i = next[i]) {
    const piece = text.substr(start[i], length[i]);
    const id = vocab.idByText.get(piece);
    if (id !== undefined) {
      out.push(id);
      continue;
    }
    // Only single characters can be missing (every merge produces a vocabulary piece): fall back to their bytes.
    for (const byte of utf8.encode(piece)) {
      const byteId = vocab.byteIds[byte];
      if (byteId >= 0) out.push(byteId);
      else if (vocab.unkId !== undefined) out.push(vocab.unkId);
    }
  }
}
