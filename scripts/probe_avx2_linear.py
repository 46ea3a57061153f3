"""The default target's Linear shapes at M rows (a plain step is 1 row, a verify of the CPU
default tree 4): Inductor's C++ GEMM template on frozen weights (cpu_linears="inductor") against
our AVX2 kernel (cpu_linears="avx2", eagle_infer/kernels/avx2_linear.cpp), in one process.
Each shape runs over `--copies` distinct weights, more than the last-level cache holds, so the
weights stream from memory as in a decode step; the read rate is reported beside the time.
Also checks that both give the same numbers (the kernel keeps the template's FMA order).

    python scripts/probe_avx2_linear.py --rows 1 4 --json results/probe_avx2_linear.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from eagle_infer.bench import median_seconds
from eagle_infer.cpu_linears import FROZEN_GEMM, FrozenCompile, cached_kernel_templates, without_mkl_prepack
from eagle_infer.kernels import avx2_linear

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
          "down_proj": (576, 1536), "lm_head": (49152, 576)}


class Copies(nn.Module):
    """`n` Linears of one shape, each called on the same input (a compiled graph of n GEMMs)."""

    def __init__(self, n: int, out_features: int, in_features: int):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(in_features, out_features, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [lin(x) for lin in self.linears]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--copies", type=int, default=12, help="weights a shape (lm_head: 2)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    out = {"threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        copies = 2 if name == "lm_head" else args.copies
        mod = Copies(copies, n, k).eval()
        # the weights' tag: torch's FX graph cache keeps frozen weights by value, keyed by graph
        # and shapes, and would hand this module another one's (cpu_linears.FrozenCompile)
        tag = FrozenCompile(FROZEN_GEMM, (mod,)).cache_tag
        packed = [avx2_linear.pack(lin.weight) for lin in mod.linears]
        mb = copies * n * k * 4 / 1e6
        for m in args.rows:
            x = torch.randn(m, k)
            torch._dynamo.reset()
            template = torch.compile(mod, fullgraph=True, dynamic=False)
            with (torch.no_grad(), inductor_config.patch(FROZEN_GEMM), without_mkl_prepack(),
                  cached_kernel_templates(), torch.compiler.config.patch(cache_key_tag=tag)):
                want = template(x)
                t_template = 1e3 * median_seconds(lambda: template(x), args.reps)  # noqa: B023
            ours = lambda: [avx2_linear.avx2_linear(x, w, n) for w in packed]  # noqa: B023, E731
            same = all(torch.equal(a, b) for a, b in zip(ours(), want))
            t_ours = 1e3 * median_seconds(ours, args.reps)
            row = {"template_ms": round(t_template, 3), "avx2_ms": round(t_ours, 3),
                   "template_gb_s": round(mb / t_template, 1), "avx2_gb_s": round(mb / t_ours, 1),
                   "bitwise_equal": same, "weights_mb": round(mb, 1)}
            out["shapes"].setdefault(name, {})[m] = row
            print(f"{name:13s} {n:5d}x{k:<5d} M={m}: template {t_template:6.2f} ms "
                  f"({row['template_gb_s']:5.1f} GB/s)  avx2 {t_ours:6.2f} ms ({row['avx2_gb_s']:5.1f} GB/s)"
                  f"  equal {same}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
