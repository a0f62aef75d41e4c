# session 2 sweep: probe (2x128 heads, 1 KV head) and gqa4 (4x64 heads, 1 KV head) trained side by side on one H200
set -u
for s in probe gqa4; do
  mkdir -p /tmp/$s
  ( PYTHONUNBUFFERED=1 timeout -s INT 560 python3 tools/train-demo-model/train.py --data .train/tok --out /tmp/$s \
      --shape $s --sweep d1_e12,d0_e30,d0_e20_shuf --deadline-s 420 > /tmp/$s/train.log 2>&1 ) &
done
wait
for s in probe gqa4; do cp /tmp/$s/train.log $OUT/${s}_train.log; cp /tmp/$s/log.json $OUT/${s}_log.json; done
pick=$(python3 - <<'PY'
import json
best = None
for s in ("gqa4", "probe"):
    try:
        r = json.load(open(f"/tmp/{s}/log.json"))
    except Exception:
        continue
    rn, cn = r["chosen"].split("/")
    ok = r["runs"][rn]["checkpoints"][cn]["passes_int2_proof"]
    if ok and best is None:
        best = s
print(best or "gqa4")
PY
)
echo "weights from: $pick"; cp /tmp/$pick/weights-*.bin /tmp/$pick/manifest.json $OUT/
grep -h "===\|evaluating\|val:\|wikitext2_test:\|repeat@\|saved\|chosen" /tmp/probe/train.log /tmp/gqa4/train.log
