"""Biased Linears (Qwen2's q/k/v) on our kernel against torch's addmm, eager decoding alternated in
one process (the VM's drift weighs on both): a target's q/k/v switched between Bf16Linear / Avx2Linear
and nn.Linear on the same weights, tokens/s of greedy decoding per round.

    .venv/bin/python scripts/shape_model.py qwen2.5-0.5b --out /tmp/shapes/qwen2.5-0.5b
    .venv/bin/python scripts/probe_biased_linears.py --model-path /tmp/shapes/qwen2.5-0.5b \\
        --json results/probe_biased_linears_qwen2.5_0.5b_shape_bf16_amd_zen4.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from eagle_infer import cpu_linears
from eagle_infer.generate import generate
from eagle_infer.loader import load_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    backend = "avx2" if args.dtype == "fp32" else "avx512_bf16"
    model = load_model(args.model_path, args.dtype, "cpu", cpu_linears=backend)
    biased = [m for m in model.modules() if isinstance(m, cpu_linears.KernelLinear) and m.bias is not None]
    if not biased:
        raise SystemExit("error: the target has no biased Linears on our kernel")
    ours_cls = type(biased[0])
    prompt = [list(range(100, 160))]

    def run(ours: bool) -> float:
        for m in biased:
            m.__class__ = ours_cls if ours else nn.Linear
        t = time.perf_counter()
        generate(model, prompt, args.tokens)
        return args.tokens / (time.perf_counter() - t)

    run(True), run(False)  # warm-up
    res: dict[str, list[float]] = {"ours": [], "torch": []}
    for i in range(args.rounds):
        for ours in ((True, False) if i % 2 == 0 else (False, True)):
            res["ours" if ours else "torch"].append(round(run(ours), 2))
    out = {"model_path": args.model_path, "dtype": args.dtype, "biased_linears": len(biased), "eager": True,
           "tokens_per_s": res, "median": {k: statistics.median(v) for k, v in res.items()}}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
