"""Offline acceptance of a draft head on the held-out capture (stage=eval).

For every start position t of a held-out sample whose next prediction is an assistant token,
the head is unrolled ``eval.unroll`` positions on its own outputs exactly as chain drafting
does (eagle_train.losses.unroll, no noise), and each draft argmax (mapped to target ids) is
compared with the target's argmax at the same position. Reported in ``eval_dir/eval.json``:

    top1_per_position[k]         P(match at k), over the starts where position k is counted
    accept_rate_per_position[k]  P(match at k | matched 0..k-1): greedy chain acceptance
    acceptance_length            1 + mean number of leading matches (the bonus token counted:
                                 tau as serving reports it, for a chain of eval.unroll drafts)

A chain stops at the end of the answer (the next token not an assistant token), as a draft
does. On greedy held-out answers (``capture.heldout_temperature=0``, the default) every token fed
to the unrolled head is the target's argmax (up to rare re-tokenization at BPE boundaries), so
the chain is greedy chain drafting; on sampled answers it runs on sampled contexts instead
(``heldout_answers`` in eval.json says which).

``eval.head=PATH`` evaluates any head folder (ours, or an official EAGLE-2 / EAGLE-3
checkpoint for the same target) instead of ``head_dir``; ``acceptance.png`` plots the
per-position rates, with the training curves from ``head_dir/train_log.jsonl`` when present.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from eagle_infer.errors import UserError
from eagle_train.losses import leading_matches
from eagle_train.train import (
    LOG_FILE,
    abspath,
    draw_loss_curves,
    load_target_io,
    loss_records,
    make_collate,
    plot_training,
    read_log,
    save_figure,
    sel,
)

EVAL_FILE = "eval.json"
PLOT_FILE = "acceptance.png"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def heldout_answers(settings: dict) -> str:
    """What the held-out answers are, from the capture manifest's settings."""
    if not settings.get("regenerate", True):
        return "dataset"
    t = settings.get("temperature")
    return "unknown" if t is None else "greedy" if float(t) == 0.0 else f"sampled at T={float(t):g}"


def head_path(cfg: DictConfig) -> Path:
    override = sel(cfg, "eval.head")
    return abspath(override) if override else abspath(cfg.head_dir)


class AcceptanceStats:
    """Running sums over batches of leading_matches outputs."""

    def __init__(self, K: int):
        self.K = K
        self.starts = 0
        self.lead_sum = 0
        self.lead_hist = torch.zeros(K + 1, dtype=torch.long)
        self.valid = torch.zeros(K, dtype=torch.long)  # position k counted
        self.hit = torch.zeros(K, dtype=torch.long)  # counted and matched
        self.reach = torch.zeros(K, dtype=torch.long)  # counted, and 0..k-1 all matched
        self.reach_hit = torch.zeros(K, dtype=torch.long)

    def add(self, match: torch.Tensor, valid: torch.Tensor, lead: torch.Tensor) -> None:
        start = valid[..., 0]
        m, v, ld = match[start].cpu(), valid[start].cpu(), lead[start].cpu()
        self.starts += int(start.sum())
        self.lead_sum += int(ld.sum())
        self.lead_hist += torch.bincount(ld, minlength=self.K + 1)
        self.valid += v.sum(0)
        self.hit += (m & v).sum(0)
        k = torch.arange(self.K)
        reached = v & (ld[:, None] >= k[None, :])  # leading matches cover 0..k-1
        self.reach += reached.sum(0)
        self.reach_hit += (reached & m).sum(0)

    def result(self) -> dict[str, Any]:
        def ratio(a, b):
            return [float(x) / float(y) if y else 0.0 for x, y in zip(a.tolist(), b.tolist())]

        mean_lead = self.lead_sum / self.starts if self.starts else 0.0
        return {
            "acceptance_length": 1.0 + mean_lead,
            "mean_accepted_drafts": mean_lead,
            "accept_rate_per_position": ratio(self.reach_hit, self.reach),
            "top1_per_position": ratio(self.hit, self.valid),
            "leading_matches_histogram": self.lead_hist.tolist(),
            "num_start_positions": self.starts,
            "positions_counted": self.valid.tolist(),
        }


