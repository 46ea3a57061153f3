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

`--mix FILE` spreads another prompt file's records (the target's own prompts,
scripts/magpie_prompts.py; from its record `--mix-skip` on) evenly among these (`interleave`), so
that a capture cut short by its time limit holds both kinds in proportion: replayed ShareGPT
prompts beside new ones, against what segment 15 measured (new prompts alone: tau on their kind
up, on ShareGPT's held-out split down).

    .venv/bin/python scripts/segment_prompts.py --offset 11171 --limit 4500 \
        --mix data/magpie/smollm2-135m-seed0.jsonl.xz --mix-skip 4096 --out mixed.jsonl.xz
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
from eagle_train.data import _open_text, load_conversations, render_prompt, split_heldout  # noqa: E402


def interleave(first: list, second: list) -> list:
    """Both lists in one, each spread evenly over it in its own order: item i of a list of n
    sits at (i + 1/2) / n of the way (ties: `first`'s item first)."""
    keyed = [((i + 0.5) / len(xs), j, i) for j, xs in enumerate((first, second)) for i in range(len(xs))]
    return [(first, second)[j][i] for _, j, i in sorted(keyed)]


def read_jsonl(path: Path) -> list[dict]:
    """The records of a .jsonl or .jsonl.xz file (blank lines skipped), as they are: the capture
    reads their ids and sources too (load_conversations would keep only the turns)."""
    with _open_text(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
    ap.add_argument("--mix", type=Path, default=None,
                    help="a .jsonl(.xz) of other prompts to spread evenly among these (interleave)")
    ap.add_argument("--mix-skip", type=int, default=0, help="records of --mix to leave out first")
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
    mixed = read_jsonl(a.mix)[a.mix_skip:] if a.mix else []
    if mixed:
        kept = interleave(kept, mixed)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept).encode()
    a.out.write_bytes(lzma.compress(text) if a.out.suffix == ".xz" else text)
    print(f"training conversations {a.offset}-{stop - 1}: {len(kept)} prompts written to {a.out} "
          f"({a.out.stat().st_size / 1e6:.1f} MB); {too_long} prompts >= {a.max_length} tokens, "
          f"{too_short} < {a.min_length}, and "
          f"{skipped} without a user turn left out; {few} with fewer than {a.min_turns} answers"
          + (f"; {len(mixed)} of them from {a.mix} (from its record {a.mix_skip} on), spread among the rest"
             if mixed else ""))


if __name__ == "__main__":
    main()
