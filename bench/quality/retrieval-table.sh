#!/bin/sh
# The retrieval and perplexity table of the 2-bit cache on held-out models (issue 35, point 3), on the GPU host.
# Every model runs in a process of its own, side by side (the small models leave the GPU mostly idle):
#   1. `longtab calibrate`: what a user's background calibration computes (rotations, clip, precision plan), cached;
#   2. copy of a 64-token passage at distances 512/1024/1536 in 2,048 tokens of held-out Austen, 200 trials per
#      cell, for f16, the default int2, int2-hadamard and naive int2-none;
#   3. perplexity over 2,048-token windows of held-out Austen, the same modes, with top-1 agreement against f16.
# MODELS="name=path ..." (GGUF files), EMBEDDED="name ..." (models that carry their calibration and plan in their
# metadata, as the shipped demo model does: not recalibrated), TEXT (the filler and perplexity text), KIT (default
# /tmp/kit), CLI (the bundled CLI, default .gpu/longtab.mjs), STEPS (default "copy perplexity"; also "passkey" and
# "recall" at length 2048, in RETRIEVAL_MODES (default MODES) with RETRIEVAL_TRIALS (default TRIALS) trials), WORK
# (default /tmp/retrieval-table: two runs side by side need two). Writes $OUT/$(basename $WORK).tar.gz (every JSON and
# log).
# The default TEXT is held-out Austen, the validation split of each novel joined in file-name order; from the repo root:
#   cd tools/train-demo-model && python3 -c "import sys, pathlib; from tokenizer import split_train_val; \
#     sys.stdout.write(''.join(split_train_val(p.read_text(encoding='utf-8'))[1] for p in \
#     sorted(pathlib.Path('../../../shared/corpora/austen').glob('*.txt'))))" > ../../.train/evaltext/austen-heldout.txt
set -u
KIT=${KIT:-/tmp/kit}
CLI=${CLI:-.gpu/longtab.mjs}
TEXT=${TEXT:-.train/evaltext/austen-heldout.txt}
MODES=${MODES:-f16,int2,int2-hadamard,int2-none}
TRIALS=${TRIALS:-200}
STEPS=${STEPS:-copy perplexity}
RETRIEVAL_MODES=${RETRIEVAL_MODES:-$MODES}
RETRIEVAL_TRIALS=${RETRIEVAL_TRIALS:-$TRIALS}
work=${WORK:-/tmp/retrieval-table}
rm -rf $work && mkdir -p $work
# What has finished so far, as the call returns it (a call killed at its limit returns the last pack).
pack() { part=$(mktemp $OUT/.pack.XXXXXX) && chmod 644 $part && tar czf $part -C $work --exclude='*-cache' . && mv $part $OUT/$(basename $work).tar.gz; }
# The kit unpacks its loader libraries on its first run: once here, not in four processes at once.
$KIT/run.sh $CLI info --help > /dev/null 2>&1 || true
for entry in $MODELS; do
  name=${entry%%=*}; path=${entry#*=}
  (
    export LONGTAB_CACHE_DIR=$work/$name-cache
    L="$KIT/run.sh $CLI"
    start=$(date +%s)
    case " ${EMBEDDED:-} " in
      *" $name "*) ;;
      *) [ -e $work/stopped ] || $L calibrate --model "$path" > $work/$name-calibrate.json 2> $work/$name-calibrate.log ;;
    esac
    for step in $STEPS; do
      [ -e $work/stopped ] && break  # past the budget: no step starts after the watchdog
      case $step in
        copy) $L eval --task copy --model "$path" --text "$TEXT" --lengths 2048 --distances 512,1024,1536 --trials $TRIALS \
          --kv $MODES --chunk 128 --json > $work/$name-copy.json 2> $work/$name-copy.log ;;
        perplexity) $L eval --model "$path" --text "$TEXT" --ctx 2048 --kv $MODES --compare --chunk 128 \
          ${MAX_WINDOWS:+--max-windows $MAX_WINDOWS} --json > $work/$name-perplexity.json 2> $work/$name-perplexity.log ;;
        passkey|recall) $L eval --task $step --model "$path" --text "$TEXT" --lengths 2048 --trials $RETRIEVAL_TRIALS \
          --kv $RETRIEVAL_MODES --chunk 128 --json > $work/$name-$step.json 2> $work/$name-$step.log ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
      esac
      pack
    done
    echo "$name: $(( $(date +%s) - start )) s" >> $work/times.txt
  ) &
  pids="${pids:-} $!"
done
# A call has a time limit: past BUDGET_S (default 540) the evaluations still running are stopped, no later step
# starts (a second step used to start after the first was stopped, and ran the call past its limit with nothing
# returned), and what finished (each eval writes its JSON at the end, its log line by line) still comes back, packed
# after every step as well as at the end. The watchdog stops the evaluation each model's shell is running (its
# child: the kit's run.sh execs node), not processes found by name: the kit runs a copy of $CLI, so a command line
# that holds $CLI is the call's own.
# Several models side by side share the GPU: four models with copy and perplexity beside passkey and recall in a
# second instance ran past 555 s; three models with copy and perplexity took 262 s on the H200; three models with
# passkey and recall ran past 560 s (stopped by the call's limit: run one of the two steps a call).
# Its sleep is stopped with it (an orphaned sleep would hold the call's output open); the second pass catches a step
# that began just before the stop file.
( sleep ${BUDGET_S:-540} & s=$!; trap 'kill $s; exit 0' TERM; wait $s
  touch $work/stopped; for pass in 1 2; do for pid in $pids; do pkill -P $pid; done; sleep 2; done ) 2>/dev/null &
watchdog=$!
wait $pids
kill $watchdog 2>/dev/null
cat $work/times.txt 2>/dev/null
pack