def plot_eval(result: dict, records: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = loss_records(records)
    ncols = 2 if recs else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
    ax = axes[0, 0]
    K = len(result["accept_rate_per_position"])
    xs = list(range(1, K + 1))
    ax.plot(xs, result["accept_rate_per_position"], "o-", label="accept | previous accepted")
    ax.plot(xs, result["top1_per_position"], "s--", label="top-1 (unconditional)")
    ax.set_xlabel("draft position")
    ax.set_ylabel("rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(xs)
    ax.set_title(f"acceptance length {result['acceptance_length']:.2f}")
    ax.legend(fontsize=8)
    if recs:
        draw_loss_curves(axes[0, 1], recs)
        axes[0, 1].set_title("training loss")
    return save_figure(fig, path, title)


def evaluate_head(head, target, dataset, unroll_steps: int, num_samples: int | None, batch_size: int,
                  max_length: int, device: torch.device, online=None) -> dict:
    """Acceptance statistics of `head` on the first num_samples items of `dataset`; `online`
    (an OnlineStates) computes the target states of a capture that stored none."""
    n = len(dataset) if num_samples is None else min(int(num_samples), len(dataset))
    collate = make_collate(max_length, keep_aux=head.eagle3)
    stats = AcceptanceStats(unroll_steps)
    tokens = 0
    w = target.lm_head_weight
    for i in range(0, n, batch_size):
        batch = collate([dataset[j] for j in range(i, min(n, i + batch_size))])
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        if online is not None:
            batch = online.fill(batch)
        tokens += int(batch["attention_mask"].sum())
        match, valid, lead = leading_matches(head, batch, w, unroll_steps)
        stats.add(match, valid, lead)
    out = stats.result()
    out.update({"num_samples": n, "num_tokens": tokens, "unroll": unroll_steps})
    return out


def eval_split(cfg: DictConfig) -> str:
    """The capture split evaluated: heldout, or train (a head's own training data beside the
    held-out split, to tell fitting from generalising)."""
    return str(sel(cfg, "eval.split", "heldout"))


def fingerprint(cfg: DictConfig, hpath: Path) -> dict:
    files = [hpath / "config.json", hpath / "model.safetensors"]
    out = {"head": str(hpath), "head_mtime": [f.stat().st_mtime if f.is_file() else None for f in files],
           "capture": str(abspath(cfg.capture_dir)), "unroll": int(sel(cfg, "eval.unroll", 7)),
           "num_samples": sel(cfg, "eval.num_samples")}
    split = eval_split(cfg)
    return out if split == "heldout" else {**out, "split": split}  # earlier records stay complete


def is_complete(cfg: DictConfig) -> bool:
    path = abspath(cfg.eval_dir) / EVAL_FILE
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return rec.get("fingerprint") == json.loads(json.dumps(fingerprint(cfg, head_path(cfg))))


@torch.no_grad()
def draft_vocab_coverage(ds, t2d: torch.Tensor) -> float:
    """Share of the assistant tokens of a capture split that the draft vocabulary (t2d) holds."""
    t2d = t2d.bool().cpu()
    hit = total = 0
    for ids, mask in ds.iter_token_shards():
        ids, mask = torch.as_tensor(ids).long(), torch.as_tensor(mask).bool()
        toks = ids[mask]
        total += toks.numel()
        hit += int(t2d[toks].sum())
    return hit / total if total else 0.0


def run(cfg: DictConfig) -> dict:
    from eagle_infer.heads import load_head
    from eagle_train.shards import CaptureDataset

    if int(os.environ.get("RANK", "0")) != 0:  # under a multi-process launcher: rank 0 evaluates
        return {}
    t0 = time.perf_counter()
    dev_name = str(sel(cfg, "device", "auto"))
    if dev_name == "auto":
        dev_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={dev_name} but CUDA is not available on this machine")
    hpath = head_path(cfg)
    if not (hpath / "config.json").is_file():
        hint = "" if sel(cfg, "eval.head") else " (run stage=train first, or pass eval.head=PATH)"
        raise UserError(f"no draft head at {hpath}{hint}")
    target = load_target_io(sel(cfg, "model.path", "default"), device)
    head = load_head(hpath, target.config, target.embed_tokens, target.lm_head_weight, dtype=torch.float32)
    capture_dir = abspath(cfg.capture_dir)
    split = eval_split(cfg)
    ds = CaptureDataset(capture_dir, split=split, model=target.config, require_aux=head.eagle3)
    online = None
    if not ds.has_states:  # online mode: any layers the head reads can be computed
        from eagle_train.capture import OnlineStates

        online = OnlineStates.for_capture(ds.manifest, sel(cfg, "model.path", "default"), device,
                                          aux_layers=head.config.aux_hidden_indices if head.eagle3 else [])
    elif head.eagle3:
        have = list(ds.aux_layer_ids)
        if have != head.config.aux_hidden_indices:
            raise UserError(f"head {hpath} reads target hidden states {head.config.aux_hidden_indices} but "
                            f"the capture {capture_dir} holds {have}: capture with "
                            f"capture.aux_layers={head.config.aux_hidden_indices}")
    if len(ds) == 0:
        raise UserError(f"{split} capture {ds.path} holds no samples"
                        + (" (data.heldout=0?)" if split == "heldout" else ""))
    K = int(sel(cfg, "eval.unroll", 7))
    if K < 1:
        raise UserError(f"eval.unroll={K}: must be >= 1")
    result = evaluate_head(head, target, ds, K, sel(cfg, "eval.num_samples"),
                           int(sel(cfg, "eval.batch_size", 4)),
                           int(sel(cfg, "eval.max_length", sel(cfg, "train.max_length", 2048))), device,
                           online)
    if head.eagle3 and head.t2d is not None:
        # Every held-out answer token outside the draft vocabulary is a rejection no training
        # can fix; on greedy held-out answers these are the target's own greedy tokens.
        result[f"draft_vocab_coverage_{split}"] = draft_vocab_coverage(ds, head.t2d)
    result.update({"head": str(hpath), "kind": head.config.kind, "capture": str(ds.path), "split": split,
                   "heldout_answers": heldout_answers(ds.manifest.get("settings") or {}),
                   "model": str(sel(cfg, "model.name", "")), "seconds": round(time.perf_counter() - t0, 2),
                   "fingerprint": fingerprint(cfg, hpath)})
    out_dir = abspath(cfg.eval_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (EVAL_FILE + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out_dir / EVAL_FILE)
    records = read_log(hpath / LOG_FILE)
    plot_eval(result, records, out_dir / PLOT_FILE, f"{result['model']} {result['kind']} ({hpath.name})")
    rates = " ".join(f"{r:.2f}" for r in result["accept_rate_per_position"])
    where = "held-out" if split == "heldout" else f"{split}-split"
    cov = result.get(f"draft_vocab_coverage_{split}")
    if cov is not None:
        log(f"eval: the draft vocabulary ({int(head.t2d.sum()):,} tokens) covers {cov:.2%} of the {where} "
            f"answer tokens")
    log(f"eval: {result['kind']} head {hpath} on {result['num_samples']} {where} samples "
        f"({result['heldout_answers']} answers, {result['num_start_positions']:,} start positions): "
        f"acceptance length "
        f"{result['acceptance_length']:.3f} (chain of {K}); accept rate per position [{rates}]; "
        f"written to {out_dir / EVAL_FILE}")
    return result


__all__ = ["run", "evaluate_head", "AcceptanceStats", "is_complete", "plot_training"]
