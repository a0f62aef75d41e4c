#!/usr/bin/env python3
"""Numpy replay of the runtime's quantized KV cache, for what-if questions on the CPU (which clip, which group size)
before a GPU run. Independent of the runtime (a second implementation of its row format, as inspect_attention.py is
of its forward): checked against it on the demo model (README, "Session 7").

  python3 tools/train-demo-model/emulate_kv.py MANIFEST ROT_PREFIX copy TRIALS.json N VARIANTS
  python3 tools/train-demo-model/emulate_kv.py MANIFEST ROT_PREFIX ppl IDS.u16 N VARIANTS

MANIFEST: train.py's exported f32 weights; ROT_PREFIX and TRIALS.json: from export-eval-inputs.ts (the calibrated
rotations embedded in the GGUF, and the CLI's own retrieval trials); IDS.u16: tokenizer.py's id files (the
perplexity windows of `longtab eval --ctx 2048` are the same ids, bos/eos wrapper dropped). VARIANTS, comma-separated:
f16, int2-none, int2-calibrated (the fitted clip quantiles), int1-none, ROT-kK-vV-gG[-LLAYERS] (ROT none|cal; K, V
clip quantiles, or "fit" for the fitted one; G group size; -L: clipped only in the listed layers, one digit each,
e.g. -L4567, so layers 0-9 only). What-if suffixes, in this order: -kbB keys at B bits, -kgG keys in groups of G,
-vbB / -vgG the same for values, -boostN N rotated key channels per KV head at 4 bits (chosen by an oracle
sensitivity on the sequence itself), -BLAYERS those only in the listed layers (digits, as -L). Or ROT-oN-gG (no clip;
the N values of each group farthest from its median kept exactly, min/max codes over the rest: a dense-and-sparse
row). E.g. cal-k1-v1-g128 = calibrated rotation without clipping; cal-kfit-vfit-g128-L0123467-kb4-vb4-B5 = the
runtime's int2-calibrated+L5 (layer 5 at 4 bits, unclipped).

What is emulated (runtime/kv/quant-format.ts, runtime/kv/pool.ts defaults): K after RoPE and V rounded to f16,
rotated per KV head as x·R, a row = kvHeads × headDim values cut into groups; per group lo/hi at the (1−q)/q
quantiles (rank rounded), lo and scale rounded to f16, codes clamped; dequantized and rotated back. Query t reads key
j dequantized iff j >= sink (64) and j's 16-token page ends at or before t − window (256), as decoding sees it
(prefill demotes between 64-token chunks, so the runtime quantizes slightly later). Not emulated: Hadamard rotation.
"""

import json
import re
import sys
from dataclasses import dataclass

import numpy as np

from inspect_attention import load, rmsnorm, rope

SINK, WINDOW, PAGE = 64, 256, 16


def f16(x):
    return np.asarray(x, dtype=np.float16).astype(np.float32)


def uniform_codes(g, lo, hi, bits):
    """Asymmetric uniform codes between lo and hi, dequantized; lo and scale rounded to f16 before coding, codes
    rounded half up in f64 (JavaScript's Math.round, as quantizeRow). `bits` may be an array broadcast against g
    (channels boosted to more bits within the group's range)."""
    g, lo, hi = g.astype(np.float64), f16(lo).astype(np.float64), hi.astype(np.float64)
    levels = (np.left_shift(1, bits) - 1).astype(np.float64)
    scale = f16(np.maximum(hi - lo, 0) / levels).astype(np.float64)
    code = np.where(scale > 0, np.clip(np.floor((g - lo) / np.where(scale > 0, scale, 1) + 0.5), 0, levels), 0)
    return (lo + code * scale).astype(np.float32)


def quantize_rows(x, bits, group, clip):
    """x: [tokens, width] → dequantized, the row format of runtime/kv/quant-format.ts. bits: an int, or one per
    column (what-if only: the runtime has one width)."""
    T, W = x.shape
    g = x.reshape(T, W // group, group)
    if not np.isscalar(bits):
        bits = np.asarray(bits).reshape(W // group, group)
    s = np.sort(g, -1)
    rank = lambda q: min(group - 1, max(0, int(np.floor(q * (group - 1) + 0.5))))  # Math.round, as quantileOfSorted
    return uniform_codes(g, s[..., rank(1 - clip)][..., None], s[..., rank(clip)][..., None], bits).reshape(T, W)


T95_TABLE = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def t95(df):
    """Two-sided 95% Student t quantile, as runtime/eval/perplexity.ts studentT95: the table to df 10, then
    Cornish-Fisher."""
    if df <= len(T95_TABLE):
        return T95_TABLE[max(1, round(df)) - 1]
    z = 1.959963984540054
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2) + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)


