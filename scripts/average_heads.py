"""Interpolate two heads of one architecture and draft vocabulary (weight-space ensembling,
WiSE-FT: Wortsman et al. 2022): out = (1 - alpha) * A + alpha * B for every float tensor;
integer and bool tensors (the draft vocabulary's maps) must be equal and are copied.

A warm-started head fine-tuned on a new kind of data (segment 8: later turns, longer answers)
gained there and lost on the old kind; a point between it and the head it started from can keep
both. The output folder holds config.json (equal in both) and the averaged weights: a head that
loads wherever A does; its records (eval, training logs) are for the caller to write.

    .venv/bin/python scripts/average_heads.py heads/SmolLM2-135M-Instruct-eagle3 runs/gpu8/b/f3hi \\
        --alpha 0.5 --out runs/gpu8/soup3
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def average(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    if set(a) != set(b):
        raise ValueError(f"the heads have different tensors: {sorted(set(a) ^ set(b))}")
    out = {}
    for k, x in a.items():
        y = b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(f"{k}: {x.dtype}{tuple(x.shape)} against {y.dtype}{tuple(y.shape)}")
        if x.is_floating_point():
            out[k] = torch.lerp(x.float(), y.float(), alpha).to(x.dtype)
        elif torch.equal(x, y):
            out[k] = x
        else:
            raise ValueError(f"{k} ({x.dtype}) differs: heads of different draft vocabularies do not average")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="head folder (alpha 0)")
    ap.add_argument("b", type=Path, help="head folder (alpha 1)")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (args.a, args.b))
    if ca != cb:
        diff = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
        raise SystemExit(f"the heads' configs differ in {diff}")
    a, b = (load_file(d / "model.safetensors") for d in (args.a, args.b))
    weights = average(a, b, args.alpha)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(args.a / "config.json", args.out / "config.json")
    save_file(weights, args.out / "model.safetensors", metadata={"format": "pt"})
    (args.out / "averaged_from.json").write_text(json.dumps(
        {"a": str(args.a), "b": str(args.b), "alpha": args.alpha}, indent=1) + "\n")
    print(f"{args.out}: (1 - {args.alpha}) * {args.a} + {args.alpha} * {args.b}")


if __name__ == "__main__":
    main()
