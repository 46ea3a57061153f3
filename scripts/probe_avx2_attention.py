"""Attention calls of a decode step (1 query row) and of verifies (4, 16 rows) at a few KV lengths:
torch's SDPA against kernels/avx2_attention, in one process, with the default target's shapes
(9 query heads over 3 kv heads, head size 64; keys and values as views of a cache). Also checks
that both agree.

    python scripts/probe_avx2_attention.py --json results/probe_avx2_attention_fp32_amd_avx2.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from eagle_infer.bench import median_seconds
from eagle_infer.kernels import avx2_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    avx2_attention.load()
    out = {"threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "calls": []}
    print("kv  rows  sdpa us  ours us  speedup  max abs diff")
    for S in args.kv:
        cache = torch.randn(2, 1, 3, 2 * S, 64)
        keys, values = cache.narrow(3, 0, S).unbind(0)
        for T in args.rows:
            q = torch.randn(1, T, 9, 64).transpose(1, 2)
            bias = torch.zeros(1, 1, T, S)
            args_ = (q, keys, values, bias)

            def sdpa_call(q=q, keys=keys, values=values, bias=bias):
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, enable_gqa=True)

            sdpa = 1e6 * median_seconds(sdpa_call, args.reps, warmup=20)
            ours = 1e6 * median_seconds(lambda a=args_: torch.ops.eagle.avx2_attention(*a), args.reps,
                                        warmup=20)
            diff = (torch.ops.eagle.avx2_attention(*args_) - sdpa_call()).abs().max().item()
            out["calls"].append({"kv": S, "rows": T, "sdpa_us": round(sdpa, 1), "ours_us": round(ours, 1),
                                 "max_abs_diff": diff})
            print(f"{S:4d}  {T:4d}  {sdpa:7.1f}  {ours:7.1f}  {sdpa / ours:6.2f}x  {diff:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