def quantize_rows_outliers(x, bits, group, keep):
    """min/max codes over each group without its `keep` most extreme values (by distance from the group median),
    which are kept exactly (dense-and-sparse)."""
    T, W = x.shape
    g = x.reshape(T, W // group, group)
    med = np.median(g, -1, keepdims=True)
    order = np.argsort(-np.abs(g - med), -1)
    mask = np.zeros_like(g, dtype=bool)
    np.put_along_axis(mask, order[..., :keep], True, -1)
    inner = np.where(mask, np.nan, g)
    coded = uniform_codes(g, np.nanmin(inner, -1, keepdims=True), np.nanmax(inner, -1, keepdims=True), bits)
    return np.where(mask, f16(g), coded).reshape(T, W)


@dataclass
class Variant:
    bits: int
    clip_k: float
    clip_v: float
    rotated: bool
    group: int
    clip_layers: set | None = None  # clip only in these layers (None: all)
    keep_outliers: int = 0  # dense-and-sparse: values per group kept exactly (then no clip)
    key_bits: int | None = None  # what-if: keys at another width (None: bits)
    key_group: int | None = None  # what-if: keys in other groups (None: group)
    value_bits: int | None = None  # what-if: values at another width (None: bits)
    value_group: int | None = None  # what-if: values in other groups (None: group)
    key_boost: int = 0  # KITTY-style: per KV head, this many rotated key channels at 4 bits within the group's range
    boost_layers: set | None = None  # wider keys (key_bits, key_boost) only in these layers (None: all)


def parse_variant(name, fitted_clip):
    """The cache a variant name stands for; None for the f16 cache."""
    presets = {"f16": None, "int2-none": Variant(2, 1, 1, False, 128), "int1-none": Variant(1, 1, 1, False, 128)}
    if name in presets:
        return presets[name]
    if name == "int2-calibrated":
        return Variant(2, fitted_clip["key"], fitted_clip["value"], True, 128)
    m = re.fullmatch(r"(none|cal)-o(\d+)-g(\d+)", name)
    if m:
        return Variant(2, 1, 1, m[1] == "cal", int(m[3]), keep_outliers=int(m[2]))
    m = re.fullmatch(r"(none|cal)-k([\d.]+|fit)-v([\d.]+|fit)-g(\d+)(?:-L(\d+))?(?:-kb(\d))?(?:-kg(\d+))?(?:-vb(\d))?(?:-vg(\d+))?(?:-boost(\d+))?(?:-B(\d+))?", name)
    if not m:
        sys.exit(f"unknown variant {name}")
    layers = {int(c) for c in m[5]} if m[5] else None
    clip_k, clip_v = (fitted_clip[kind] if c == "fit" else float(c) for kind, c in (("key", m[2]), ("value", m[3])))
    return Variant(2, clip_k, clip_v, m[1] == "cal", int(m[4]), clip_layers=layers,
                   key_bits=int(m[6]) if m[6] else None, key_group=int(m[7]) if m[7] else None,
                   value_bits=int(m[8]) if m[8] else None, value_group=int(m[9]) if m[9] else None,
                   key_boost=int(m[10]) if m[10] else 0, boost_layers={int(c) for c in m[11]} if m[11] else None)


def logits_under(hp, w, ids, variant, rot):
    T = len(ids)
    D, L = hp["embedding_length"], hp["block_count"]
    H, KV = hp["attention.head_count"], hp["attention.head_count_kv"]
    hd, eps, theta = D // H, hp["attention.layer_norm_rms_epsilon"], hp["rope.freq_base"]
    x = w["token_embd.weight"][ids]
    t = np.arange(T)
    causal = t[None, :] <= t[:, None]
    zone = (t[None, :] >= SINK) & (((t[None, :] // PAGE) + 1) * PAGE <= t[:, None] - WINDOW)
    for i in range(L):
        h = rmsnorm(x, w[f"blk.{i}.attn_norm.weight"], eps).astype(np.float32)
        q = (h @ w[f"blk.{i}.attn_q.weight"].T).reshape(T, H, hd).transpose(1, 0, 2)
        k = (h @ w[f"blk.{i}.attn_k.weight"].T).reshape(T, KV, hd).transpose(1, 0, 2)
        v = (h @ w[f"blk.{i}.attn_v.weight"].T).reshape(T, KV, hd).transpose(1, 0, 2)
        q, k, v = rope(q, theta).astype(np.float32), f16(rope(k, theta)), f16(v)
        if variant is not None:
            clipped = variant.clip_layers is None or i in variant.clip_layers
            clip_k, clip_v = (variant.clip_k, variant.clip_v) if clipped else (1, 1)

            wide = variant.boost_layers is None or i in variant.boost_layers

            def cache(a, r, clip, is_key):
                ar = np.stack([a[j] @ r[i, j] for j in range(KV)]) if variant.rotated else a
                rows = f16(ar.transpose(1, 0, 2).reshape(T, KV * hd))
                bits, group = variant.bits, variant.group
                if wide:
                    bits = (variant.key_bits if is_key else variant.value_bits) or bits
                    group = (variant.key_group if is_key else variant.value_group) or group
                if is_key and wide and variant.key_boost:
                    # oracle sensitivity on this very sequence (an upper bound on what a calibrated choice buys):
                    # mean squared query times key variance, per rotated channel
                    qr = [np.stack([q[hh] @ r[i, j] for hh in range(j * (H // KV), (j + 1) * (H // KV))]) if variant.rotated
                          else q[j * (H // KV):(j + 1) * (H // KV)] for j in range(KV)]
                    bits = np.full(KV * hd, bits)
                    for j in range(KV):
                        sens = (qr[j] ** 2).mean((0, 1)) * ar[j].var(0)
                        bits[j * hd + np.argsort(-sens)[: variant.key_boost]] = 4
                if variant.keep_outliers:
                    rows = quantize_rows_outliers(rows, bits, group, variant.keep_outliers)
                else:
                    rows = quantize_rows(rows, bits, group, clip)
                back = rows.reshape(T, KV, hd).transpose(1, 0, 2)
                return np.stack([back[j] @ r[i, j].T for j in range(KV)]) if variant.rotated else back

            kq, vq = cache(k, rot["key"], clip_k, True), cache(v, rot["value"], clip_v, False)
        outs = []
        for hh in range(H):
            kv = hh // (H // KV)
            s = q[hh] @ k[kv].T / np.sqrt(hd)
            if variant is not None:
                s = np.where(zone, q[hh] @ kq[kv].T / np.sqrt(hd), s)
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            outs.append(p @ v[kv] if variant is None else np.where(zone, 0, p) @ v[kv] + np.where(zone, p, 0) @ vq[kv])
        x = x + np.concatenate(outs, -1) @ w[f"blk.{i}.attn_output.weight"].T
        h = rmsnorm(x, w[f"blk.{i}.ffn_norm.weight"], eps)
        g = h @ w[f"blk.{i}.ffn_gate.weight"].T
        x = (x + ((g / (1 + np.exp(-g))) * (h @ w[f"blk.{i}.ffn_up.weight"].T)) @ w[f"blk.{i}.ffn_down.weight"].T).astype(np.float32)
    return rmsnorm(x, w["output_norm.weight"], eps) @ w["output.weight"].T


def main():
    manifest, rot_prefix, mode, data, n, names = sys.argv[1:7]
    n, names = int(n), names.split(",")
    hp, w = load(manifest)
    w = {k: a.astype(np.float32) for k, a in w.items()}
    meta = json.load(open(rot_prefix + ".rotations.json"))
    shape = (meta["layers"], meta["kvHeads"], meta["headDim"], meta["headDim"])
    rot = {kind: np.fromfile(f"{rot_prefix}.{kind}.f32", dtype="<f4").reshape(shape) for kind in ("key", "value")}
    variants = {name: parse_variant(name, meta["clip"] or {"key": 1, "value": 1}) for name in names}
    scores = {name: [] for name in names}
    if mode == "copy":
        # top-1 on the scored positions of each trial (the CLI's score: mean over a trial's items)
        for i, trial in enumerate(json.load(open(data))["trials"][:n]):
            ids = np.array(trial["ids"])
            for name in names:
                top = logits_under(hp, w, ids, variants[name], rot).argmax(-1)
                scores[name].append(np.mean([all(top[p - 1] == ids[p] for p in item) for item in trial["items"]]))
            print(f"trial {i}: " + ", ".join(f"{name} {scores[name][-1]:.3f}" for name in names), flush=True)
        for name in names:
            a = np.array(scores[name])
            print(f"{name}: mean top-1 {a.mean():.3f} ± {t95(len(a) - 1) * a.std(ddof=1) / np.sqrt(len(a)):.3f} (95%, {len(a)} trials)")
    elif mode == "ppl":
        ids_all = np.fromfile(data, dtype="<u2").astype(np.int64)[1:-1]
        T = 2048
        for wi in range(n):
            ids = ids_all[wi * T : (wi + 1) * T]
            for name in names:
                lg = logits_under(hp, w, ids, variants[name], rot).astype(np.float64)
                m = lg.max(-1, keepdims=True)
                nll = (np.log(np.exp(lg - m).sum(-1)) + m[:, 0])[:-1] - lg[np.arange(T - 1), ids[1:]]
                scores[name].append(nll.mean())
            print(f"window {wi}: " + ", ".join(f"{name} {np.exp(scores[name][-1]):.1f}" for name in names), flush=True)
        base = np.array(scores[names[0]])
        for name in names:
            d = np.array(scores[name]) - base
            half = t95(len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else 0.0
            print(f"{name}: perplexity {np.exp(np.mean(scores[name])):.2f}, vs {names[0]} {np.exp(d.mean()) - 1:+.2%} "
                  f"[{np.exp(d.mean() - half) - 1:+.2%}, {np.exp(d.mean() + half) - 1:+.2%}] ({len(d)} windows)")
    else:
        sys.exit(f"mode {mode}: copy or ppl")


if __name__ == "__main__":
    main()
