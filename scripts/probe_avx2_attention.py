"""Attention calls of a decode step (1 query row) and of verifies (4, 16 rows) at a few KV lengths:
torch's SDPA against kernels/avx2_attention, in one process, with the default target's shapes
(9 query heads over 3 kv heads, head size 64; `--heads 16 --kv-heads 8 --head-dim 128`: Qwen3's;
keys and values as views of a cache). Also checks that both agree. `--dtype bf16` times the
kernel each way this CPU computes bf16 scores: on its AVX2 loops ("loops", `ours`), on vdpbf16ps
("dot", AVX512-BF16) and on AMX tiles ("amx"): avx2_attention.set_bf16_scores. The ways take
turns, `--rounds` times (medians of the rounds' medians), so that a VM's drift falls on all of
them alike. `--cold`: as a decode step meets them, each call on the next of 30 layers' caches,
with 64 MB read before each step (a step's Linears stream their weights between two reads of a
layer's cache); else one cache, warm. `--baseline REV` times the kernel as it was at revision REV
beside today's, each way (built under another op namespace), and reports whether their outputs
are the same bits.

    python scripts/probe_avx2_attention.py --json results/probe_avx2_attention_fp32_amd_avx2.json
    python scripts/probe_avx2_attention.py --dtype bf16 --kv 256 1024 --rows 1 4 11 \
        --json results/probe_attention_bf16_dot_amd_zen4.json
    python scripts/probe_avx2_attention.py --dtype bf16 --kv 1200 --rows 1 4 11 --cold
    python scripts/probe_avx2_attention.py --dtype bf16 --kv 256 1024 --rows 1 4 11 --baseline 63a2856
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch
import torch.nn.functional as F

from eagle_infer.bench import median_seconds
from eagle_infer.kernels import avx2_attention, avx2_linear


def load_baseline(rev: str) -> None:
    """The attention kernel's source at `rev` as torch.ops.eagle_old (its kv_write left out: one
    implementation of that op a process)."""
    text = avx2_linear.source_at(rev, avx2_attention.SOURCE)
    text = re.sub(r"TORCH_LIBRARY_IMPL\(eagle_infer, CPU, m\) \{.*?\}", "", text, flags=re.S)
    avx2_linear.build_copy("eagle_attention_baseline", text, "eagle_old")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action="store_true",
                    help="30 layers' caches in turn, 64 MB read before each step")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64, choices=avx2_attention.HEAD_DIMS)
    ap.add_argument("--baseline", metavar="REV", help="also time the kernel's source at this git revision")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    avx2_attention.load()
    if args.baseline:
        load_baseline(args.baseline)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    default = avx2_attention.bf16_scores()
    modes = ["loops"]
    if dtype == torch.bfloat16:
        modes += [m for m in ("dot", "amx") if avx2_attention.set_bf16_scores(m) == m]
    layers = 30 if args.cold else 1
    weights = torch.ones(16 << 20) if args.cold else None  # 64 MB: what a step's Linears read

    def seconds(call) -> float:
        """Median seconds a call: of one warm cache's calls, or (--cold) of the layers' calls."""
        if not args.cold:
            return median_seconds(call, args.reps, warmup=20)
        steps = []
        for _ in range(max(1, args.reps // layers)):
            weights.sum()
            t0 = time.perf_counter()
            for layer in range(layers):
                call(layer)
            steps.append((time.perf_counter() - t0) / layers)
        return statistics.median(steps)

    H, KVH, D = args.heads, args.kv_heads, args.head_dim
    out = {"threads": args.threads, "dtype": args.dtype, "rounds": args.rounds, "cold": args.cold,
           "heads": H, "kv_heads": KVH, "head_dim": D, "baseline": args.baseline,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "calls": []}
    others = "".join(f"  {m} us  vs loops" for m in modes[1:])
    if args.baseline:
        others += "".join(f"  {m} at {args.baseline} us  same bits" for m in modes)
    print("kv  rows  sdpa us  ours us  speedup  max abs diff" + others)
    for S in args.kv:
        cache = torch.randn(layers, 2, 1, KVH, 2 * S, D).to(dtype)  # as the model's: one tensor
        kv = [c.narrow(3, 0, S).unbind(0) for c in cache.unbind(0)]
        for T in args.rows:
            q = torch.randn(1, T, H, D).to(dtype).transpose(1, 2)
            bias = torch.zeros(1, 1, T, S, dtype=dtype)

            def sdpa_call(layer=0, q=q, bias=bias, kv=kv):
                keys, values = kv[layer]
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, enable_gqa=True)

            def ours_call(layer=0, q=q, bias=bias, kv=kv):
                return torch.ops.eagle.avx2_attention(q, *kv[layer], bias)

            def baseline_call(layer=0, q=q, bias=bias, kv=kv):
                return torch.ops.eagle_old.avx2_attention(q, *kv[layer], bias)

            def set_scores(m: str) -> None:
                avx2_attention.set_bf16_scores(m)
                if args.baseline:
                    torch.ops.eagle_old.avx2_attention_set_bf16_scores(m)

            versions = {"": ours_call, **({"@baseline": baseline_call} if args.baseline else {})}
            times: dict[str, list[float]] = {m + v: [] for m in modes for v in versions} | {"sdpa": []}
            for _ in range(args.rounds):
                times["sdpa"].append(seconds(sdpa_call))
                for m in modes:
                    set_scores(m)
                    for v, fn in versions.items():
                        times[m + v].append(seconds(fn))
            us = {m: 1e6 * statistics.median(t) for m, t in times.items()}
            diffs = {}
            for m in modes:
                avx2_attention.set_bf16_scores(m)
                diffs[m] = (ours_call().float() - sdpa_call().float()).abs().max().item()
            sdpa, ours = us["sdpa"], us["loops"]
            call = {"kv": S, "rows": T, "sdpa_us": round(sdpa, 1), "ours_us": round(ours, 1),
                    "max_abs_diff": diffs["loops"]}
            line = f"{S:4d}  {T:4d}  {sdpa:7.1f}  {ours:7.1f}  {sdpa / ours:6.2f}x  {diffs['loops']:.1e}"
            for m in modes[1:]:
                call |= {f"{m}_us": round(us[m], 1), f"{m}_max_abs_diff": diffs[m]}
                line += f"  {us[m]:6.1f}  {ours / us[m]:6.2f}x"
            for m in modes if args.baseline else ():
                set_scores(m)
                same = torch.equal(ours_call(), baseline_call())
                call |= {f"{m}_baseline_us": round(us[m + "@baseline"], 1),
                         f"{m}_same_bits_as_baseline": same}
                line += f"  {us[m + '@baseline']:6.1f}  {same}"
            out["calls"].append(call)
            print(line)
    avx2_attention.set_bf16_scores(default)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
