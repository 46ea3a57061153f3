#!/usr/bin/env bash
# Issue #14, item 3, on a lent GPU: grow the reference heads by one large segment inside a fixed
# time budget. The prompts come as a JSONL (scripts/segment_prompts.py writes the training split
# from a given offset, so the machine needs no ShareGPT package); the target answers them
# greedily (on-policy, what greedy serving sees) with nothing but token ids stored
# (capture.store_states=false); each head then trains with the target computing its states
# online, continuing from the committed head (train.init_from). Several trainings run side by
# side (each is launch-bound on a 135M target; the GPU has room), each for the time left
# (train.max_seconds, at most its epochs; the cosine schedule spans that time, so no step count is
# guessed; PROBE>0 adds short probes that report seconds a step and setup first). Heads,
# summaries, logs and configs end in $OUT/heads.tar.* (15 MB parts: the device tool returns
# files of 16 MiB at most); evaluate them afterwards on the held-out split (grow_heads.sh's eval).
#
#   PROMPTS=seg.jsonl.xz BUDGET=520 OUT=runs/gpu_grow bash scripts/gpu_grow.sh
#   (on a lent machine: MODE=grow bash scripts/device_prep.sh, after scripts/device_blobs.sh)
#
# HELDOUT: a capture folder whose heldout/ split holds token ids (device_blobs.sh carries the
# reference held-out split as .blob3/heldout): each trained head is then evaluated there, on the
# GPU (target states online), its tau goes into the log, and only the KEEP best heads travel back
# with their weights (a call returns 64 MiB: three EAGLE-3 heads), so a call can train more runs
# than it can return. The ranking is the machine's; the CPU eval stays the published number.
# EVAL_ARGS adds overrides to those evals (eval.num_samples=4 for a dry run on a CPU).
#
# RUNS: name:kind:lr:batch:epochs[:steps[:overrides]] entries; a run given its steps skips the
# probe; overrides (comma-separated, e.g. "t3:eagle3:2e-4:32:6::train.online_tf32=true") go to
# that run's training only, after TRAIN_ARGS. All runs under one deadline, BUDGET seconds from
# the start; the capture stops at CAPTURE_S and
# training uses what it captured by then (a second call resumes the capture where it stopped).
# Segment 7 (docs/training.md) ran it with PROBE=20 RUNS="e3:eagle3:1e-4:4:2 e3hi:eagle3:3e-4:4:2
# e2:eagle2:1e-4:4:1", then again on the same warm machine (the capture resumed) with
# CAPTURE_S=95 RUNS="f3:eagle3:1e-4:4:2:1500 f3b:eagle3:2e-4:8:2:800 f2:eagle2:1e-4:4:2:1600".
# Segment 8 (later turns; docs/training.md: not published) added CAPTURE_ARGS="capture.max_turns=3
# capture.max_new_tokens_per_turn=256 data.max_length=1024" to TOTAL=565 CAPTURE_S=220
# RUNS="e3:eagle3:2e-4:8:2 e3hi:eagle3:4e-4:8:2 e2:eagle2:1e-4:4:1", then TOTAL=380 CAPTURE_S=160
# RUNS="f3:eagle3:2e-4:8:2:400 f3hi:eagle3:4e-4:8:2:400 f2:eagle2:1e-4:4:1:400".
# Segment 10 (new first turns, then replay: device_blobs.sh SEGMENT_REPLAY) ran CAPTURE_ARGS=
# "capture.compile=auto" (then the default) CAPTURE_S=150 RUNS="r3:eagle3:1e-4:8:1:1200
# r3hi:eagle3:2e-4:8:1:1200 r2:eagle2:1e-4:4:1:2400" TOTAL=560, then CAPTURE_ARGS=
# "capture.compile=false" CAPTURE_S=135 RUNS="s3:eagle3:1e-4:8:1:650 s3hi:eagle3:2e-4:8:1:650"
# TOTAL=320. Segment 12 (long first prompts, then longer answers to segment 7's prompts) ran
# CAPTURE_ARGS="capture.max_new_tokens_per_turn=384 data.max_length=1024" TRAIN_ARGS=
# "train.max_length=1408" TOTAL=580 CAPTURE_S=180 PROBE=20 RUNS="g3:eagle3:1e-4:8:6
# g3m:eagle3:5e-5:8:6 g3lo:eagle3:2e-5:8:6". Segment 13 (longer answers to the prompts from
# 11171 on) ran the same CAPTURE_ARGS/TRAIN_ARGS with TOTAL=585 CAPTURE_S=180 PROBE=20
# RUNS="h3:eagle3:1e-4:8:6 h3hi:eagle3:2e-4:8:6 h3b:eagle3:4e-4:32:6 h3bm:eagle3:2e-4:32:6" (32 a
# step won: 2.19 against 2.12), then TOTAL=320 CAPTURE_S=75 RUNS="k3:eagle3:2e-4:32:6:280".
# Segment 14 (sampled answers to the first prompts, device_blobs.sh SEGMENT_OFFSET=0; docs/training.md: not
# published, every lr lowered tau) added capture.temperature=0.7 to those CAPTURE_ARGS with
# TOTAL=585 CAPTURE_S=180 PROBE=20 RUNS="a3:eagle3:2e-4:32:6 c3:eagle3:4e-4:64:6
# t3:eagle3:2e-4:32:6::train.online_tf32=true", then TOTAL=230 CAPTURE_S=1
# RUNS="l3:eagle3:5e-5:32:6:200 m3:eagle3:1e-4:32:6:200". Segment 15 (the target's own prompts,
# device_blobs.sh SEGMENT_FILE=data/magpie/smollm2-135m-seed0.jsonl.xz; docs/training.md: not published, their
# kind's tau up, ShareGPT's down) ran segment 13's CAPTURE_ARGS/TRAIN_ARGS with TOTAL=585 CAPTURE_S=180
# PROBE=20 RUNS="a3:eagle3:2e-4:32:6 b3:eagle3:1e-4:32:6 l3:eagle3:5e-5:32:6". Segment 16 (published:
# segment 13's ShareGPT prompts with the unreached Magpie prompts, device_blobs.sh SEGMENT_REPLAY=11171:4500
# SEGMENT_MIX=... SEGMENT_MIX_SKIP=4096 SEGMENT_INIT=<segment 15's a3 head>) ran the same CAPTURE_ARGS/
# TRAIN_ARGS with TOTAL=585 CAPTURE_S=180 PROBE=20 RUNS="a3:eagle3:2e-4:32:6 l3:eagle3:5e-5:32:6
# x3:eagle3:1e-4:32:6::train.init_from=/root/init", then, on the same machine, `cp -r
# /tmp/gpu_grow/x3 /root/initx3` and TOTAL=330 CAPTURE_S=60 RUNS="y3:eagle3:1e-4:32:6:420:
# train.init_from=/root/initx3 z3:eagle3:5e-5:32:6:420:train.init_from=/root/initx3" (y3 published).
# CAPTURE_ARGS and TRAIN_ARGS add overrides to the capture and to every training. At most three
# EAGLE-3 heads fit what a call returns (64 MiB).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-runs/gpu_grow}
W=${W:-/tmp/gpu_grow}
PROMPTS=${PROMPTS:?a .jsonl or .jsonl.xz of prompts (scripts/segment_prompts.py)}
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET:-520}          # seconds for everything, packing included
CAPTURE_S=${CAPTURE_S:-200}    # the capture's own limit
CBATCH=${CBATCH:-256}          # answers generated a batch
PROBE=${PROBE:-0}              # optimizer steps of each probe (0: none; 40 = 4 log windows)
SETUP_S=${SETUP_S:-35}         # a training run's start (target, head, data) before its first step
# name:kind:lr:batch:epochs[:steps[:overrides]] (header). Segment 13 measured 32 conversations a
# step at lr 2e-4 best for EAGLE-3 (2.2x the tokens a second of 8 a step: most of a step of 8 does
# not grow with the batch; docs/training.md).
RUNS=${RUNS:-"e3:eagle3:2e-4:32:6 e2:eagle2:1e-4:4:1"}
HELDOUT=${HELDOUT:-}
KEEP=${KEEP:-3}
EVAL_S=0            # seconds kept back for the evals, when there is a held-out split
[ -z "$HELDOUT" ] || EVAL_S=${EVAL_S_HELDOUT:-45}
T=SmolLM2-135M-Instruct
T0=$SECONDS
mkdir -p "$OUT" "$W"
LOG=$OUT/gpu_grow.log
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$LOG"; }
EAGLE=("$PY" -m eagle_train preset=reference workdir="$W" device="$DEVICE")

