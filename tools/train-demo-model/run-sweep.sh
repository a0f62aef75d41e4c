# Trains shapes side by side on one H200 (device `run`, carry .train/tok), e.g. session 2:
#   SHAPES="probe gqa4" SWEEP=d1_e12,d0_e30,d0_e20_shuf sh tools/train-demo-model/run-sweep.sh
# TRAIN_TIMEOUT_S (560) and DEADLINE_S (420) leave room for other work in the same 600 s call.
# Returns each shape's train.log and log.json, and the weights of the first shape (in SHAPES order) whose chosen
# checkpoint passes the INT2 proof, else of the first shape.
set -u
SHAPES=${SHAPES:-probe gqa4}
for s in $SHAPES; do
  mkdir -p /tmp/$s
  ( PYTHONUNBUFFERED=1 timeout -s INT ${TRAIN_TIMEOUT_S:-560} python3 tools/train-demo-model/train.py --data .train/tok --out /tmp/$s \
      --shape $s --sweep ${SWEEP:-d1_e12,d0_e30,d0_e20_shuf} --deadline-s ${DEADLINE_S:-420} > /tmp/$s/train.log 2>&1 ) &
done
wait
for s in $SHAPES; do cp /tmp/$s/train.log $OUT/${s}_train.log; cp /tmp/$s/log.json $OUT/${s}_log.json; done
pick=$(SHAPES="$SHAPES" python3 - <<'PY'
import json, os
shapes = os.environ["SHAPES"].split()
best = None
for s in shapes:
    try:
        r = json.load(open(f"/tmp/{s}/log.json"))
    except Exception:
        continue
    rn, cn = r["chosen"].split("/")
    if r["runs"][rn]["checkpoints"][cn]["passes_int2_proof"] and best is None:
        best = s
print(best or shapes[0])
PY
)
echo "weights from: $pick"; cp /tmp/$pick/weights-*.bin /tmp/$pick/manifest.json $OUT/
grep -h "===\|evaluating\|  val:\|wikitext2_test:\|repeat@\|saved\|chosen" $(for s in $SHAPES; do echo /tmp/$s/train.log; done)
