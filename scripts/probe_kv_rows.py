"""What moving cache rows costs: a sequence that leaves a batch gives its row to the last one
(RowTable.remove: `KVCache.copy_prefix` of the used slots without the prefix cache, `swap_rows`
with it). Times each (the median of --reps calls) on a cache shaped like a target's (the
default target's by default, bf16), for a few used lengths, beside the ways they replaced: a
whole row's copy and an index_put of both rows at once.

    python scripts/probe_kv_rows.py --slots 300 1000 2048 --json results/x.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eagle_infer.bench import machine_info, median_seconds
from eagle_infer.default_model import resolve_model_path
from eagle_infer.model import KVCache, ModelConfig


def ms(fn, reps: int) -> float:
    return median_seconds(fn, reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--slots", type=int, nargs="+", default=[300, 1000, 2048])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(json.loads((resolve_model_path(args.model_path) / "config.json").read_text()))
    cache = KVCache(cfg.num_layers, args.batch, cfg.num_kv_heads, args.max_seq_len, cfg.head_dim,
                    torch.bfloat16, "cpu")
    cache.kv.normal_()
    a, b = args.batch - 1, 0

    def whole_row() -> None:
        cache.kv[:, :, b].copy_(cache.kv[:, :, a])

    def index_put_swap(n: int) -> None:
        head = cache.kv.narrow(4, 0, n)
        head[:, :, [a, b]] = head[:, :, [b, a]]

    rows = []
    for n in args.slots:
        rows.append({"slots": n, "copy_prefix_ms": ms(lambda n=n: cache.copy_prefix(a, b, n), args.reps),
                     "whole_row_copy_ms": ms(whole_row, args.reps),
                     "swap_rows_ms": ms(lambda n=n: cache.swap_rows(a, b, n), args.reps),
                     "index_put_swap_ms": ms(lambda n=n: index_put_swap(n), args.reps)})
        print({k: round(v, 3) for k, v in rows[-1].items()})
    if args.json:
        out = {"machine": machine_info("bf16", "cpu"), "args": vars(args) | {"json": str(args.json)},
               "row_mb": cache.kv[:, :, 0].numel() * 2 / 2**20, "rows": rows}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