say "prompts: $PROMPTS; runs: $RUNS"

C=$W/capture
say "capture: greedy answers, token ids only, batches of $CBATCH, at most $CAPTURE_S s"
capture() {  # time limit, extra overrides...
  local limit=$1
  shift
  timeout "$limit" "${EAGLE[@]}" stage=capture data.source="$PROMPTS" data.heldout=0 capture.offset=0 \
    capture.limit=null capture.temperature=0 capture.store_states=false capture.batch_size="$CBATCH" \
    capture.shard_size="$CBATCH" capture_dir="$C" eval.num_samples=0 hydra.run.dir="$W/hydra/capture" \
    ${CAPTURE_ARGS:-} "$@" >>"$W/capture.log" 2>&1
}
# Should the capture fail (CUDA graphs with CAPTURE_ARGS="capture.compile=auto", or memory at a
# large batch of long prompts), the rest of its time goes to eager steps: at a quarter of the
# batch after running out of memory, else at the same batch (a capture resumes from its finished
# shards; the batch size is not part of what it holds).
capture "$CAPTURE_S"
rc=$?
left=$((CAPTURE_S - (SECONDS - T0)))
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$left" -gt 30 ]; then
  b=$CBATCH
  ! grep -a -q -i 'out of memory' "$W/capture.log" || b=$((CBATCH / 4))
  say "capture: exit $rc ($(grep -a -i -E 'error' "$W/capture.log" | tail -1)); eager steps, batches of $b, for the $left s left"
  capture "$left" capture.compile=false capture.batch_size="$b"
  rc=$?
