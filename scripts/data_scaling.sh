#!/usr/bin/env bash
# Issue #14, item 2: held-out tau against training tokens, EAGLE-3 and EAGLE-2 from scratch, and
# capture temperature 0 against 0.7 at equal tokens. Every stage resumes and a finished one is
# skipped, so a killed run goes on where it stopped. Then:
#   python scripts/plot_data_scaling.py  ->  results/data_scaling.json + results/data_scaling.png
#
# Data: teacher-forced ShareGPT chunks (the dataset's answers, every turn, cut at 640 tokens;
# one forward per token, ~5x cheaper than generating) that double the training set at each
# point: chunk 1, 1+2, 1+2+3, 1+2+3+4. Each point trains from scratch for EPOCHS epochs with the
# reference recipe (lr 1e-3, 4 conversations a step, cosine) and the reference 8,192-token draft
# vocabulary (tokenmaps/), so only the data differs. All heads are evaluated on one held-out
# split, answered greedily by the target (what greedy serving sees).
# Temperature: the first 128 conversations regenerated on-policy at T=0.7 and at T=0 (through
# vLLM for CPU), then the largest EAGLE-3 point is continued on each for EPOCHS epochs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
W=${W:-runs/i14/scale}
EPOCHS=${EPOCHS:-2}
ONPOLICY=${ONPOLICY:-128}                       # on-policy conversations per temperature
CHUNKS=${CHUNKS:-"128:24 152:24 176:48 224:96"} # teacher-forced chunks, offset:conversations
run() { echo "+ eagle_train $*" >&2; "$PY" -m eagle_train preset=reference workdir="$W" "$@"; }

# 1. On-policy captures; the T=0.7 one also holds the greedy held-out split every eval reads.
run stage=capture capture.backend=vllm capture.limit="$ONPOLICY" capture_dir="$W/capture-t07"
run stage=capture capture.backend=vllm capture.limit="$ONPOLICY" capture.temperature=0 \
  capture_dir="$W/capture-t0" eval.num_samples=0

# 2. Teacher-forced chunks (no held-out split of their own).
i=0
for c in $CHUNKS; do
  i=$((i + 1))
  run stage=capture capture.regenerate=false capture.max_turns=null capture.offset="${c%%:*}" \
    capture.limit="${c##*:}" capture_dir="$W/tf-$i" eval.num_samples=0
done
n_chunks=$i

# 3. The curve: point k trains on chunks 1..k; both kinds per size, so a cut-off run leaves
#    both curves equally far along.
extra=""
for k in $(seq 1 "$n_chunks"); do
  [ "$k" -gt 1 ] && extra="${extra:+$extra,}$W/tf-$k"
  for d in eagle3 eagle2; do
    run stage=train draft=$d capture_dir="$W/tf-1" "train.extra_captures=[$extra]" \
      train.max_steps=null train.epochs="$EPOCHS" head_dir="$W/$d-tf$k"
    run stage=eval draft=$d capture_dir="$W/capture-t07" eval.head="$W/$d-tf$k" \
      head_dir="$W/$d-tf$k" eval_dir="$W/eval-$d-tf$k"
  done
done

# 4. Temperature at equal conversations: the largest EAGLE-3 point continued on each capture.
for t in t07 t0; do
  run stage=train draft=eagle3 capture_dir="$W/capture-$t" train.init_from="$W/eagle3-tf$n_chunks" \
    train.max_steps=null train.epochs="$EPOCHS" train.lr=3e-4 head_dir="$W/eagle3-tf$n_chunks-$t"
  run stage=eval draft=eagle3 capture_dir="$W/capture-t07" eval.head="$W/eagle3-tf$n_chunks-$t" \
    head_dir="$W/eagle3-tf$n_chunks-$t" eval_dir="$W/eval-eagle3-tf$n_chunks-$t"
done

# 5. The shipped reference heads on the same held-out split (a point from the longer recipe).
for d in eagle3 eagle2; do
  run stage=eval draft=$d capture_dir="$W/capture-t07" eval.head="heads/SmolLM2-135M-Instruct-$d" \
    head_dir="heads/SmolLM2-135M-Instruct-$d" eval_dir="$W/eval-$d-shipped"
done
