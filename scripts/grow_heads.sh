#!/usr/bin/env bash
# Issue #14, item 3: grow the reference heads in segments. A segment captures conversations the
# heads have not seen (from capture.offset on), continues both heads from the committed ones in
# heads/ (train.init_from) for EPOCHS epochs on it, and evaluates them on the reference heads'
# held-out split (33 conversations answered greedily by the target). DATA=onpolicy (default):
# the target answers the first turn greedily (what greedy serving sees) through our generator
# (BACKEND=ours, the default: as fast as vLLM for CPU here at 32 answers a batch, and no ~75 s
# start) or through vLLM for CPU (BACKEND=vllm, what segments 2-4 used);
# DATA=tf: the dataset's own answers, every turn (teacher-forced, ~8x cheaper a token, but
# measured to lower held-out tau: docs/training.md). Every stage resumes and a finished one is skipped.
# Each segment's result goes into results/grow_segments.json (scripts/grow_record.py). PUBLISH=1
# copies the grown heads and their records into heads/ and appends the segment to
# heads/<head>/grow_segments.json: do it (and commit) when tau measurably improved, offline and
# in the runtime bench. KINDS=eagle3 trains, records and publishes one kind only.
#
#   SEG=2 OFFSET=2352 LIMIT=512 bash scripts/grow_heads.sh            # capture, train, eval
#   SEG=2 OFFSET=2352 LIMIT=512 PUBLISH=1 bash scripts/grow_heads.sh  # then publish
#
# Conversations already used (training split order): 0-1279 on-policy and 1280-2303
# teacher-forced by scripts/reference_heads.sh, 2304-2351 by docs/training.md's quick-preset
# experiment, 2352-2863 by segments 1 (teacher-forced), 2 (on-policy) and 3 (segment 2's
# capture at BATCH=1), none published, then 2352-3887 by segment 4 (on-policy, BATCH=1,
# published; docs/training.md: growing the reference heads), 3888-5423 by segment 5 (on-policy, BATCH=1,
# our generator, published), 5424-6959 by segment 6 (one epoch, EAGLE-3 only, not published;
# then two epochs, both kinds: EAGLE-3 published, held-out tau +0.063, runtime tau unchanged;
# EAGLE-2 not, held-out tau -0.043; a session later EAGLE-2 one epoch on the same capture:
# held-out +0.040, published as segment 6 from runs/grow/seg6e2), 6960-14809 by segment 7 on a
# lent H100 (scripts/gpu_grow.sh; published: EAGLE-3 at lr 2e-4, 8 a step, beat 1e-4, 4 a step).
# 14810-16089 by segment 9 (first turns, EAGLE-3 only, on the AVX2 CPU: the capture stopped
# after 1,280 conversations to leave time for training; docs/training.md; segment 8, up to 3 turns of
# 256 tokens on a lent H100, not published, had used 14810 on too), 14810-16809 by segment 10
# (a lent H100, published), 16810-17487 by segment 11 (the AVX2 CPU, not published): no first
# turns are left. Segment 12 (a lent H100, published) answered the 496 first prompts of 640-1023
# tokens of the whole split (segment_prompts.py --min-length 640 --max-length 1024), then
# segment 7's prompts 6960-11170 again to 384 tokens (tokens 161-384 new). LR=2e-4 BATCH=8 was
# segment 7's best (from segment 6's head, 1.6M tokens).
# Every CPU-sized continuation of a mature head lost held-out tau, less at a lower lr: segment 9
# (259k tokens, 8 a step) -0.075 / -0.058 / -0.017 at 2e-4 / 1e-4 / 2e-5 (runs 9, 9b, 9c),
# segment 11 (139k, one a step, 2 epochs) -0.069 / -0.012 at 1e-4 / 2e-5 (docs/training.md); the heads
# grew again only on a GPU's segment (segment 10: 400k tokens, 5.4 epochs at 1e-4).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SEG=${SEG:?segment number}
OFFSET=${OFFSET:?first training conversation of the segment}
LIMIT=${LIMIT:-512}
DATA=${DATA:-onpolicy}
BACKEND=${BACKEND:-ours}
EPOCHS=${EPOCHS:-2}
LR=${LR:-1e-4}
BATCH=${BATCH:-4}            # conversations a step (the shipped heads trained with 4)
KINDS=${KINDS:-eagle3 eagle2}
W=${W:-runs/grow}
HELDOUT=${HELDOUT:-$W/heldout-greedy}   # a capture dir whose heldout/ is the greedy split
S=$W/seg$SEG
T=SmolLM2-135M-Instruct
run() { echo "+ eagle_train $*" >&2; "$PY" -m eagle_train preset=reference workdir="$W" "$@"; }

# The held-out split every segment is evaluated on (the shipped heads' eval.json used it too).
[ -f "$HELDOUT/heldout/manifest.json" ] || run stage=capture capture.limit=0 capture_dir="$HELDOUT"

C=$S/capture-$DATA
case $DATA in
  onpolicy) run stage=capture capture.backend="$BACKEND" capture.temperature=0 capture.offset="$OFFSET" \
              capture.limit="$LIMIT" capture_dir="$C" eval.num_samples=0 ;;
  tf) run stage=capture capture.regenerate=false capture.max_turns=null capture.offset="$OFFSET" \
        capture.limit="$LIMIT" capture_dir="$C" eval.num_samples=0 ;;
  *) echo "DATA must be onpolicy or tf, got $DATA" >&2; exit 2 ;;
esac

for d in $KINDS; do
  run stage=train draft=$d capture_dir="$C" train.init_from="heads/$T-$d" \
    train.max_steps=null train.epochs="$EPOCHS" train.lr="$LR" train.batch_size="$BATCH" head_dir="$S/$d"
  run stage=eval draft=$d capture_dir="$HELDOUT" eval.head="$S/$d" head_dir="$S/$d" \
    eval_dir="$S/eval-$d"
done

rec() { "$PY" scripts/grow_record.py --kind "$1" --segment "$SEG" --offset "$OFFSET" --limit "$LIMIT" \
          --data "$DATA" --segment-dir "$S" --capture "$C" "${@:2}"; }
if [ "${PUBLISH:-0}" != 1 ]; then
  for d in $KINDS; do rec $d; done  # results/grow_segments.json, published: false
  exit 0
fi
for d in $KINDS; do
  H=heads/$T-$d
  rec $d --publish
  cp "$S/$d"/{config.json,model.safetensors,train_summary.json,train_log.jsonl,train_loss.png} "$H"/
  cp "$S/$d/config.yaml" "$H/train_config_seg$SEG.yaml"
  cp "$C/config.yaml" "$H/capture_config_seg$SEG.yaml"
  cp "$S/eval-$d"/{eval.json,acceptance.png} "$H"/
done
