#!/usr/bin/env bash
# The recipe of the reference heads in heads/ (SmolLM2-135M-Instruct, ShareGPT), stage by stage.
# Every stage resumes: run the script again after a kill and it goes on where it stopped, and a
# finished stage is skipped. On a GPU the whole recipe is minutes; on the 2-core CPU it took
# three sittings (see docs/training.md).
set -euo pipefail
cd "$(dirname "$0")/.."
W='${workdir}'  # resolved by Hydra: runs/SmolLM2-135M-Instruct/sharegpt-reference
TF_LIMIT="${TF_LIMIT:-1024}"        # teacher-forced conversations (the shipped heads: see docs/training.md)
GROWN_STEPS="${GROWN_STEPS:-420}"   # optimizer steps of the grown heads

# 1. On-policy capture: the target regenerates the first answer of the first 1,280 training
#    conversations (T=0.7, 160 new tokens; the 40 held-out ones greedily, for stage=eval);
#    conversations over 640 tokens are skipped.
python -m eagle_train stage=capture preset=reference
# 2. FR-Spec token maps and the EAGLE-3 draft vocabulary from its assistant tokens.
python -m eagle_train stage=tokenmap preset=reference
# 3. First heads: 700 steps on the on-policy capture.
for d in eagle3 eagle2; do
  python -m eagle_train stage=train preset=reference draft=$d
done
# 4. Teacher-forced capture of the next conversations: the dataset's own answers, every turn,
#    cut at 640 tokens. Only a forward pass per token (no generation): ~5x cheaper per token.
python -m eagle_train stage=capture preset=reference "capture_dir=$W/capture-teacher" \
  capture.regenerate=false capture.max_turns=null capture.offset=1280 capture.limit="$TF_LIMIT"
# 5. Grown heads: continue from the first ones on both captures; the draft vocabulary stays the
#    one mined from the on-policy answers (what the head drafts at serving time).
for d in eagle3 eagle2; do
  python -m eagle_train stage=train preset=reference draft=$d "head_dir=$W/$d-grown" \
    "train.init_from=$W/$d" "train.extra_captures=[$W/capture-teacher]" \
    train.max_steps="$GROWN_STEPS" train.lr=5e-4
  python -m eagle_train stage=eval preset=reference draft=$d "head_dir=$W/$d-grown" "eval_dir=$W/eval-$d-grown"
done
# 6. Publish: the grown head and its records into heads/ (what serving loads by default).
R=runs/SmolLM2-135M-Instruct/sharegpt-reference
for d in eagle3 eagle2; do
  H=heads/SmolLM2-135M-Instruct-$d
  mkdir -p "$H"
  cp "$R/$d-grown"/{config.json,model.safetensors,train_summary.json,train_log.jsonl,train_loss.png} "$H"/
  cp "$R/$d-grown/config.yaml" "$H/train_config.yaml"
  cp "$R/eval-$d-grown"/{eval.json,acceptance.png} "$H"/
  cp "$R/capture/config.yaml" "$H/capture_config.yaml"
  cp "$R/capture-teacher/config.yaml" "$H/capture_teacher_config.yaml"
done
