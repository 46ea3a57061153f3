"""Count what one EAGLE-3 training micro-step asks of the device: ATen ops (each a kernel launch
on a GPU) and the ops that make the host wait for the device (nonzero, boolean indexing,
.item()). On a lent H100 segment 12's trainings ran at ~0.33 s a step of 8 conversations, three
side by side, far above what the GPU's arithmetic needs: this says how much of a step is
launches and host syncs, on any machine (the counts do not depend on the device).

    .venv/bin/python scripts/probe_train_syncs.py [--batch 8] [--tokens 450] [--steps 7]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_infer.default_model import resolve_model_path  # noqa: E402
from eagle_infer.heads import load_head  # noqa: E402
from eagle_infer.loader import load_model  # noqa: E402
from eagle_train.losses import draft_loss  # noqa: E402

SYNCING = {"nonzero", "_local_scalar_dense", "masked_select", "unique", "repeat_interleave"}


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.syncing: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.total += 1
        by_mask = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                          for i in (args[1] if len(args) > 1 else []))
        if name in SYNCING or by_mask:
            self.syncing["index (boolean)" if by_mask else name] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="heads/SmolLM2-135M-Instruct-eagle3")
    ap.add_argument("--batch", type=int, default=8, help="conversations a micro-step")
    ap.add_argument("--tokens", type=int, default=450, help="tokens a conversation")
    ap.add_argument("--answer", type=float, default=2 / 3, help="share of them in the answer")
    ap.add_argument("--steps", type=int, default=7, help="training-time-test steps")
    a = ap.parse_args()
    model = load_model(resolve_model_path(None), "fp32")
    head = load_head(a.head, model.config, model.embed_tokens, model.lm_head.weight).train()
    for p in head.parameters():
        p.requires_grad_(p.is_floating_point())
    B, T, H = a.batch, a.tokens, model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask[:, T - int(a.answer * T):] = True
    batch = {"input_ids": torch.randint(0, model.config.vocab_size, (B, T), generator=g),
             "loss_mask": loss_mask, "attention_mask": torch.ones(B, T, dtype=torch.bool),
             "hidden": torch.randn(B, T, H, generator=g),
             "aux": torch.randn(B, T, len(head.config.aux_layer_ids or [0, 0, 0]) * H, generator=g)}
    with CountOps() as fwd:
        out = draft_loss(head, batch, model.lm_head.weight, steps=a.steps)
    with CountOps() as bwd:
        out.loss.backward()
    syncs = fwd.syncing + bwd.syncing
    print(f"one micro-step, {B} x {T} tokens, {a.steps} TTT steps: {fwd.total} ATen ops forward, "
          f"{bwd.total} backward; {sum(syncs.values())} wait for the device ({dict(syncs)})")


if __name__ == "__main__":
    main()
