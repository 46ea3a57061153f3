"""Count the ATen ops (each a kernel launch on a GPU, views aside) of one decode step of a
capture's answer generation (`eagle_infer.generate.generate`, eager), greedy and sampled. On a
lent H100 segment 13's capture ran ~30 ms a step at batch 256, far above the step's arithmetic
and memory traffic: a count that does not grow with the batch says the step is dispatch and
launches, which CUDA graphs remove (capture.compile=auto; scripts/cuda_check.sh STEPS=capture).

    .venv/bin/python scripts/probe_capture_ops.py [--batch 4 16] [--temperature 0.7]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_infer.default_model import resolve_model_path  # noqa: E402
from eagle_infer.generate import generate  # noqa: E402
from eagle_infer.loader import load_model  # noqa: E402
from eagle_infer.sampling import SamplingParams  # noqa: E402
from scripts.probe_train_syncs import CountOps  # noqa: E402


def ops_per_step(model, batch: int, temperature: float) -> float:
    """ATen ops a decode step: the difference of 7 and 3 new tokens, over 4 (the step's one host
    read, the tokens' .tolist(), is not an ATen op)."""
    params = [SamplingParams(temperature, seed=i) for i in range(batch)]
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(batch)]
    counts = []
    for n in (3, 7):
        with CountOps() as ops, torch.no_grad():
            generate(model, prompts, n, params, eos_token_ids=[])
        counts.append(ops.total)
    return (counts[1] - counts[0]) / 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--temperature", type=float, default=0.7, help="the sampled rows' temperature")
    a = ap.parse_args()
    model = load_model(resolve_model_path(None), "fp32")
    for b in a.batch:
        for t in (0.0, a.temperature):
            print(f"batch {b}, temperature {t}: {ops_per_step(model, b, t):.0f} ATen ops a decode step")


if __name__ == "__main__":
    main()
