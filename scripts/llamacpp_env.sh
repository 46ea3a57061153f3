#!/usr/bin/env bash
# Make (once) a virtual environment with llama.cpp (llama-cpp-python), the plain-decoding
# reference on CPUs: it loads the embedded target's own Q4_1 GGUF. The registry has only its
# source, so pip builds llama.cpp here (about 7-10 minutes on 2 cores; cmake and a C++ compiler).
# Prints the environment's python on the last line. Idempotent: a complete environment is reused.
#   LLAMACPP_ENV  where to put it (default $EAGLE_CACHE/llama-cpp-python-0.3.36, EAGLE_CACHE=~/.cache/eagle)
#   PYTHON        the interpreter to build it from (default python3)
set -euo pipefail
VERSION=0.3.36
source "$(dirname "${BASH_SOURCE[0]}")/peer_env.sh"

# native: llama.cpp's kernels for this CPU (AVX-512 / AVX512-BF16 where it has them). Not its AMX
# matmul, which -march=native compiles in on CPUs with AMX tiles: on the AMX Xeon VM we measured it
# died with SIGILL (TILEZERO on an unconfigured tile: ggml loads a thread's tile config once, for
# ever) at the first prompt of more than one token. Explicit -mno-amx-* outrank -march=native in GCC;
# CMake takes CFLAGS / CXXFLAGS as its initial flags.
NO_AMX=""
SUFFIX=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  SUFFIX="-noamx"
fi

install_llamacpp() {  # $1: the environment's python
  local flags=(CMAKE_ARGS="-DGGML_NATIVE=ON")
  if [ -n "$NO_AMX" ]; then
    flags+=(CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX")
  fi
  env "${flags[@]}" "$1" -m pip install -qq --disable-pip-version-check --no-cache-dir \
    "llama-cpp-python==$VERSION"
}

peer_env "${LLAMACPP_ENV:-${EAGLE_CACHE:-$HOME/.cache/eagle}/llama-cpp-python-$VERSION$SUFFIX}" \
  "llama-cpp-python $VERSION" "once; ~7-10 minutes on 2 cores" llama_cpp install_llamacpp
