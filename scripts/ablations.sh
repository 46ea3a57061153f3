#!/usr/bin/env bash
# Issue #14, item 1: recipe ablations at equal tokens. Every run trains an EAGLE-3 head from
# scratch on the largest data-scaling point (teacher-forced chunks 1-4 of scripts/data_scaling.sh:
# 162 conversations, 92k tokens, 2 epochs) and is evaluated on the same greedy held-out split, so
# each differs from the baseline (that script's eagle3-tf4: lr 1e-3, 4 conversations a step,
# random readout, the reference 8,192-token draft vocabulary) in one setting only. Resumable;
# a finished run is skipped. Needs the captures of scripts/data_scaling.sh (W).
#
#   bash scripts/ablations.sh [NAME ...]    # default: all; names below
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
W=${W:-runs/i14/scale}
A=${A:-runs/i14/abl}
T=SmolLM2-135M-Instruct
declare -A RUNS=(
  [readout-frozen]="draft.readout_from_target=true draft.freeze_lm_head=true"
  [readout-trained]="draft.readout_from_target=true"
  [batch2]="train.batch_size=2"
  [batch1]="train.batch_size=1"
  [accum2]="train.grad_accum=2"
  [lr3e-4]="train.lr=3e-4"
  [vocab16k]="draft.draft_vocab_size=16384 tokenmap_dir=$A/tokenmaps"
  # against batch1 (the default since those runs): fc's aux inputs at RMS 1
  [batch1-fcscale-channel]="train.batch_size=1 draft.fc_input_scale=channel"
  [batch1-fcscale-layer]="train.batch_size=1 draft.fc_input_scale=layer"
  [batch1-seed1]="train.batch_size=1 seed=1"  # a second draw of the two, for the noise
  [batch1-fcscale-channel-seed1]="train.batch_size=1 draft.fc_input_scale=channel seed=1"
)
NAMES=("${@:-readout-frozen batch1 batch2 accum2 lr3e-4 vocab16k readout-trained batch1-fcscale-channel
  batch1-fcscale-layer batch1-seed1 batch1-fcscale-channel-seed1}")

# The 16k draft vocabulary: the reference FR-Spec ranking (tokenmaps/, mined from the reference
# on-policy capture like the 8k one), its first 16,384 ids.
V16=$A/tokenmaps/$T/d2t_t2d_16384.safetensors
if [ ! -f "$V16" ]; then
  mkdir -p "$(dirname "$V16")"
  "$PY" - "$V16" <<'EOF'
import sys
import torch
from safetensors.torch import save_file
from eagle_train.tokenmap import load_token_map
ids = torch.sort(load_token_map("tokenmaps/SmolLM2-135M-Instruct/frspec_16384.pt", 49152)).values
t2d = torch.zeros(49152, dtype=torch.bool)
t2d[ids] = True
save_file({"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}, sys.argv[1])
EOF
fi

extra="$W/tf-2,$W/tf-3,$W/tf-4"
for name in ${NAMES[*]}; do
  # shellcheck disable=SC2086  # the settings are separate overrides
  "$PY" -m eagle_train preset=reference workdir="$A" stage=train draft=eagle3 capture_dir="$W/tf-1" \
    "train.extra_captures=[$extra]" train.max_steps=null train.epochs=2 head_dir="$A/$name" ${RUNS[$name]}
  # shellcheck disable=SC2086
  "$PY" -m eagle_train preset=reference workdir="$A" stage=eval draft=eagle3 capture_dir="$W/capture-t07" \
    eval.head="$A/$name" head_dir="$A/$name" eval_dir="$A/eval-$name" ${RUNS[$name]}
done