fi
say "capture: exit $rc; $(grep -a -E '^capture|gen .*tok/s' "$W/capture.log" | tail -2 | tr '\r' '\n' | tail -2)"

# train.online_tf32=true: segment 14's A/B (two runs side by side, same data, lr and batch) trained
# 1.27x the tokens a second at equal held-out tau (2.125 against 2.126); TRAIN_ARGS may turn it off.
train_limit() { echo $((BUDGET - (SECONDS - T0) - 25 - EVAL_S)); }  # a training's seconds, packing kept back
train() {  # name kind lr batch epochs steps head_dir [overrides]; stopped in time for the packing below
  # (timeout's SIGTERM: the trainer saves the head of the step it reached and exits). A run given
  # no steps trains for the time left, less its setup (train.max_seconds: the lr decays over it
  # and the head is finished when it is spent), at most its epochs.
  local limit extra=${8:-} steps=${6:-null} budget=()
  limit=$(train_limit)
  [ "$limit" -gt 0 ] || limit=1  # timeout 0 would mean no limit
  [ -n "$6" ] || budget=(train.max_seconds=$((limit - SETUP_S - 10)))
  timeout "$limit" "${EAGLE[@]}" train.wandb.mode=disabled stage=train \
    draft="$2" capture_dir="$C" train.init_from="heads/$T-$2" train.lr="$3" train.batch_size="$4" \
    train.epochs="$5" train.max_steps="$steps" "${budget[@]}" train.save_every=0 head_dir="$7" \
    hydra.run.dir="$7.hydra" train.online_tf32=true ${TRAIN_ARGS:-} ${extra//,/ }
}
# Probes (PROBE > 0 steps each, side by side as the real runs will be) measure a run's setup and
# seconds a step; a longer setup than SETUP_S replaces it. Before train.max_seconds they planned
# each run's steps, and on the H200 planned too few: real steps took 0.6x the probes' seconds
# (segments 15 and 16 left 100-160 s of a 585 s call unused).
if [ "$PROBE" -gt 0 ]; then
  pids=()
  for r in $RUNS; do
    IFS=: read -r name kind lr batch epochs fixed extra <<<"$r"
    [ -z "$fixed" ] || continue
    (s=$SECONDS; train "$name" "$kind" "$lr" "$batch" "$epochs" "$PROBE" "$W/probe-$name" "$extra" >"$W/probe-$name.log" 2>&1
     echo "$((SECONDS - s))" >"$W/probe-$name.wall") &
    pids+=($!)
  done
  [ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
  for r in $RUNS; do
    name=${r%%:*}
    [ -f "$W/probe-$name.wall" ] || continue
    read -r per_step setup < <("$PY" - "$W/probe-$name" "$(cat "$W/probe-$name.wall")" 2>>"$LOG" <<'EOF' || echo "? 0"
import json, sys
d, wall = sys.argv[1], float(sys.argv[2])
s = json.load(open(f"{d}/train_summary.json"))
# Seconds a step from the log windows after the first: the first holds CUDA's warm-up.
recs = [json.loads(line) for line in open(f"{d}/train_log.jsonl")]
steady = [(r["seconds"], r["step"] - p["step"]) for p, r in zip(recs, recs[1:]) if "seconds" in r]
per_step = sum(t for t, _ in steady) / sum(n for _, n in steady) if steady else s["train_seconds_this_run"] / s["step"]
print(f"{per_step:.3f}", f"{wall - s['train_seconds_this_run']:.0f}")
EOF
)
    say "probe $name: ${per_step:-?} s a step, setup ${setup:-?} s"
    [ "${setup:-0}" -le $((SETUP_S - 5)) ] || SETUP_S=$((setup + 5))
  done
fi
pids=()
for r in $RUNS; do
  IFS=: read -r name kind lr batch epochs fixed extra <<<"$r"
  left=$(($(train_limit) - SETUP_S - 10))  # the train.max_seconds train() will give it
  [ -n "$fixed" ] || [ "$left" -gt 0 ] || { say "train $name: no time left"; continue; }
  say "train $name ($kind, lr $lr, batch $batch${extra:+, $extra}): ${fixed:-$left s of steps (train.max_seconds), $epochs epochs at most}${fixed:+ steps}"
  (train "$name" "$kind" "$lr" "$batch" "$epochs" "$fixed" "$W/$name" "$extra" >"$W/$name.log" 2>&1; echo "exit $?" >>"$W/$name.log") &
  pids+=($!)
done
wait "${pids[@]}"
for r in $RUNS; do
  name=${r%%:*}
  say "$name: $(grep -a -h -E 'train: (done|stopped)|Error|^exit' "$W/$name.log" 2>/dev/null | tail -3 | tr '\n' ' ')"
done
# The held-out evals, side by side; then the runs best first (tau; unevaluated ones last).
ranked=()
if [ -n "$HELDOUT" ]; then
  pids=()
  limit=$((BUDGET - (SECONDS - T0) - 20))
  [ "$limit" -gt 0 ] || limit=1
  for r in $RUNS; do
    IFS=: read -r name kind _ <<<"$r"
    [ -f "$W/$name/model.safetensors" ] || continue
    timeout "$limit" "${EAGLE[@]}" stage=eval draft="$kind" capture_dir="$HELDOUT" \
      eval.head="$W/$name" eval_dir="$W/$name/eval" hydra.run.dir="$W/$name.hydra-eval" ${EVAL_ARGS:-} \
      >"$W/eval-$name.log" 2>&1 &
    pids+=($!)
  done
  [ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
  mapfile -t ranked < <(for r in $RUNS; do
    name=${r%%:*}
    "$PY" -c 'import json, sys; print("%.3f" % json.load(open(sys.argv[1]))["acceptance_length"], sys.argv[2])' \
      "$W/$name/eval/eval.json" "$name" 2>/dev/null || echo "0 $name"
  done | sort -s -k1,1 -rn)  # stable: unevaluated runs keep the order of RUNS
  say "held-out tau on this machine: $(printf '%s; ' "${ranked[@]}")"
  ranked=("${ranked[@]#* }")
else
  for r in $RUNS; do ranked+=("${r%%:*}"); done
fi
# Heads and records (no checkpoints), the capture's manifest and config, the logs; weights only
# for the KEEP best runs.
heads=() drop=()
for name in "${ranked[@]}"; do
  [ -d "$W/$name" ] || continue
  [ "${#heads[@]}" -lt "$KEEP" ] || drop+=(--exclude="$name/model.safetensors")
  heads+=("$name")
done
(cd "$W" && tar cf - --exclude=checkpoints --exclude='*.hydra' --exclude='*.hydra-eval' "${drop[@]}" "${heads[@]}" \
   ./*.log capture/config.yaml capture/manifest.json 2>/dev/null) | split -b 15M - "$OUT/heads.tar."
say "packed: $(ls "$OUT" | tr '\n' ' ')"
