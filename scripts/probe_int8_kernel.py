"""torch's weight-only int8 kernel (aten._weight_int8pack_mm) against an fp32 GEMM, at the
target's Linear shapes and a few row counts, with fp32 and with bf16 activations (median ms).

    python scripts/probe_int8_kernel.py --threads 2 --rows 1 4 16 512
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # SmolLM2-135M, [out, in]


def median_ms(f, *args, reps: int = 30) -> float:
    f(*args)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(*args)
        ts.append(time.perf_counter() - t0)
    return 1e3 * sorted(ts)[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| rows | out x in | fp32 F.linear | int8, fp32 activations | int8, bf16 activations |")
    print("|---|---|---|---|---|")
    for m in args.rows:
        for n, k in SHAPES:
            w = torch.randn(n, k)
            scale = w.abs().amax(1) / 127
            q = torch.round(w / scale[:, None]).to(torch.int8)
            x = torch.randn(m, k)
            xb, sb = x.bfloat16(), scale.bfloat16()
            int8_mm = torch.ops.aten._weight_int8pack_mm
            fp32 = median_ms(F.linear, x, w)
            i8_fp32 = median_ms(int8_mm, x, q, scale)
            i8_bf16 = median_ms(int8_mm, xb, q, sb)
            print(f"| {m} | {n}x{k} | {fp32:.3f} | {i8_fp32:.3f} | {i8_bf16:.3f} |", flush=True)


if __name__ == "__main__":
    main()
