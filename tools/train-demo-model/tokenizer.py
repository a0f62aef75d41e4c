#!/usr/bin/env python3
"""Train the demo model's byte-level BPE tokenizer and encode the corpora into uint16 id files.

Pure standard library (Python 3.11). The pre-tokenizer is the GPT-2 regex, so llama.cpp with
tokenizer.ggml.model = "gpt2" and tokenizer.ggml.pre = "gpt-2" reproduces these ids exactly.

  python3 tools/train-demo-model/tokenizer.py --shared ../shared --out .train/tok \
      --json tools/train-demo-model/tokenizer.json

Writes tokenizer.json (committed; small) and, under --out (ignored, derived from ../shared/corpora):
train.u16, val.u16 (held-out tail of every training text), wikitext2_test.u16, wikitext2_valid.u16,
tinystories.u16, tinyshakespeare.u16, plus stats.json. WikiText-2, TinyStories and tinyshakespeare are
evaluation text only: they never enter the tokenizer's or the model's training data.
"""

import argparse
import heapq
import json
import re
import sys
import time
import unicodedata
from array import array
from collections import Counter
from pathlib import Path

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
VAL_FRACTION = 0.05
# ChatML-style; the model saw only <|bos|>/<|eos|> around documents in training (no chat data exists in the corpora).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable unicode character map (token strings are spelled with it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _category_class(prefix):
    """A regex character class for every code point whose Unicode category starts with prefix (\\p{L}, \\p{N})."""
    ranges = []
    start = None
    for cp in range(0x110000):
        inside = unicodedata.category(chr(cp)).startswith(prefix)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append((start, cp - 1))
            start = None
    if start is not None:
        ranges.append((start, 0x10FFFF))
    esc = lambda cp: "\\U%08x" % cp  # noqa: E731
    return "".join(esc(a) if a == b else esc(a) + "-" + esc(b) for a, b in ranges)


def gpt2_pattern():
    # The GPT-2 regex: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    # Python's re has no \p{..}; the classes are spelled out from unicodedata instead.
    L = _category_class("L")
    N = _category_class("N")
    return re.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?[" + L + r"]+| ?[" + N + r"]+| ?[^\s" + L + N + r"]+|\s+(?!\S)|\s+"
    )


KJV_VERSE = re.compile(r"^[0-9A-Za-z]+?\d+:\d+ ", re.M)


def load_training_docs(shared):
    """(name, text) per document: the KJV (verse labels like 'Ge1:1 ' removed) and six Austen novels."""
    corpora = Path(shared) / "corpora"
    docs = [("kjv", KJV_VERSE.sub("", (corpora / "kjv" / "kjv-bible.txt").read_text(encoding="utf-8")))]
    for p in sorted((corpora / "austen").glob("*.txt")):
        docs.append((p.stem, p.read_text(encoding="utf-8")))
    return docs


def split_train_val(text):
    """Hold out the last VAL_FRACTION of a document, cut at a line boundary."""
    cut = text.find("\n", int(len(text) * (1 - VAL_FRACTION)))
    return text[: cut + 1], text[cut + 1 :]


def train_bpe(word_counts, vocab_target):
    """Greedy byte-pair merging over unique pre-tokens, incremental pair counts, lazy max-heap."""
    words = [list(w) for w in word_counts]
    freqs = list(word_counts.values())
    pair_counts = Counter()
    where = {}
    for i, (w, f) in enumerate(zip(words, freqs)):
        for p in zip(w, w[1:]):
            pair_counts[p] += f
            where.setdefault(p, set()).add(i)
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    token_bytes = [bytes([b]) for b in range(256)]
    bytes_to_id = {b: i for i, b in enumerate(token_bytes)}
    merges = []  # (left id, right id, result id)
    while len(token_bytes) < vocab_target and heap:
        negc, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negc:
            continue  # stale entry
        if -negc < 2:
            break
        a, b = pair
        merged = token_bytes[a] + token_bytes[b]
        new_id = bytes_to_id.get(merged)
        if new_id is None:  # two merge paths can spell the same bytes: keep one token for them
            new_id = len(token_bytes)
            token_bytes.append(merged)
            bytes_to_id[merged] = new_id
        merges.append((a, b, new_id))
        changed = set()
        for i in list(where.get(pair, ())):
            w, f = words[i], freqs[i]
            for p in zip(w, w[1:]):
                pair_counts[p] -= f
                changed.add(p)
            out = []
            j = 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(new_id)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for p in zip(out, out[1:]):
                pair_counts[p] += f
                where.setdefault(p, set()).add(i)
                changed.add(p)
        pair_counts.pop(pair, None)
        where.pop(pair, None)
        for p in changed:
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_counts.pop(p, None)
    return token_bytes, merges


