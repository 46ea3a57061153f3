"""Attention calls of a decode step (1 query row) and of verifies (4, 16 rows) at a few KV lengths:
torch's SDPA against kernels/avx2_attention, in one process, with the default target's shapes
(9 query heads over 3 kv heads, head size 64; keys and values as views of a cache). Also checks
that both agree. `--dtype bf16` on a CPU with AMX times the kernel both ways: on its AVX2 loops
("loops") and with its scores on AMX tiles ("amx", the default there: avx2_attention.set_amx).

    python scripts/probe_avx2_attention.py --json results/probe_avx2_attention_fp32_amd_avx2.json
    python scripts/probe_avx2_attention.py --dtype bf16 --kv 128 512 1024 2048 --rows 1 6 16 40 \
        --json results/probe_attention_bf16_amx_xeon.json
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
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    avx2_attention.load()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    amx_default = avx2_attention.amx_on()
    amx = dtype == torch.bfloat16 and avx2_attention.set_amx(True)
    out = {"threads": args.threads, "dtype": args.dtype,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "calls": []}
    print("kv  rows  sdpa us  ours us  speedup  max abs diff" + ("  amx us  amx vs loops" if amx else ""))
    for S in args.kv:
        cache = torch.randn(2, 1, 3, 2 * S, 64).to(dtype)
        keys, values = cache.narrow(3, 0, S).unbind(0)
        for T in args.rows:
            q = torch.randn(1, T, 9, 64).to(dtype).transpose(1, 2)
            bias = torch.zeros(1, 1, T, S, dtype=dtype)
            args_ = (q, keys, values, bias)

            def sdpa_call(q=q, keys=keys, values=values, bias=bias):
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, enable_gqa=True)

            def ours_call(a=args_):
                return torch.ops.eagle.avx2_attention(*a)

            sdpa = 1e6 * median_seconds(sdpa_call, args.reps, warmup=20)
            avx2_attention.set_amx(False)  # "ours": the AVX2 loops
            ours = 1e6 * median_seconds(ours_call, args.reps, warmup=20)
            diff = (ours_call().float() - sdpa_call().float()).abs().max().item()
            call = {"kv": S, "rows": T, "sdpa_us": round(sdpa, 1), "ours_us": round(ours, 1),
                    "max_abs_diff": diff}
            line = f"{S:4d}  {T:4d}  {sdpa:7.1f}  {ours:7.1f}  {sdpa / ours:6.2f}x  {diff:.1e}"
            if amx:
                avx2_attention.set_amx(True)
                on_tiles = 1e6 * median_seconds(ours_call, args.reps, warmup=20)
                call |= {"amx_us": round(on_tiles, 1),
                         "amx_max_abs_diff": (ours_call().float() - sdpa_call().float()).abs().max().item()}
                line += f"  {on_tiles:6.1f}  {ours / on_tiles:6.2f}x"
            out["calls"].append(call)
            print(line)
    avx2_attention.set_amx(amx_default)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
