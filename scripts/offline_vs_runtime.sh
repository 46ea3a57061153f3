#!/usr/bin/env bash
# Does stage=eval's offline chain tau predict the runtime's? Both on the same text: the first N
# MT-bench prompts (the bench's), answered greedily by the target (held-out split, 128 new
# tokens, stop at EOS), then greedy chain drafting (7 steps) in the runtime on those prompts.
# Writes results/offline_vs_runtime_<head>.json (bench) beside the eval's eval.json.
#   bash scripts/offline_vs_runtime.sh [N]      # N = 10 for the numbers in docs/training.md
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-10}"
W=runs/offline_vs_runtime
mkdir -p "$W" results
# MT-bench first turns as ShareGPT records; the assistant turn is only a slot to regenerate.
python - "$W/mtbench.jsonl" <<'EOF'
import json, sys
from eagle_infer.bench import default_prompts_path
with open(sys.argv[1], "w") as out:
    for line in default_prompts_path().read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            out.write(json.dumps({"id": q["question_id"], "conversations": [
                {"from": "human", "value": q["turns"][0]}, {"from": "gpt", "value": "(regenerated)"}]}) + "\n")
EOF
# All but one record held out (the split keeps file order), so held-out sample i is prompt i.
python -m eagle_train stage=capture preset=reference "data.source=$W/mtbench.jsonl" data.name=mtbench \
  data.heldout=79 data.max_length=null capture.limit=0 capture.max_new_tokens_per_turn=128 \
  eval.num_samples="$N" "capture_dir=$W/capture-$N"
for d in eagle3 eagle2; do
  python -m eagle_train stage=eval preset=reference draft=$d "capture_dir=$W/capture-$N" \
    eval.head=heads/SmolLM2-135M-Instruct-$d "eval_dir=$W/eval-$d-$N"
  OMP_NUM_THREADS=1 python -m eagle_infer.bench --num-prompts "$N" --max-new-tokens 128 --stop-at-eos \
    --no-hf --draft heads/SmolLM2-135M-Instruct-$d --num-steps 7 --eagle-topk 1 --num-draft-tokens 8 \
    --json "results/offline_vs_runtime_$d.json"
  python -c "import json,sys; e=json.load(open('$W/eval-$d-$N/eval.json')); b=json.load(open('results/offline_vs_runtime_$d.json'));
print(f'$d: offline chain tau {e[\"acceptance_length\"]:.3f} ({e[\"heldout_answers\"]} answers), runtime chain tau {b[\"acceptance_length\"]:.3f}')"
done
