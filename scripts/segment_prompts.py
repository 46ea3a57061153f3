"""Write a grow segment's prompts as a small JSONL, for a capture on a machine without the
ShareGPT package (a lent GPU: scripts/gpu_grow.sh).

Takes the training split exactly as `stage=capture` computes it (preset=reference: data.heldout
40, seed 0), passes over `--offset` conversations, keeps each one's first `--max-turns` user
turns with what precedes them (the capture regenerates those answers; capture.max_turns must
match; the dataset's answers are replaced by "."), and leaves out conversations whose first
prompt the capture would skip (>= data.max_length tokens). Each record keeps its training-split
index as "id", so the segment's range stays on record.

    .venv/bin/python scripts/segment_prompts.py --offset 6960 --out seg7.jsonl.xz
    .venv/bin/python scripts/segment_prompts.py --offset 0 --max-turns 4 --out turns.jsonl.xz
    .venv/bin/python scripts/segment_prompts.py --offset 0 --max-turns 3 --min-turns 2 --out later.jsonl.xz
    .venv/bin/python scripts/segment_prompts.py --offset 0 --min-length 640 --max-length 1024 \
        --out long.jsonl.xz
"""
from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_infer.default_model import resolve_model_path  # noqa: E402
from eagle_infer.loader import load_tokenizer  # noqa: E402
from eagle_train.capture import Skip, plan_conversation  # noqa: E402
from eagle_train.data import load_conversations, render_prompt, split_heldout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="sharegpt", help="data.source: a builtin name or a JSON/JSONL path")
    ap.add_argument("--offset", type=int, required=True, help="first training conversation")
    ap.add_argument("--limit", type=int, default=None, help="conversations after the offset (default: all)")
    ap.add_argument("--heldout", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=640)
    ap.add_argument("--min-length", type=int, default=0,
                    help="leave out first prompts shorter (640: those the reference preset skipped)")
    ap.add_argument("--max-turns", type=int, default=1, help="answers a conversation (capture.max_turns)")
    ap.add_argument("--min-turns", type=int, default=1,
                    help="leave out conversations with fewer answers (first turns captured before)")
    ap.add_argument("--out", type=Path, required=True, help=".jsonl or .jsonl.xz")
    a = ap.parse_args()

    convs = load_conversations(a.source)
    train_idx, _ = split_heldout(list(range(len(convs))), a.heldout, a.seed)
    stop = len(train_idx) if a.limit is None else min(len(train_idx), a.offset + a.limit)
    tok = load_tokenizer(resolve_model_path(None))
    kept, too_long, too_short, skipped, few = [], 0, 0, 0, 0
    for k in range(a.offset, stop):
        try:
            job = plan_conversation(k, convs[train_idx[k]], regenerate=True, max_turns=a.max_turns)
        except Skip:
            skipped += 1
            continue
        msgs = job.messages
        if len(job.slots) < a.min_turns:
            few += 1
            continue
        n = len(render_prompt(tok, msgs[: job.slots[0]]))
        if n >= a.max_length:
            too_long += 1
            continue
        if n < a.min_length:
            too_short += 1
            continue
        for i in job.slots:
            msgs[i] = {"role": "assistant", "content": "."}
        kept.append({"id": k, "messages": msgs})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept).encode()
    a.out.write_bytes(lzma.compress(text) if a.out.suffix == ".xz" else text)
    print(f"training conversations {a.offset}-{stop - 1}: {len(kept)} prompts written to {a.out} "
          f"({a.out.stat().st_size / 1e6:.1f} MB); {too_long} prompts >= {a.max_length} tokens, "
          f"{too_short} < {a.min_length}, and "
          f"{skipped} without a user turn left out; {few} with fewer than {a.min_turns} answers")


if __name__ == "__main__":
    main()
