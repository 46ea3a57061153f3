#!/usr/bin/env bash
# Make (once) a virtual environment with llama.cpp (llama-cpp-python), the plain-decoding
# reference on CPUs: it loads the embedded target's own Q4_1 GGUF. The registry has only its
# source, so pip builds llama.cpp here (about 10 minutes on 2 cores; cmake and a C++ compiler).
# Prints the environment's python on the last line. Idempotent: a complete environment is reused.
#   LLAMACPP_ENV  where to put it (default $EAGLE_CACHE/llama-cpp-python-0.3.36, EAGLE_CACHE=~/.cache/eagle)
#   PYTHON        the interpreter to build it from (default python3)
set -euo pipefail
VERSION=0.3.36
ENV_DIR=${LLAMACPP_ENV:-${EAGLE_CACHE:-$HOME/.cache/eagle}/llama-cpp-python-$VERSION}
PY=${PYTHON:-python3}
STAMP="$ENV_DIR/.eagle-complete"

if [ ! -f "$STAMP" ]; then
  echo "llama-cpp-python $VERSION: building $ENV_DIR (once; ~10 minutes on 2 cores)" >&2
  rm -rf "$ENV_DIR"
  "$PY" -m venv "$ENV_DIR"
  # native: llama.cpp's kernels for this CPU (AVX-512 / AVX512-BF16 where it has them)
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$ENV_DIR/bin/python" -m pip install -qq --disable-pip-version-check \
    "llama-cpp-python==$VERSION"
  "$ENV_DIR/bin/python" -c "import llama_cpp" >/dev/null
  touch "$STAMP"
fi
echo "$ENV_DIR/bin/python"
