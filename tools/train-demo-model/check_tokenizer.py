#!/usr/bin/env python3
"""Cross-check tokenizer.json against Hugging Face `tokenizers` (an independent GPT-2 byte-level BPE + GPT-2 regex).

  python3 tools/train-demo-model/check_tokenizer.py tools/train-demo-model/tokenizer.json TEXT_FILE IDS_U16_FILE

IDS_U16_FILE is what tokenizer.py wrote for TEXT_FILE (with <|bos|> first and <|eos|> last). Needs `tokenizers`
(the device machine has it). Exits non-zero on the first mismatch.
"""

import json
import sys

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

tok_json, text_path, ids_path = sys.argv[1:4]
t = json.load(open(tok_json, encoding="utf-8"))
vocab = {s: i for i, s in enumerate(t["tokens"])}
merges = [tuple(m.split(" ")) for m in t["merges"]]
hf = Tokenizer(models.BPE(vocab=vocab, merges=merges))
hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
hf.decoder = decoders.ByteLevel()
text = open(text_path, encoding="utf-8").read()
ours = np.fromfile(ids_path, dtype="<u2").astype(np.int64)[1:-1].tolist()
ref = hf.encode(text).ids
n = min(len(ours), len(ref))
first = next((i for i in range(n) if ours[i] != ref[i]), None)
if first is None and len(ours) == len(ref):
    print(f"tokenizer matches HF tokenizers on {text_path}: {len(ours)} ids identical")
    sys.exit(0)
print(f"MISMATCH at {first}: ours {len(ours)} ids, HF {len(ref)}; ours {ours[first:first + 8]} HF {ref[first:first + 8]}")
sys.exit(1)
