#!/usr/bin/env bash
# Issue #13, item 3: what a machine with a GPU must show, in one command (~10 min on an H200 with
# the default target, most of it compilation): the CUDA tests (draft, verify and plain decode steps recorded as CUDA
# graphs and replayed, not a silent eager fallback; output equal to eager decoding; the Triton
# tree-accept kernels equal to the torch reference), then the bench on CUDA in bf16, batch 1:
# transformers `generate`, our plain and speculative decoding (the reference EAGLE-3 head, tree
# 5/4/16) from CUDA graphs, the same eagerly, batch 4 from CUDA graphs, and the server at
# concurrency 1 (spec and plain, through the OpenAI API: scripts/bench_server.py). One log and a JSON
# per bench run go to $OUT, the CUDA-graph run's torch.profiler tables and traces to $OUT/profile;
# each step has a time limit, and a failed step does not stop the next.
#
#   OUT=runs/cuda_check bash scripts/cuda_check.sh
#   N=10 TOKENS=256 PROMPTS=prompts.jsonl bash scripts/cuda_check.sh
#   STEPS=capture CAPTURE_PROMPTS=seg.jsonl.xz bash scripts/cuda_check.sh   (not in the default STEPS:
#     CAPTURE_N=768 conversations captured with eager steps, then with CUDA graphs; tok/s of each;
#     CAPTURE_RUNS="false:256 auto:256 false:512" sets the capture.compile:batch pairs, CAPTURE_ARGS
#     adds overrides (capture.max_new_tokens_per_turn=384 data.max_length=1024);
#     DEVICE=cpu runs the step on a CPU, as a dry run)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-runs/cuda_check}
N=${N:-5}             # prompts (MT-bench unless PROMPTS names a .jsonl / .json file)
TOKENS=${TOKENS:-128}  # new tokens a prompt, EOS ignored
PROMPTS=${PROMPTS:-}
STEPS=${STEPS:-tests graphs eager batch4 server}
# Into the log: why a step recompiled, and why Inductor skipped CUDA graphs for one, should it.
export TORCH_LOGS=${TORCH_LOGS:-recompiles,perf_hints}
mkdir -p "$OUT"
LOG=$OUT/cuda_check.log

say() { echo "$*" | tee -a "$LOG"; }
step() {  # name, time limit in s, command...
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  say "== $name: $*"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  say "== $name: exit $rc after $((SECONDS - t0)) s"
}
bench() {  # name, time limit, extra bench flags...
  local name=$1 limit=$2
  shift 2
  step "bench_$name" "$limit" "$PY" -m eagle_infer.bench --device cuda --dtype bf16 --num-prompts "$N" \
    --max-new-tokens "$TOKENS" ${PROMPTS:+--prompts "$PROMPTS"} --json "$OUT/bench_$name.json" "$@"
}

say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
"$PY" -c "import torch, transformers, triton; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
for s in $STEPS; do
  case $s in
    tests) step tests 240 "$PY" -m pytest -q -p no:cacheprovider -m cuda \
             tests/test_static_shapes.py tests/test_tree_accept_kernel.py ;;
    graphs) bench graphs 300 --profile "$OUT/profile" ;;  # transformers, plain and speculative, CUDA graphs
    eager) bench eager 120 --no-hf --no-compile ;; # the same steps, launched one kernel at a time
    batch4) bench batch4 400 --batch-size 4 ;;     # CUDA graphs at the batch bucket of 4
    server) step server 400 "$PY" scripts/bench_server.py --concurrency 1 --num-requests "$N" \
              --max-tokens "$TOKENS" ${PROMPTS:+--prompts "$PROMPTS"} --out "$OUT/bench_server.json" ;;
    chain) bench chain 300 --no-hf --num-steps 3 --eagle-topk 1 --num-draft-tokens 3 ;;
    capture)  # a grow segment's capture rate, eager steps against CUDA graphs (capture.compile)
      src=${CAPTURE_PROMPTS:-/root/blob/segment.jsonl.xz}  # .jsonl or .jsonl.xz
      [ -f "$src" ] || say "capture: no prompts in $src (device_blobs.sh SEGMENT_OFFSET)"
      for r in ${CAPTURE_RUNS:-false:256 auto:256}; do  # capture.compile:batch size
        c=${r%%:*} b=${r#*:}
        step "capture_compile_${c}_b$b" 240 "$PY" -m eagle_train preset=reference workdir="/tmp/capture_${c}_$b" \
          device="${DEVICE:-cuda}" stage=capture data.source="$src" data.heldout=0 capture.limit="${CAPTURE_N:-768}" \
          capture.temperature=0 capture.store_states=false capture.batch_size="$b" capture.shard_size="$b" \
          capture.compile="$c" eval.num_samples=0 train.wandb.mode=disabled ${CAPTURE_ARGS:-}
        say "capture_compile_${c}_b$b: $(grep -a 'generated .* tok/s' "$LOG" | tail -1)"
      done ;;
    *) say "unknown step $s (tests, graphs, eager, batch4, server, chain, capture)" ;;
  esac
done
say "== done in $SECONDS s"
