#!/usr/bin/env python3
"""Can this model shape learn to copy at all? A diagnostic for the demo model's missing induction (README.md).

Trains one variant on tiled rows only with train.py's copying phase (learn_copying: a pattern of P tokens repeated to
fill the row, P from 8 to --max-period, shuffled text windows or uniform ids), at the full 2,048 tokens, and logs the
loss on the copyable positions (every token after the first period). A
model that copies drives that loss toward 0; one that does not stays near the pattern tokens' entropy.

  python3 tools/train-demo-model/induction_probe.py --variant text_shuf --steps 600 --out $OUT/probe-text_shuf.json

Variants change one thing against "text_shuf" (shuffled windows of the training text, the demo shape, lr 2e-3,
weight decay 0.1, GPT-2-style init):
  uniform     patterns of uniformly random ordinary tokens (the first call of session 6: stuck at ln 8188)
  small_vocab uniformly random tokens from ids 0..511 only
  bias        q/k/v biases (a constant component in q and k lets RoPE alone make a previous-token head)
  init05      every matrix N(0, 0.05) instead of 0.02
  lr6         peak learning rate 6e-3
  layers2     2 layers instead of 8
"""

import argparse
import json
import os

import torch

import train as tr

VARIANTS = {
    "text_shuf": {},
    "uniform": {"source": "uniform"},
    "small_vocab": {"source": "uniform", "vocab": 512},
    "bias": {"shape": {"qkv_bias": True}},
    "init05": {"std": 0.05},
    "lr6": {"lr": 6e-3},
    "layers2": {"shape": {"n_layers": 2}},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    ap.add_argument("--data", default=".train/tok")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--max-period", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    v = VARIANTS[args.variant]
    dev = "cuda"
    cfg = tr.Config()
    for k, val in v.get("shape", {}).items():
        setattr(cfg, k, val)
    cfg.dropout = 0.0
    torch.manual_seed(1234)
    model = tr.Llama(cfg, dev).to(dev)
    if "std" in v:
        for name, p in model.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, 0.0, v["std"])
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            torch.nn.init.zeros_(p)
    fwd = torch.compile(model)
    data = tr.load_u16(os.path.join(args.data, "train.u16"), dev)
    lr = v.get("lr", 2e-3)
    opt = tr.make_optimizer(model, lr, 0.1)
    gen = torch.Generator().manual_seed(1)
    T, B = cfg.ctx, args.batch
    # the copying phase of train.py at full length, never stopped early (until < 0)
    setup = {"ctx": T, "period": args.max_period, "steps": args.steps, "until": -1.0}
    if v.get("source") == "uniform":
        setup["vocab"] = v.get("vocab", tr.CONTROL_TOKENS_FROM)
    curve = tr.learn_copying(model, fwd, opt, lr, 100, B * T, setup, data, gen, dev, args.variant)
    with open(args.out, "w") as f:
        json.dump({"variant": args.variant, "config": v, "steps": args.steps, "max_period": args.max_period,
                   "batch": B, "ctx": T, "curve": curve}, f, indent=1)


if __name__ == "__main__":
    main()
