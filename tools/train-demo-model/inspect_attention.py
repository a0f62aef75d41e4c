#!/usr/bin/env python3
"""Numpy (CPU, no torch) forward of an exported demo model: checks the exported weights independently of train.py
and measures where attention goes, i.e. whether the model reads the part of its history that the 2-bit cache stores.

  python3 tools/train-demo-model/inspect_attention.py .train/run/manifest.json .train/tok/val.u16 [window_start] [T]

Prints the held-out loss of one window and, per layer and head, the mean attention mass that queries in the second
half of the window put on keys in the INT2 zone (64 <= s <= t - 256), in the sink (s < 64) and in the recent window,
and the largest weight any single INT2-zone key gets (about 1/t when a head only averages its history).
"""

import json
import os
import sys

import numpy as np


def load(manifest_path):
    m = json.load(open(manifest_path))
    base = os.path.dirname(manifest_path)
    w = {}
    for t in m["tensors"]:
        dtype = {"f32": "<f4", "f16": "<f2"}[t.get("dtype", "f32")]  # f16: train.py --weights-dtype f16
        a = np.fromfile(os.path.join(base, t["file"]), dtype=dtype, count=int(np.prod(t["shape"])), offset=t["offset"])
        w[t["name"]] = a.reshape(t["shape"]).astype(np.float32, copy=False)
    return m["hparams"], w


def rmsnorm(x, g, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def rope(x, theta):
    # llama.cpp NORMAL layout: adjacent pairs (2i, 2i+1); x: (heads, T, hd)
    hd, T = x.shape[-1], x.shape[-2]
    inv = theta ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(T)[:, None] * inv[None, :]
    c, s = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def forward(hp, w, ids, sink=64, window=256, late=None):
    T = len(ids)
    late = T // 2 if late is None else late
    D, L = hp["embedding_length"], hp["block_count"]
    H, KV = hp["attention.head_count"], hp["attention.head_count_kv"]
    hd, eps, theta = D // H, hp["attention.layer_norm_rms_epsilon"], hp["rope.freq_base"]
    x = w["token_embd.weight"][ids].astype(np.float64)
    t = np.arange(T)
    causal = t[None, :] <= t[:, None]
    zone_int2 = (t[None, :] >= sink) & (t[None, :] <= t[:, None] - window)
    zone_sink = np.broadcast_to(t[None, :] < sink, (T, T))
    mass = np.zeros((L, H, 4))
    for i in range(L):
        h = rmsnorm(x, w[f"blk.{i}.attn_norm.weight"], eps)
        q = (h @ w[f"blk.{i}.attn_q.weight"].T).reshape(T, H, hd).transpose(1, 0, 2)
        k = (h @ w[f"blk.{i}.attn_k.weight"].T).reshape(T, KV, hd).transpose(1, 0, 2)
        v = (h @ w[f"blk.{i}.attn_v.weight"].T).reshape(T, KV, hd).transpose(1, 0, 2)
        q, k = rope(q, theta), rope(k, theta)
        outs = []
        for hh in range(H):
            kv = hh // (H // KV)
            s = q[hh] @ k[kv].T / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            pl = p[late:]
            mass[i, hh] = [(pl * zone_int2[late:]).sum(-1).mean(), (pl * zone_sink[late:]).sum(-1).mean(),
                           (pl * (~zone_int2[late:] & ~zone_sink[late:])).sum(-1).mean(),
                           np.where(zone_int2[late:], pl, 0).max(-1).mean()]
            outs.append(p @ v[kv])
        x = x + np.concatenate(outs, -1) @ w[f"blk.{i}.attn_output.weight"].T
        h = rmsnorm(x, w[f"blk.{i}.ffn_norm.weight"], eps)
        g = h @ w[f"blk.{i}.ffn_gate.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w[f"blk.{i}.ffn_up.weight"].T)) @ w[f"blk.{i}.ffn_down.weight"].T
    logits = rmsnorm(x, w["output_norm.weight"], eps) @ w["output.weight"].T
    return logits, mass


def main():
    manifest, ids_path = sys.argv[1:3]
    start = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    T = int(sys.argv[4]) if len(sys.argv) > 4 else 2048
    hp, w = load(manifest)
    ids = np.fromfile(ids_path, dtype="<u2").astype(np.int64)[start : start + T + 1]
    logits, mass = forward(hp, w, ids[:-1])
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    loss = lse - logits[np.arange(T), ids[1:]]
    print(f"loss over {T} tokens: {loss.mean():.4f} (positions >= {T // 2}: {loss[T // 2 :].mean():.4f}, < 256: {loss[:256].mean():.4f})")
    print(f"attention of queries at t >= {T // 2}: layer head | mass on INT2 zone | sink | recent window | largest single INT2-zone weight")
    for i in range(mass.shape[0]):
        for h in range(mass.shape[1]):
            print(f"  {i} {h} | {mass[i, h, 0]:.3f} | {mass[i, h, 1]:.3f} | {mass[i, h, 2]:.3f} | {mass[i, h, 3]:.4f}")


if __name__ == "__main__":
    main()