class Encoder:
    """Rank-based BPE encode (what llama.cpp and HF do): repeatedly merge the lowest-rank adjacent pair."""

    def __init__(self, token_bytes, merges, pattern):
        self.rank = {(a, b): (r, c) for r, (a, b, c) in enumerate(merges)}
        self.pattern = pattern
        self.cache = {}

    def encode_word(self, wb):
        ids = self.cache.get(wb)
        if ids is not None:
            return ids
        w = list(wb)
        rank = self.rank
        while len(w) > 1:
            best = None
            for p in zip(w, w[1:]):
                rc = rank.get(p)
                if rc is not None and (best is None or rc[0] < best[0]):
                    best = (rc[0], p, rc[1])
            if best is None:
                break
            _, (a, b), c = best
            out = []
            j = 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(c)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            w = out
        self.cache[wb] = w
        return w

    def encode(self, text):
        ids = []
        for m in self.pattern.finditer(text):
            ids.extend(self.encode_word(m.group().encode("utf-8")))
        return ids


def write_u16(path, ids):
    a = array("H", ids)
    if sys.byteorder != "little":
        a.byteswap()
    path.write_bytes(a.tobytes())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default="../shared")
    ap.add_argument("--out", default=".train/tok")
    ap.add_argument("--json", default="tools/train-demo-model/tokenizer.json")
    args = ap.parse_args()
    t0 = time.time()
    pattern = gpt2_pattern()
    docs = load_training_docs(args.shared)
    splits = [(name, *split_train_val(text)) for name, text in docs]

    word_counts = Counter()
    for _, train_text, _ in splits:
        for m in pattern.finditer(train_text):
            word_counts[m.group().encode("utf-8")] += 1
    print(f"pre-tokens: {sum(word_counts.values())} ({len(word_counts)} unique), {time.time() - t0:.1f}s", flush=True)

    n_base_target = VOCAB_SIZE - len(SPECIAL_TOKENS)
    token_bytes, merges = train_bpe(word_counts, n_base_target)
    print(f"merges: {len(merges)}, tokens: {len(token_bytes)}, {time.time() - t0:.1f}s", flush=True)

    b2u = bytes_to_unicode()
    spell = lambda bs: "".join(b2u[b] for b in bs)  # noqa: E731
    tokens = [spell(b) for b in token_bytes] + SPECIAL_TOKENS
    token_types = [1] * len(token_bytes) + [3] * len(SPECIAL_TOKENS)  # llama.cpp: 1 normal, 3 control
    special = {s: len(token_bytes) + i for i, s in enumerate(SPECIAL_TOKENS)}
    bos, eos = special["<|bos|>"], special["<|eos|>"]
    assert len(set(tokens)) == len(tokens) == VOCAB_SIZE
    tok_json = {
        "about": "longtab demo model tokenizer: byte-level BPE (GPT-2 byte map and pre-tokenizer regex), "
        "trained by tools/train-demo-model/tokenizer.py on KJV + Jane Austen (train split)",
        "model": "gpt2",
        "pre": "gpt-2",
        "vocab_size": len(tokens),
        "tokens": tokens,
        "token_types": token_types,
        "merges": [f"{spell(token_bytes[a])} {spell(token_bytes[b])}" for a, b, _ in merges],
        "special_tokens": special,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "eot_token_id": special["<|im_end|>"],
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }
    Path(args.json).write_text(json.dumps(tok_json, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

    enc = Encoder(token_bytes, merges, pattern)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stats = {"vocab_size": len(tokens), "merges": len(merges), "files": {}}
    train_ids, val_ids = [], []
    for name, train_text, val_text in splits:
        a, b = enc.encode(train_text), enc.encode(val_text)
        train_ids += [bos] + a + [eos]
        val_ids += [bos] + b + [eos]
        stats["files"][name] = {"train_tokens": len(a), "val_tokens": len(b), "train_chars": len(train_text)}
        print(f"  {name}: train {len(a)} val {len(b)} ({len(train_text) / max(len(a), 1):.2f} chars/token)", flush=True)
    outputs = {"train": train_ids, "val": val_ids}
    corpora = Path(args.shared) / "corpora"
    evals = {
        "wikitext2_test": corpora / "wikitext-2" / "test.txt",
        "wikitext2_valid": corpora / "wikitext-2" / "valid.txt",
        "tinystories": corpora / "tinystories" / "TinyStories-valid-30KB-subset.txt",
        "tinyshakespeare": corpora / "tinyshakespeare" / "input.txt",
    }
    for name, path in evals.items():
        text = path.read_text(encoding="utf-8")
        outputs[name] = [bos] + enc.encode(text) + [eos]
    for name, ids in outputs.items():
        write_u16(out / f"{name}.u16", ids)
        stats[f"{name}_tokens"] = len(ids)
        print(f"{name}: {len(ids)} tokens", flush=True)
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
