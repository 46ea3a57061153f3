#!/usr/bin/env bash
# Pack what a lent GPU machine (the `device` tool) needs for scripts/device_prep.sh, into
# ignored folders of this checkout. A call carries at most 64 MiB with the tracked tree
# (~33 MB), so the default target's GGUF (98 MB, xz'd and split in four) travels in four calls:
#   0. carry [.blob0]:        mkdir -p /root/blob /root/whl && cp .blob0/* /root/blob/
#   1. carry [.blob1, .whl]: cp .blob1/* /root/blob/ && cp .whl/* /root/whl/
#   2. carry [.blob2]:        cp .blob2/* /root/blob/
#   3. carry [.blob3]:        OUT=$OUT MODE=check bash scripts/device_prep.sh   (or MODE=grow)
# back to back (a machine goes back after 30 s idle). Three parts left a call ~1 MB under the
# limit once the tree passed 31 MB. .whl: the server's packages the device
# image lacks (cp312 wheels); pylib.tgz: hydra-core, omegaconf and antlr4 (pure Python, copied
# from .venv: antlr4 4.9.3 has no wheel); hf_small: the converted target's config and tokenizer
# files (the device's transformers would otherwise write its own); question.jsonl: MT-bench;
# heldout: the reference held-out split, token ids only (gpu_grow.sh ranks its heads on it);
# SEGMENT_OFFSET=N adds prompts for scripts/gpu_grow.sh from training conversation N on
# (SEGMENT_TURNS=K: their first K answers; the capture then wants capture.max_turns=K);
# SEGMENT_REPLAY=OFFSET:LIMIT appends the prompts of conversations already trained on (replay),
# after the new ones, so that a capture cut short by its time limit has the new ones first.
# SEGMENT_FILE=PATH (.jsonl or .jsonl.xz) appends prompts written elsewhere, e.g. the target's own
# (scripts/magpie_prompts.py, data/magpie/): alone, they are the whole segment. SEGMENT_MIX=PATH
# (with SEGMENT_MIX_SKIP=N: from its record N on) spreads such a file's prompts evenly among the
# replayed ones instead (segment_prompts.py --mix), so a capture cut short holds both kinds.
# SEGMENT_INIT=HEAD_DIR carries another starting head (e.g. an unpublished segment's, ~20 MB, in
# two halves beside GGUF parts 0 and 2); device_prep.sh reassembles it as /root/init, for a run's
# override: RUNS="x3:eagle3:1e-4:32:6::train.init_from=/root/init" (segment 16).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
grep -qx '/.blob\*/' .git/info/exclude 2>/dev/null || echo '/.blob*/' >>.git/info/exclude
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
rm -rf .blob0 .blob1 .blob2 .blob3 .whl && mkdir -p .blob0 .blob1 .blob2 .blob3/hf_small .whl

G=$("$PY" -c "from eagle_infer.default_model import find_gguf; print(find_gguf())")
M=$("$PY" -c "from eagle_infer.default_model import ensure_default_model as e; print(e())")
xz -T2 -6 -c "$G" >/tmp/gguf.xz
size=$(stat -c %s /tmp/gguf.xz)
split -b $(((size + 3) / 4)) -d -a 1 /tmp/gguf.xz /tmp/gpart.
for i in 0 1 2 3; do mv /tmp/gpart.$i .blob$i/; done && rm /tmp/gguf.xz
sha256sum "$G" | cut -d' ' -f1 >.blob3/gguf.sha256
cp "$M"/{chat_template.jinja,config.json,generation_config.json,tokenizer.json,tokenizer_config.json} .blob3/hf_small/
cp "$("$PY" -c "from eagle_infer.default_model import MTBENCH_QUESTIONS as q, package_file as p; print(p(*q))")" .blob3/question.jsonl
# The reference held-out split as token ids (the target answers it greedily, as grow_heads.sh's
# held-out split; no states: the device computes them), for gpu_grow.sh to rank its heads there.
H=${HELDOUT_IDS:-runs/grow/heldout-ids}
[ -f "$H/heldout/manifest.json" ] || "$PY" -m eagle_train preset=reference workdir=runs/grow stage=capture \
  capture.limit=0 capture.store_states=false capture_dir="$H" >/dev/null
cp -r "$H" .blob3/heldout

site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
(cd "$site" && tar czf - --exclude=__pycache__ hydra hydra_core-*.dist-info omegaconf omegaconf-*.dist-info \
   antlr4 antlr4_python3_runtime-*.dist-info) >.blob2/pylib.tgz
pins=$("$PY" -m pip freeze 2>/dev/null | grep -i -E '^(annotated[-_]types|dill|fastapi|gguf|pydantic|opentelemetry[-_]api|pydantic[-_]core|sniffio|sse[-_]starlette|starlette|typing[-_]extensions|typing[-_]inspection|uvicorn)==')
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $pins
[ -z "${SEGMENT_OFFSET:-}" ] || "$PY" scripts/segment_prompts.py --offset "$SEGMENT_OFFSET" \
  --max-turns "${SEGMENT_TURNS:-1}" --out .blob2/segment.jsonl.xz
[ -z "${SEGMENT_REPLAY:-}" ] || { "$PY" scripts/segment_prompts.py --offset "${SEGMENT_REPLAY%%:*}" \
  --limit "${SEGMENT_REPLAY#*:}" --max-turns "${SEGMENT_TURNS:-1}" --out /tmp/replay.jsonl.xz \
  ${SEGMENT_MIX:+--mix "$SEGMENT_MIX" --mix-skip "${SEGMENT_MIX_SKIP:-0}"} &&
  cat /tmp/replay.jsonl.xz >>.blob2/segment.jsonl.xz; }  # xz streams concatenate
case ${SEGMENT_FILE:-} in
  "") ;;
  *.xz) cat "$SEGMENT_FILE" >>.blob2/segment.jsonl.xz ;;
  *) xz -c "$SEGMENT_FILE" >>.blob2/segment.jsonl.xz ;;
esac
if [ -n "${SEGMENT_INIT:-}" ]; then
  W=$SEGMENT_INIT/model.safetensors
  split -n 2 -d -a 1 "$W" /tmp/init. && mv /tmp/init.0 .blob0/ && mv /tmp/init.1 .blob2/
  mkdir -p .blob3/init && cp "$SEGMENT_INIT/config.json" .blob3/init/
  sha256sum "$W" | cut -d' ' -f1 >.blob3/init/model.sha256
fi
du -sh .blob0 .blob1 .blob2 .blob3 .whl
