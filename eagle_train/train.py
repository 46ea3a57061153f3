"""Draft-head training (stage=train): EAGLE-2 or EAGLE-3 on a capture, torchtune-recipe style.

    recipe = TrainRecipe(cfg); recipe.setup(cfg); recipe.train(); recipe.cleanup()
    # or simply run(cfg), which python -m eagle_train stage=train calls

What it reads: the capture (``capture_dir``: tokens, loss mask, the target's final hidden
state and, for EAGLE-3, the aux states), the target's embedding + lm_head + config (nothing
else of the target is loaded) and, for EAGLE-3, the draft vocabulary (d2t / t2d) from the
tokenmap stage. What it writes into ``head_dir``: the head in the official layout
(config.json + model.safetensors, bf16), ``train_summary.json``, ``train_log.jsonl``,
``train_loss.png``, ``checkpoints/step_N`` (resume state) and, with wandb on, ``wandb/``.

Losses (eagle_train/losses.py): EAGLE-2 = SmoothL1 feature regression + soft cross-entropy
through the frozen target lm_head with uniform input noise; EAGLE-3 = training-time test over
``draft.ttt_steps`` unrolled steps weighted ``ttt_decay^s``.

Multi-process: ``accelerate launch`` drives it. On a CPU-only machine accelerate's
``--num_processes 2`` alone starts ONE process; use the torchrun launcher::

    accelerate launch --config_file conf/accelerate/cpu_2proc.yaml -m eagle_train stage=train
    accelerate launch --multi_gpu --num_processes 2 -m eagle_train stage=train   # same thing

(the recipe switches accelerate to its CPU/gloo mode when no GPU is present). On GPUs::

    accelerate launch --multi_gpu --num_processes 8 -m eagle_train stage=train
    accelerate launch --use_deepspeed --deepspeed_config_file conf/deepspeed/zero2.json \\
        --num_processes 8 -m eagle_train stage=train          # DeepSpeed ZeRO-2

DeepSpeed also runs on a CPU-only machine (its CPU accelerator over gloo; the same command with
``--num_processes 2``): tests/test_deepspeed.py checks it against the plain two-process run.
"auto" values in the DeepSpeed config follow train.batch_size / grad_accum / grad_clip.

Resume: checkpoints land every ``train.save_every`` optimizer steps (and at the end); the same
command picks up the newest complete one (weights, optimizer, scheduler, RNG, data position)
and continues exactly as an uninterrupted run would, bit for bit on the same machine. A
checkpoint is written into ``step_N.partial``, fsynced and renamed into place, so a run killed
at any moment (mid-step, mid-checkpoint-write) leaves only complete checkpoints behind, plus
leftovers the next start deletes; tests/test_crash_resume.py SIGKILLs runs to check it.
SIGTERM or SIGINT (a deadline's `timeout`, a scheduler's preemption, Ctrl-C) stops it gracefully:
the optimizer step under way finishes, a checkpoint and the head so far are saved (the summary
says ``finished: false`` and which signal), then the process dies of that signal; a second
signal acts at once.

Time budget: ``train.max_seconds=S`` ends the run once its optimizer steps have taken S seconds
(or at max_steps / epochs, whichever comes first), with the cosine decay spread over that budget
so the lr reaches 0 where it ends; the head is then finished (``ended_by: max_seconds``). A
lent GPU's run (scripts/gpu_grow.sh) gets the time left instead of a step count guessed from a
probe; the seconds spent are checkpointed, so a resumed run keeps the budget.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from eagle_infer.errors import UserError
from eagle_train.losses import draft_loss, unpack_stats, unroll  # noqa: F401  (unroll: public API)
from eagle_train.shards import atomic_write_text, fsync_dir, fsync_tree, kill_point

CHECKPOINTS = "checkpoints"
PARTIAL = ".partial"  # suffix of a checkpoint being written
DISCARDED = ".discarded"  # suffix of a checkpoint being deleted
STATE_FILE = "trainer_state.json"
LOG_FILE = "train_log.jsonl"
PLOT_FILE = "train_loss.png"
SUMMARY_FILE = "train_summary.json"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sel(cfg: DictConfig, key: str, default: Any = None) -> Any:
    v = OmegaConf.select(cfg, key, default=default)
    if isinstance(v, DictConfig) or OmegaConf.is_list(v):
        return OmegaConf.to_container(v)
    return default if v is None else v


def abspath(p: Any) -> Path:
    from hydra.utils import to_absolute_path

    return Path(to_absolute_path(str(Path(str(p)).expanduser())))


# ---------------------------------------------------------------------------------------------
# Target pieces: config, embedding, lm_head


class TargetIO(nn.Module):
    """What a draft head needs of its target: config, frozen embedding and lm_head weight (and the
    final norm's weight, which an EAGLE-3 readout can start from)."""

    def __init__(self, config, embed_tokens: nn.Embedding, lm_head_weight: Tensor, source: Path,
                 final_norm_weight: Tensor | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens.requires_grad_(False)
        self.lm_head_weight = lm_head_weight.requires_grad_(False)
        self.final_norm_weight = final_norm_weight
        self.source_path = source


def load_target_io(path: Any, device: str | torch.device = "cpu") -> TargetIO:
    """Read only the embedding and lm_head of an HF checkpoint (fp32); falls back to
    eagle_infer.loader.load_model when the tensors have unexpected names."""
    from safetensors import safe_open

    from eagle_infer.default_model import resolve_model_path
    from eagle_infer.loader import read_hf_config, safetensors_files
    from eagle_infer.model import ModelConfig, module_name

    folder = resolve_model_path(None if path is None else str(path))
    cfg = ModelConfig.from_hf(read_hf_config(folder))
    # checkpoint names as the loader maps them (a multimodal checkpoint's language model's too)
    roles = {"embed_tokens.weight": "embed", "lm_head.weight": "head", "norm.weight": "norm"}
    found: dict[str, Tensor] = {}
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                role = roles.get(module_name(key) or "")
                if role is not None and role not in found:
                    found[role] = st.get_tensor(key)
    if "embed" not in found or ("head" not in found and not cfg.tie_word_embeddings):
        from eagle_infer.loader import load_model

        model = load_model(folder, "fp32", str(device))
        return TargetIO(model.config, model.embed_tokens, model.lm_head.weight, folder,
                        model.norm.offset_scale().detach())
    emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta")
    emb.weight = nn.Parameter(found["embed"].float().to(device), requires_grad=False)
    head_w = emb.weight if cfg.tie_word_embeddings or "head" not in found else \
        nn.Parameter(found["head"].float().to(device), requires_grad=False)
    # the head's norm scales by its weight; Gemma's by 1 + its weight
    norm = found["norm"].float().to(device) + cfg.norm_offset if "norm" in found else None
    return TargetIO(cfg, emb, head_w, folder, norm)


# ---------------------------------------------------------------------------------------------
# Head construction


def draft_kind(cfg: DictConfig) -> str:
    kind = str(sel(cfg, "draft.name", "eagle3"))
    if kind not in ("eagle2", "eagle3"):
        raise UserError(f"draft={kind}: use draft=eagle3 or draft=eagle2")
    return kind


def draft_vocab_candidates(cfg: DictConfig, dvs: int) -> list[Path]:
    """Where the tokenmap stage leaves d2t/t2d: beside the capture, and in its own folder."""
    name = f"d2t_t2d_{dvs}.safetensors"
    model = str(sel(cfg, "model.name", "model")).replace("/", "--")
    return [abspath(cfg.capture_dir) / name, abspath(sel(cfg, "tokenmap_dir", "tokenmaps")) / model / name]


def load_draft_vocab(cfg: DictConfig, vocab_size: int, dvs: int) -> tuple[Tensor, Tensor]:
    """(d2t [dvs] int64, t2d [vocab] bool) from the tokenmap stage's output."""
    from safetensors.torch import load_file

    paths = draft_vocab_candidates(cfg, dvs)
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        raise UserError(f"EAGLE-3 draft vocabulary of {dvs} tokens not found (looked for "
                        f"{' and '.join(map(str, paths))}): run `python -m eagle_train stage=tokenmap` "
                        f"first (same model / capture / draft settings)")
    sd = load_file(str(path))
    if "d2t" not in sd or "t2d" not in sd:
        raise UserError(f"{path} lacks the d2t / t2d tensors: run stage=tokenmap again")
    d2t, t2d = sd["d2t"].long(), sd["t2d"].bool()
    if d2t.numel() != dvs or t2d.numel() != vocab_size or int(t2d.sum()) != dvs:
        raise UserError(f"{path}: d2t has {d2t.numel()} entries and t2d {t2d.numel()} ({int(t2d.sum())} "
                        f"set), expected {dvs} draft tokens over a vocabulary of {vocab_size}: "
                        f"run stage=tokenmap again for this model")
    if not torch.equal(torch.arange(dvs) + d2t, t2d.nonzero().flatten()):
        raise UserError(f"{path}: d2t and t2d disagree (draft ids must be the t2d tokens in order)")
    return d2t, t2d


def build_head(cfg: DictConfig, target: TargetIO, manifest: dict, fc_input_scale: Tensor | None = None):
    """A fresh head sized for the target; EAGLE-3 reads the capture's aux layers. fc_input_scale
    [3h] (draft.fc_input_scale, fc_input_scale_of): EAGLE-3's fc trains on its input times it."""
    from eagle_infer.heads import DraftHead, HeadConfig

    kind = draft_kind(cfg)
    tc = target.config
    aux = None
    dvs = None
    if kind == "eagle3":
        aux = list(manifest.get("aux_layer_ids") or [])
        if not aux:
            raise UserError(f"capture {cfg.capture_dir} has no EAGLE-3 aux hidden states "
                            f"(captured with capture.aux_layers=[]): capture again, or train draft=eagle2")
        want = sel(cfg, "draft.aux_layer_ids")
        if want is not None and [int(i) for i in want] != aux:
            raise UserError(f"draft.aux_layer_ids={want} but the capture holds hidden states {aux}: "
                            f"capture again with these layers, or drop the override")
        dvs = sel(cfg, "draft.draft_vocab_size")
        dvs = tc.vocab_size if dvs is None or int(dvs) >= tc.vocab_size else int(dvs)
    hcfg = HeadConfig.for_target(tc, kind, dvs, aux, fc_bias=bool(sel(cfg, "draft.fc_bias", False)))
    head = DraftHead(hcfg, target.embed_tokens, target.lm_head_weight)
    if kind == "eagle3" and dvs < tc.vocab_size:
        d2t, t2d = load_draft_vocab(cfg, tc.vocab_size, dvs)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    if kind == "eagle3" and bool(sel(cfg, "draft.readout_from_target", False)):
        readout_from_target(head, target)
    if fc_input_scale is not None:
        head.fc_input_scale = fc_input_scale.float()
    init_from = sel(cfg, "train.init_from")
    if init_from:
        warm_start(head, abspath(init_from), target)
    return head


def fc_input_scale_of(mode: str, dataset, online, num_samples: int = 64) -> tuple[Tensor, dict]:
    """EAGLE-3's fc input scale [k*H] for draft.fc_input_scale, from the aux states of the
    capture's first num_samples samples (positions 1..: position 0's attention-sink outliers
    would set the scale of the rest): "channel" scales each channel to RMS 1, "layer" each aux
    layer's states (one factor a layer). The target's outlier dimensions (RMS in the hundreds
    to thousands at a late layer) otherwise dominate fc's output at init, and under Adam, whose
    step per weight ignores the input's size, move it hundreds of times faster than the other
    inputs. Deterministic in the capture, so a resumed run recomputes the same scale. Returns
    the scale and a summary of the RMS for the log."""
    if mode not in ("channel", "layer"):
        raise UserError(f"draft.fc_input_scale={mode!r}: use channel, layer or null")
    collate = make_collate(1 << 30, keep_aux=True)
    sq, count = None, 0
    for i in range(min(num_samples, len(dataset))):
        batch = collate([dataset[i]])
        if online is not None:
            batch = online.fill(batch)
        a = batch["aux"][0, 1:].float()  # [T-1, k*H]
        sq = a.square().sum(0) + (0 if sq is None else sq)
        count += a.shape[0]
    if sq is None or count == 0:
        raise UserError("draft.fc_input_scale: the capture's first samples hold no aux states")
    rms = (sq / count).sqrt()  # [k*H]
    k = len(dataset.aux_layer_ids)
    per_layer = rms.view(k, -1).square().mean(-1).sqrt()  # [k]
    if mode == "layer":
        rms = per_layer.repeat_interleave(rms.numel() // k)
    # A dead channel is left at the scale of its layer's typical one, not blown up.
    floor = per_layer.repeat_interleave(rms.numel() // k) * 1e-2
    scale = 1.0 / torch.maximum(rms, floor)
    info = {"mode": mode, "positions": count, "layer_rms": [round(float(r), 3) for r in per_layer],
            "channel_rms_max": [round(float(r), 1) for r in (sq / count).sqrt().view(k, -1).amax(-1)]}
    return scale, info


def readout_from_target(head, target: TargetIO) -> None:
    """EAGLE-3 readout = the target's: lm_head rows of the draft vocabulary and the final norm
    (vLLM speculators' initialisation), so the head starts out speaking the target's hidden
    space instead of learning a 4.7M-parameter readout from scratch."""
    if target.final_norm_weight is None:
        raise UserError(f"draft.readout_from_target: {target.source_path} has no final norm weight "
                        f"(model.norm.weight)")
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head_weight[head.draft_to_target])
        head.norm.weight.copy_(target.final_norm_weight)
    log("train: EAGLE-3 readout initialised from the target's lm_head rows and final norm")


def warm_start(head, path: Path, target: TargetIO) -> None:
    """Copy the weights of a trained head (ours or official, same kind, same draft vocabulary)
    into `head`: a grown capture continues from an earlier head instead of from scratch."""
    from eagle_infer.heads import load_head

    old = load_head(path, target.config, target.embed_tokens, target.lm_head_weight, dtype=torch.float32)
    kind = "eagle3" if head.eagle3 else "eagle2"
    if old.eagle3 != head.eagle3:
        raise UserError(f"train.init_from={path} is an {'eagle3' if old.eagle3 else 'eagle2'} head, "
                        f"but this run trains {kind}")
    if head.eagle3:
        if old.config.aux_hidden_indices != head.config.aux_hidden_indices:
            raise UserError(f"train.init_from={path} reads hidden states {old.config.aux_hidden_indices}, "
                            f"the capture holds {head.config.aux_hidden_indices}")
        if not torch.equal(old.d2t.cpu(), head.d2t.cpu()):
            raise UserError(f"train.init_from={path} has another draft vocabulary than this run's "
                            f"(draft_vocab_size {old.config.draft_vocab_size}): its lm_head rows would "
                            f"mean other tokens")
    try:
        head.load_state_dict(old.state_dict())
    except RuntimeError as e:  # e.g. an EAGLE-2 fc with / without bias
        first = str(e).splitlines()[0]
        raise UserError(f"train.init_from={path} does not fit this run's head: {first}") from None
    if head.eagle3 and head.fc_input_scale is not None:
        with torch.no_grad():  # the saved weight has the scale folded in: the same function
            head.fc.weight.div_(head.fc_input_scale)
    log(f"train: weights initialised from {path}")


def loss_settings(cfg: DictConfig) -> dict:
    """draft_loss keyword arguments from the draft config."""
    if draft_kind(cfg) == "eagle3":
        return {"steps": int(sel(cfg, "draft.ttt_steps", 7)),
                "decay": float(sel(cfg, "draft.ttt_decay", 0.8)),
                "noise": float(sel(cfg, "draft.noise", 0.0)), "ce_weight": 1.0, "feature_weight": 0.0}
    return {"steps": int(sel(cfg, "draft.ttt_steps", 1)),
            "decay": float(sel(cfg, "draft.ttt_decay", 0.8)),
            "noise": float(sel(cfg, "draft.noise", 0.2)),
            "ce_weight": float(sel(cfg, "draft.ce_loss_weight", 0.1)),
            "feature_weight": float(sel(cfg, "draft.feature_loss_weight", 1.0))}


def cosine_with_warmup(opt: torch.optim.Optimizer, warmup: int, total: int,
                       time_progress: Callable[[], float] | None = None):
    """Linear warm-up to the base lr over `warmup` steps, then cosine decay to 0 at `total`
    (the same curve as transformers.get_cosine_schedule_with_warmup). With `time_progress` (the
    fraction of a time budget spent, train.max_seconds) the same curve runs over whichever is
    further along, steps or time: warm-up over the same share of the budget, and 0 where the
    budget ends the run."""

    def factor(step: int) -> float:
        if time_progress is None:
            if step < warmup:
                return step / max(1, warmup)
            progress = (step - warmup) / max(1, total - warmup)
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        p, w = max(step / max(1, total), time_progress()), warmup / max(1, total)
        if p < w:
            return p / w
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, (p - w) / max(1e-9, 1 - w)))))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


class TrainModule(nn.Module):
    """The head plus its loss in one forward, so DDP / DeepSpeed see a single module call."""

    def __init__(self, head, lm_head_weight: Tensor, loss_kw: dict):
        super().__init__()
        self.head = head
        self._lm_head = [lm_head_weight]  # frozen target weight: not a parameter of this module
        self.loss_kw = loss_kw

    def forward(self, batch: dict) -> tuple[Tensor, Tensor]:
        out = draft_loss(self.head, batch, self._lm_head[0], **self.loss_kw)
        return out.loss, out.stats()


# ---------------------------------------------------------------------------------------------
# Data


def make_collate(max_length: int, keep_aux: bool):
    from eagle_train.shards import pad_collate

    def collate(items: list[dict]) -> dict:
        cut = []
        for it in items:
            it = dict(it)
            if not keep_aux:
                it.pop("aux", None)
            for k in ("input_ids", "loss_mask", "hidden", "aux"):
                if k in it:
                    it[k] = it[k][:max_length]
            cut.append(it)
        return pad_collate(cut)

    return collate


class StreamSampler:
    """Per-process index lists for global micro-batches start..stop.

    Epoch e visits a seeded permutation of the samples, cut into global batches of
    batch_size * world samples (the last one wrapped around so every process gets a full
    batch); process r takes slice r of each. With `lengths`, samples of similar length share a
    global batch (sorted within windows of 16 batches, batch order shuffled again): less padding.
    Micro-batch m is global batch m % per_epoch of epoch m // per_epoch, and everything depends
    on (seed, epoch) only, so a resumed run continues exactly where the checkpoint stopped."""

    WINDOW = 16

    def __init__(self, n: int, batch_size: int, world: int, rank: int, seed: int, start: int, stop: int,
                 lengths: list[int] | None = None):
        self.n, self.bs, self.world, self.rank, self.seed = n, batch_size, world, rank, seed
        self.start, self.stop = start, stop
        self.lengths = lengths
        self.per_epoch = max(1, math.ceil(n / (batch_size * world)))
        self._epoch: tuple[int, list[list[int]]] | None = None

    def global_batches(self, epoch: int) -> list[list[int]]:
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch[1]
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        gb = self.bs * self.world
        flat = [perm[i % self.n] for i in range(self.per_epoch * gb)]  # wrap the last batch
        if self.lengths is not None:
            lens = self.lengths
            w = gb * self.WINDOW
            flat = [i for k in range(0, len(flat), w)
                    for i in sorted(flat[k:k + w], key=lambda i: -lens[i])]
        batches = [flat[k:k + gb] for k in range(0, len(flat), gb)]
        if self.lengths is not None:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        self._epoch = (epoch, batches)
        return batches

    def batch(self, m: int) -> list[int]:
        epoch, j = divmod(m, self.per_epoch)
        return self.global_batches(epoch)[j][self.rank * self.bs:(self.rank + 1) * self.bs]

    def __iter__(self):
        for m in range(self.start, self.stop):
            yield self.batch(m)

    def __len__(self) -> int:
        return max(0, self.stop - self.start)


# ---------------------------------------------------------------------------------------------
# Precision, checkpoints, logs


def bf16_supported(device: torch.device) -> bool:
    """bf16 autocast that is actually fast here: a bf16 GPU, or a CPU with AVX512-BF16 / AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = getattr(torch, "cpu", None)
        checks = [getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        return any(bool(c()) for c in checks if c is not None)
    return False


def skip_deepspeed_shm_op() -> None:
    """Keep DeepSpeed on CPU from JIT-compiling its shared-memory all-reduce (gcc, minutes on a
    small machine, at every fresh install): only its inference all-reduce uses it, training's
    collectives go through the gloo process group either way. The dict is DeepSpeed's own
    per-launch probe result, which it keeps editable for this."""
    import deepspeed.ops

    probed = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(probed, dict):
        probed["deepspeed_shm_comm"] = False


def mixed_precision_for(value: Any, device: torch.device) -> str:
    v = str(value).lower()
    if v in ("false", "no", "0", "none", "fp32", "off"):
        return "no"
    ok = bf16_supported(device)
    if v in ("true", "yes", "1", "bf16", "on"):
        if not ok:
            warnings.warn(f"train.bf16=true on a {device.type} without fast bf16: expect slow training",
                          stacklevel=2)
        return "bf16"
    if v != "auto":
        raise UserError(f"train.bf16={value}: use auto, true or false")
    return "bf16" if ok else "no"


def complete_checkpoints(head_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first. Complete = renamed into place
    as step_N (save_checkpoint renames only a fully written, fsynced folder) with its state."""
    root = head_dir / CHECKPOINTS
    out = []
    if root.is_dir():
        for d in root.iterdir():
            num = d.name.removeprefix("step_")
            if d.is_dir() and d.name.startswith("step_") and num.isdigit() and (d / STATE_FILE).is_file():
                out.append((int(num), d))
    return sorted(out)


def discard_dir(path: Path) -> None:
    """Delete a folder so that a kill midway cannot leave something that looks complete: it is
    renamed out of the step_N namespace first (atomic), then removed."""
    doomed = path.with_name(path.name + DISCARDED)
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_checkpoint_leftovers(head_dir: Path) -> list[str]:
    """Delete what a killed run can leave in checkpoints/: half-written (.partial) and
    half-deleted (.discarded) folders, and step_N folders without a trainer state (none are
    made any more, but older versions renamed nothing). Returns the names removed."""
    root = head_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    removed = []
    for d in sorted(root.iterdir()):
        half = d.name.endswith((PARTIAL, DISCARDED))
        if d.is_dir() and d.name.startswith("step_") and (half or not (d / STATE_FILE).is_file()):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def read_log(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return out


def draw_loss_curves(ax, records: list[dict]) -> None:
    """Total loss, per-step CE (and EAGLE-2's feature loss) of train_log.jsonl records on ax."""
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], label="total loss", color="black")
    for s in range(len(records[-1].get("ce", []))):
        ax.plot(steps, [r["ce"][s] for r in records], label=f"CE step {s}", alpha=0.7, lw=1)
    if any(r.get("feature") and r["feature"][0] for r in records):
        ax.plot(steps, [r["feature"][0] for r in records], label="feature SmoothL1", ls="--")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend(fontsize=7)


def save_figure(fig, path: Path, title: str = "") -> Path:
    """Title, lay out, write (parent folders made) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def loss_records(records: list[dict]) -> list[dict]:
    return [r for r in records if "step" in r and "loss" in r]


def plot_training(records: list[dict], path: Path, title: str = "") -> Path | None:
    """Loss and per-step top-1 accuracy curves from train_log.jsonl records."""
    recs = loss_records(records)
    if not recs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in recs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    draw_loss_curves(a1, recs)
    for s in range(len(recs[-1].get("acc", []))):
        a2.plot(steps, [r["acc"][s] for r in recs], label=f"step {s}")
    a2.set_xlabel("optimizer step")
    a2.set_ylabel("top-1 accuracy vs target")
    a2.set_ylim(0, 1)
    a2.legend(fontsize=7)
    return save_figure(fig, path, title)


def capture_paths(cfg: DictConfig) -> list[Path]:
    """capture_dir, then train.extra_captures: the captures whose train splits one run reads."""
    extra = sel(cfg, "train.extra_captures") or []
    if isinstance(extra, str):
        extra = [extra]
    return [abspath(cfg.capture_dir), *(abspath(p) for p in extra)]


def fingerprint(cfg: DictConfig, manifest: dict) -> dict:
    """Settings that change the trained head: a finished head with the same ones is complete."""
    return {
        "kind": draft_kind(cfg),
        "model": str(sel(cfg, "model.name", "")),
        "draft": {k: v for k, v in (sel(cfg, "draft", {}) or {}).items()
                  if not (k in ("readout_from_target", "freeze_lm_head", "fc_input_scale") and not v)},
        "capture_samples": sum(s["samples"] for s in manifest.get("shards", [])),
        "capture_tokens": sum(s["tokens"] for s in manifest.get("shards", [])),
        # Options left unset are left out, so heads trained before they existed stay complete.
        "train": {k: v for k, v in (sel(cfg, "train", {}) or {}).items()
                  if k not in ("wandb", "log_every", "save_every", "num_workers", "keep_checkpoints")
                  and not (k in ("init_from", "extra_captures", "online_tf32", "max_seconds") and not v)},
        "seed": int(sel(cfg, "seed", 0)),
    }


def is_complete(cfg: DictConfig) -> bool:
    """The head in head_dir was trained to the end with these settings (no model load)."""
    from eagle_train.shards import merged_manifest, read_manifest

    head_dir = abspath(cfg.head_dir)
    try:
        summary = json.loads((head_dir / SUMMARY_FILE).read_text())
        manifest = merged_manifest([read_manifest(p) for p in capture_paths(cfg)])
    except (OSError, json.JSONDecodeError, UserError):
        return False
    if not ((head_dir / "config.json").is_file() and (head_dir / "model.safetensors").is_file()):
        return False
    fp = json.loads(json.dumps(fingerprint(cfg, manifest)))
    return summary.get("fingerprint") == fp and summary.get("finished", False)


class StopOnSignal:
    """While training: SIGTERM / SIGINT only set `signum`; the loop stops at the next optimizer
    step with its work saved, and run() then re-sends the signal (the handlers in place before
    are back by then), so the caller sees the exit it expects. A second signal acts at once. A
    signal the process ignores (SIGINT in a background job, under nohup) stays ignored."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._before: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():  # where Python allows handlers
            self._before = {s: signal.signal(s, self._handle) for s in self.SIGNALS
                            if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        signal.signal(signum, self._before[signum])
        log(f"train: {signal.Signals(signum).name}: stopping after this optimizer step with a checkpoint "
            f"and the head so far (send it again to stop at once)")

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._before.items():
            signal.signal(s, handler)
        self._before = {}


# ---------------------------------------------------------------------------------------------
# The recipe


class TrainRecipe:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.stopped_by: int | None = None  # the signal a graceful stop was asked by (StopOnSignal)

    # -- setup -----------------------------------------------------------------------------------

    def setup(self, cfg: DictConfig | None = None) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        from eagle_train.shards import CaptureSet

        cfg = self.cfg = cfg if cfg is not None else self.cfg
        t = cfg.train
        self.head_dir = abspath(cfg.head_dir)
        self.capture_dir = abspath(cfg.capture_dir)
        self.kind = draft_kind(cfg)

        dev_name = str(sel(cfg, "device", "auto"))
        if dev_name.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"device={dev_name} but CUDA is not available on this machine")
        use_cpu = dev_name == "cpu" or not torch.cuda.is_available()
        probe = torch.device("cpu" if use_cpu else "cuda")
        self.mixed_precision = mixed_precision_for(sel(cfg, "train.bf16", "auto"), probe)
        self.grad_accum = max(1, int(sel(cfg, "train.grad_accum", 1)))
        self.grad_clip = float(sel(cfg, "train.grad_clip", 0.0) or 0.0)
        handlers = []
        ds_plugin = None
        self.deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if self.deepspeed:  # accelerate launch --use_deepspeed --deepspeed_config_file ...
            from accelerate.utils import DeepSpeedPlugin

            # "auto" accumulation and clipping in the DeepSpeed config follow train.grad_accum
            # and train.grad_clip (accelerate alone would fill 1 and 1.0).
            ds_plugin = DeepSpeedPlugin(gradient_accumulation_steps=self.grad_accum,
                                        gradient_clipping=self.grad_clip)
            if use_cpu:
                # accelerate's cpu=True silently drops DeepSpeed, and without a GPU it finds no
                # process-group backend by itself: DeepSpeed's CPU accelerator over gloo.
                from accelerate.utils import InitProcessGroupKwargs

                os.environ.setdefault("DS_ACCELERATOR", "cpu")
                handlers.append(InitProcessGroupKwargs(backend="gloo"))
                skip_deepspeed_shm_op()
        self.acc = Accelerator(cpu=use_cpu and not self.deepspeed, mixed_precision=self.mixed_precision,
                               gradient_accumulation_steps=self.grad_accum,
                               step_scheduler_with_optimizer=False, kwargs_handlers=handlers,
                               deepspeed_plugin=ds_plugin)
        acc = self.acc
        self.is_main = acc.is_main_process
        self.device = acc.device

        seed = int(sel(cfg, "seed", 0))
        set_seed(seed)
        self.target = load_target_io(sel(cfg, "model.path", "default"), self.device)
        tc = self.target.config
        paths = capture_paths(cfg)
        self.dataset = CaptureSet(paths, model=tc, model_name=str(sel(cfg, "model.name", "")) or None,
                                  require_aux=self.kind == "eagle3")
        where = ", ".join(str(p) for p in paths)
        if len(self.dataset) == 0:
            raise UserError(f"capture {where} holds no samples: run stage=capture first")
        if not self.dataset.complete and self.is_main:
            log(f"warning: capture {where} is incomplete; training on the {len(self.dataset)} "
                f"samples captured so far")
        self.manifest = self.dataset.manifest
        self.online = None
        if not self.dataset.has_states:  # online mode: the target computes each batch's states
            from eagle_train.capture import OnlineStates

            self.online = OnlineStates.for_capture(
                self.manifest, sel(cfg, "model.path", "default"), self.device,
                aux_layers=None if self.kind == "eagle3" else [],
                tf32=bool(sel(cfg, "train.online_tf32", False)))

        scale = None
        mode = sel(cfg, "draft.fc_input_scale") if self.kind == "eagle3" else None
        if mode:
            scale, info = fc_input_scale_of(str(mode), self.dataset, self.online)
            if self.is_main:
                log(f"train: fc inputs scaled per {info['mode']} over {info['positions']:,} positions "
                    f"(aux layers' RMS {info['layer_rms']}, largest channel RMS {info['channel_rms_max']}); "
                    f"the saved head has the scale folded into fc.weight")
        head = build_head(cfg, self.target, self.manifest, scale).to(self.device)
        if self.kind == "eagle3" and bool(sel(cfg, "draft.freeze_lm_head", False)):
            head.lm_head.weight.requires_grad_(False)  # AdamW skips it: no grad ever
        self.loss_kw = loss_settings(cfg)
        if self.target.config.final_softcap:  # Gemma 2: the target's distribution is of its capped logits
            self.loss_kw["logit_softcap"] = self.target.config.final_softcap
        self.steps_ttt = self.loss_kw["steps"]
        model = TrainModule(head, self.target.lm_head_weight, self.loss_kw)
        self.num_params = sum(p.numel() for p in head.parameters())

        betas = tuple(float(b) for b in sel(cfg, "train.adam_betas", [0.9, 0.95]))
        opt = torch.optim.AdamW(model.parameters(), lr=float(t.lr), weight_decay=float(t.weight_decay),
                                betas=betas)  # type: ignore[arg-type]

        self.batch_size = int(t.batch_size)
        self.max_length = int(t.max_length)
        world, rank = acc.num_processes, acc.process_index
        self.sampler_args = (len(self.dataset), self.batch_size, world, rank, seed)
        self.lengths = self.dataset.lengths() if bool(sel(cfg, "train.group_by_length", True)) else None
        per_epoch = StreamSampler(*self.sampler_args, 0, 0).per_epoch
        self.per_epoch = per_epoch
        max_steps = sel(cfg, "train.max_steps")
        epochs = float(sel(cfg, "train.epochs", 1))
        self.total_steps = int(max_steps) if max_steps else max(1, int(epochs * per_epoch) // self.grad_accum)
        self.warmup = int(round(float(sel(cfg, "train.warmup_ratio", 0.0)) * self.total_steps))
        # train.max_seconds: a time budget for the optimizer steps (a lent GPU's deadline), so a
        # run needs no step count guessed from a probe; the schedule decays over it (above).
        self.max_seconds = float(sel(cfg, "train.max_seconds", 0) or 0)
        self.seconds_before, self.run_seconds, self.time_frac = 0.0, 0.0, 0.0
        self.ended_by: str | None = None
        sched = cosine_with_warmup(opt, self.warmup, self.total_steps,
                                   (lambda: self.time_frac) if self.max_seconds else None)

        ds_plugin = getattr(acc.state, "deepspeed_plugin", None)
        if ds_plugin is not None:  # DeepSpeed needs the micro-batch size: we bring our own loader
            dsc = ds_plugin.deepspeed_config
            if dsc.get("train_micro_batch_size_per_gpu", "auto") == "auto":
                dsc["train_micro_batch_size_per_gpu"] = self.batch_size
            if dsc.get("train_batch_size", "auto") == "auto":
                dsc["train_batch_size"] = self.batch_size * world * self.grad_accum
            clip = float(dsc.get("gradient_clipping", 0.0) or 0.0)
            if clip != self.grad_clip and self.is_main:
                log(f"warning: the DeepSpeed config clips gradients at {clip}, train.grad_clip is "
                    f"{self.grad_clip}: DeepSpeed's value applies (\"auto\" follows train.grad_clip)")
        self.model, self.opt, self.sched = acc.prepare(model, opt, sched)
        self.log_every = max(1, int(sel(cfg, "train.log_every", 10)))
        self.save_every = int(sel(cfg, "train.save_every", 0) or 0)
        self.keep = max(1, int(sel(cfg, "train.keep_checkpoints", 2)))
        self.fingerprint = json.loads(json.dumps(fingerprint(cfg, self.manifest)))

        # Resume from the newest complete checkpoint; leftovers of a kill are deleted first.
        self.step, self.micro, self.tokens_total, self.tokens_run = 0, 0, 0, 0
        self.wandb_id = None
        if self.is_main:
            removed = remove_checkpoint_leftovers(self.head_dir)
            if removed:
                log(f"train: removed leftovers of an interrupted run: {', '.join(removed)}")
        acc.wait_for_everyone()
        ckpts = complete_checkpoints(self.head_dir)
        if ckpts:
            step, path = ckpts[-1]
            state = json.loads((path / STATE_FILE).read_text())
            old = state.get("fingerprint", {})
            for key in ("kind", "model"):
                if old.get(key) != self.fingerprint[key]:
                    raise UserError(f"checkpoint {path} is for {key} '{old.get(key)}', not "
                                    f"'{self.fingerprint[key]}': delete {self.head_dir / CHECKPOINTS} "
                                    f"or train into another head_dir")
            if old != self.fingerprint and self.is_main:
                log(f"warning: settings changed since checkpoint {path.name}; resuming with the new ones")
            acc.load_state(str(path))
            self.step, self.micro = int(state["step"]), int(state["micro"])
            self.tokens_total = int(state.get("tokens", 0))
            self.wandb_id = state.get("wandb_id")
            self.seconds_before = float(state.get("train_seconds", 0.0))
            if self.max_seconds:
                self.time_frac = self.seconds_before / self.max_seconds
                if self.time_frac >= 1.0:  # the budget ended the run at this checkpoint
                    self.total_steps, self.ended_by = self.step, "max_seconds"
            if self.is_main:
                log(f"train: resuming from {path} (step {self.step}/{self.total_steps})")
        if not ckpts:
            # Noise differs per process; parameters start equal (DDP broadcasts rank 0's).
            set_seed(seed, device_specific=True)
        if self.is_main:
            self.head_dir.mkdir(parents=True, exist_ok=True)
            recs = [r for r in read_log(self.head_dir / LOG_FILE) if r.get("step", 0) <= self.step]
            atomic_write_text(self.head_dir / LOG_FILE, "".join(json.dumps(r) + "\n" for r in recs))
            self.records = recs
            n_tok = self.dataset.num_tokens
            log(f"train: {self.kind} head, {self.num_params / 1e6:.1f}M parameters, target "
                f"{sel(cfg, 'model.name', '?')} on {self.device}; {len(self.dataset)} samples "
                f"({n_tok:,} tokens, {self.dataset.num_assistant_tokens:,} assistant); "
                f"{self.total_steps} steps of {self.batch_size}x{world}x{self.grad_accum} sequences "
                f"(max {self.max_length} tokens), ttt steps {self.steps_ttt}, mixed precision "
                f"{self.mixed_precision}, {world} process(es)"
                + (", target states computed online" if self.online else ""))
        self.wandb = self._init_wandb() if self.is_main else None

    def _init_wandb(self):
        mode = str(sel(self.cfg, "train.wandb.mode", "offline")).lower()
        if mode in ("disabled", "off", "false", "none", "no"):
            return None
        try:
            import wandb

            run = wandb.init(
                project=str(sel(self.cfg, "train.wandb.project", "eagle-spec")), mode=mode,
                dir=str(self.head_dir), id=self.wandb_id, resume="allow",
                name=f"{sel(self.cfg, 'model.name', 'model')}-{self.kind}",
                config=OmegaConf.to_container(self.cfg, resolve=True),
                settings=wandb.Settings(init_timeout=60, silent=True),
            )
            self.wandb_id = run.id
            return run
        except Exception as e:  # never let logging stop training
            log(f"warning: wandb did not start ({type(e).__name__}: {e}); training without it")
            return None

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Write checkpoints/step_N atomically: every process saves its part into
        step_N.partial, the main process adds the trainer state, fsyncs the tree and renames it
        into place. A kill at any point leaves either no step_N (resume takes the one before;
        the .partial folder is deleted at the next start) or a complete one."""
        acc = self.acc
        root = self.head_dir / CHECKPOINTS
        final = root / f"step_{self.step}"
        tmp = root / f"step_{self.step}{PARTIAL}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))  # weights, optimizer (DeepSpeed: one partition per process), RNG
        acc.wait_for_everyone()
        kill_point("ckpt_write")
        tokens = self.tokens_total + self._tokens_run_all()  # collective: every process calls it
        if self.is_main:
            state = {"step": self.step, "micro": self.micro, "tokens": tokens,
                     "total_steps": self.total_steps, "fingerprint": self.fingerprint,
                     "wandb_id": self.wandb_id, "time": time.time(),
                     "train_seconds": self.seconds_before + self.run_seconds}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
            fsync_tree(tmp)
            if final.exists():  # (a rerun of a finished step) out of the way atomically, then gone
                discard_dir(final)
            os.replace(tmp, final)
            fsync_dir(root)
            kill_point("ckpt_saved")
            for _, old in complete_checkpoints(self.head_dir)[:-self.keep]:
                discard_dir(old)
        acc.wait_for_everyone()
        return final

    # -- the loop --------------------------------------------------------------------------------

    def _loader(self, start_micro: int, stop_micro: int):
        sampler = StreamSampler(*self.sampler_args, start_micro, stop_micro, lengths=self.lengths)
        collate = make_collate(self.max_length, keep_aux=self.kind == "eagle3")
        nw = int(sel(self.cfg, "train.num_workers", 0) or 0)
        # A DataLoader draws its workers' base seed when iterated, from the global RNG unless it
        # has a generator of its own: that draw would shift EAGLE-2's input noise of a resumed
        # run (its loader starts after the checkpoint's RNG state is restored) against an
        # uninterrupted one. Seeded by where the loader starts, so workers are reproducible too.
        gen = torch.Generator().manual_seed(int(sel(self.cfg, "seed", 0)) * 1_000_003 + start_micro)
        return torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, collate_fn=collate,
                                           num_workers=nw, persistent_workers=False, generator=gen,
                                           pin_memory=self.device.type == "cuda")

    def train(self, stop_after: int | None = None) -> dict:
        """Train to total_steps (or stop after `stop_after` more optimizer steps: a simulated
        kill, for tests). Returns the summary (also written to train_summary.json)."""
        from tqdm.auto import tqdm

        acc, model = self.acc, self.model
        K = self.steps_ttt
        stop_step = self.total_steps if stop_after is None else min(self.total_steps, self.step + stop_after)
        stop_micro = self.total_steps * self.grad_accum
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not self.is_main,
                   desc=f"train {self.kind}", dynamic_ncols=True, file=sys.stderr)
        window = torch.zeros(4 * K, device=self.device)
        win_loss = torch.zeros(2, device=self.device)  # summed loss, micro-batches
        win_tokens = 0
        t_start = t_win = time.perf_counter()
        self.tokens_run, self.run_seconds = 0, 0.0
        last: dict = {}
        model.train()
        with StopOnSignal() as stop:
            if self.step < stop_step:
                for batch in self._loader(self.micro, stop_micro):
                    n_tok = int(batch["attention_mask"].sum())  # counted on the host: no device sync
                    batch = {k: (v.to(self.device, non_blocking=True) if isinstance(v, Tensor) else v)
                             for k, v in batch.items()}
                    if self.online is not None:
                        batch = self.online.fill(batch)
                    with acc.accumulate(model):
                        loss, stats = model(batch)
                        acc.backward(loss)
                        kill_point("train_backward")  # mid-step: gradients computed, weights not updated
                        if acc.sync_gradients and self.grad_clip > 0:
                            acc.clip_grad_norm_(model.parameters(), self.grad_clip)
                        self.opt.step()
                        if acc.sync_gradients:
                            self.sched.step()
                        self.opt.zero_grad(set_to_none=True)
                    self.micro += 1
                    window += stats.detach()
                    win_loss += torch.stack([loss.detach().float(), torch.ones((), device=self.device)])
                    win_tokens += n_tok
                    self.tokens_run += n_tok
                    if not acc.sync_gradients:
                        continue
                    self.step += 1
                    kill_point("train_step")
                    bar.update(1)
                    # every process must stop at the same step (the checkpoint is a collective)
                    # and decay the lr alike: the signal and the clock are agreed on
                    stopping, self.run_seconds = self._agreed(stop.signum, time.perf_counter() - t_start)
                    out_of_time = False
                    if self.max_seconds:
                        self.time_frac = (self.seconds_before + self.run_seconds) / self.max_seconds
                        out_of_time = self.time_frac >= 1.0 and self.step < self.total_steps
                        if out_of_time:  # the budget is spent: this step is the schedule's last
                            self.total_steps, self.ended_by = self.step, "max_seconds"
                    end = self.step >= stop_step or stopping is not None or out_of_time
                    if self.step % self.log_every == 0 or end or self.step == self.total_steps:
                        last = self._log(window, win_loss, win_tokens, time.perf_counter() - t_win, bar)
                        window.zero_()
                        win_loss.zero_()
                        win_tokens, t_win = 0, time.perf_counter()
                    periodic = self.save_every and self.step % self.save_every == 0
                    if periodic or self.step == self.total_steps or stopping is not None:
                        self.save_checkpoint()
                    if stopping is not None:
                        self.stopped_by = stopping
                    if end:
                        break
        self.stopped_by = self.stopped_by or stop.signum  # (a signal after the last step: it is honoured too)
        bar.close()
        elapsed = time.perf_counter() - t_start
        tokens_all = self._tokens_run_all()
        self.tokens_total += tokens_all
        self.tokens_run = 0
        finished = self.step >= self.total_steps
        summary = {"finished": finished, "step": self.step, "total_steps": self.total_steps}
        if self.is_main:
            done = self.head_dir / SUMMARY_FILE
            trained = done.is_file() and (self.head_dir / "model.safetensors").is_file()
            if finished and tokens_all == 0 and trained:
                summary = json.loads(done.read_text())  # already trained: nothing to redo
                log(f"train: {self.head_dir} is already trained to step {self.step}")
            else:
                summary = self._finish(finished, tokens_all, elapsed, last)
        acc.wait_for_everyone()
        return summary

    def _agreed(self, signum: int | None, seconds: float) -> tuple[int | None, float]:
        """The signal to stop on if any process received one, and the slowest process's seconds
        (one small collective a step when there are several processes; none alone)."""
        if self.acc.num_processes == 1:
            return signum, seconds
        t = torch.tensor([[float(signum or 0), seconds]], device=self.device, dtype=torch.float64)
        m = self.acc.gather(t).max(dim=0).values
        return int(m[0].item()) or None, float(m[1].item())

    def _tokens_run_all(self) -> int:
        """Tokens trained on since this run (re)started, summed over processes."""
        if self.acc.num_processes == 1:
            return self.tokens_run
        t = torch.tensor([self.tokens_run], device=self.device)
        return int(self.acc.reduce(t, reduction="sum").item())

    def _log(self, window: Tensor, win_loss: Tensor, win_tokens: int, seconds: float, bar) -> dict:
        acc = self.acc
        packed = torch.cat([window, win_loss, torch.tensor([float(win_tokens)], device=self.device)])
        if acc.num_processes > 1:
            packed = acc.reduce(packed, reduction="sum")
        K = self.steps_ttt
        st = unpack_stats(packed[:4 * K].cpu(), K)
        loss = float(packed[4 * K] / packed[4 * K + 1].clamp(min=1))
        rec = {
            "step": self.step, "epoch": round(self.micro / self.per_epoch, 4),
            "lr": float(self.sched.get_last_lr()[0]), "loss": loss,
            "ce": st["ce"], "acc": st["acc"], "count": st["count"],
            "tokens_per_s": float(packed[-1]) / max(seconds, 1e-9), "seconds": round(seconds, 3),
        }
        if self.kind == "eagle2":
            rec["feature"] = st["feature"]
        if self.is_main:
            with open(self.head_dir / LOG_FILE, "a") as f:
                f.write(json.dumps(rec) + "\n")
            self.records.append(rec)
            accs = "/".join(f"{a:.2f}" for a in st["acc"])
            bar.set_postfix_str(f"loss {loss:.3f} acc {accs}", refresh=False)
            if self.wandb is not None:
                try:
                    data = {"loss": loss, "lr": rec["lr"], "tokens_per_s": rec["tokens_per_s"],
                            "epoch": rec["epoch"]}
                    data.update({f"acc/step{s}": a for s, a in enumerate(st["acc"])})
                    data.update({f"ce/step{s}": c for s, c in enumerate(st["ce"])})
                    if self.kind == "eagle2":
                        data["feature_loss"] = st["feature"][0]
                    self.wandb.log(data, step=self.step)
                except Exception as e:
                    log(f"warning: wandb.log failed ({e}); disabling wandb")
                    self.wandb = None
        return rec

    def _finish(self, finished: bool, tokens: int, elapsed: float, last: dict) -> dict:
        from eagle_infer.heads import save_head

        tps = tokens / max(elapsed, 1e-9)
        plot_training(self.records, self.head_dir / PLOT_FILE,
                      f"{sel(self.cfg, 'model.name', '')} {self.kind} (ttt {self.steps_ttt})")
        if not last and self.records:
            last = self.records[-1]
        summary = {
            "finished": finished, "kind": self.kind, "step": self.step, "total_steps": self.total_steps,
            "epochs_done": round(self.micro / self.per_epoch, 4), "samples": len(self.dataset),
            "tokens_this_run": tokens, "train_seconds_this_run": round(elapsed, 2),
            "tokens_per_s": round(tps, 1), "tokens_total": self.tokens_total,
            "num_processes": self.acc.num_processes, "mixed_precision": self.mixed_precision,
            "device": str(self.device), "num_params": self.num_params,
            "final_loss": last.get("loss"), "final_ce_per_step": last.get("ce"),
            "final_acc_per_step": last.get("acc"), "final_feature_loss": (last.get("feature") or [None])[0],
            "head_dir": str(self.head_dir), "fingerprint": self.fingerprint,
        }
        if self.max_seconds:
            summary["max_seconds"] = self.max_seconds
            summary["ended_by"] = self.ended_by or "steps"
        if self.stopped_by is not None:
            summary["stopped_by"] = signal.Signals(self.stopped_by).name
        if finished or self.stopped_by is not None:
            # A stopped run's head too (a deadline's work is usable as is); the summary's
            # `finished` says which, and is_complete() accepts only a finished one.
            head = self.acc.unwrap_model(self.model).head
            save_head(head, self.head_dir, dtype=torch.bfloat16)
            # Last, and atomically: its presence says the head beside it is complete.
            atomic_write_text(self.head_dir / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
        if finished:
            accs = " ".join(f"{a:.3f}" for a in (summary["final_acc_per_step"] or []))
            log(f"train: done, {self.step} steps, {tps:,.0f} tokens/s this run ({tokens:,} tokens in "
                f"{elapsed:.1f}s), final loss {summary['final_loss']}, top-1 per step [{accs}]; "
                f"head saved to {self.head_dir}")
        elif self.stopped_by is not None:
            log(f"train: stopped by {summary['stopped_by']} at step {self.step}/{self.total_steps} "
                f"({tps:,.0f} tokens/s), checkpoint saved; the head of this step is in {self.head_dir} "
                f"(not finished: the same command resumes from the checkpoint)")
        else:
            log(f"train: stopped at step {self.step}/{self.total_steps} ({tps:,.0f} tokens/s); run the "
                f"same command to resume from the last checkpoint")
        return summary

    def cleanup(self) -> None:
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception:
                pass
            self.wandb = None
        # The prepared model (DDP's, holding the process group's gloo workers), optimizer and
        # scheduler go now, while the interpreter is whole: left in reference cycles for its
        # shutdown, a finished two-process run's rank aborted at exit ("terminate called without an
        # active exception", in 2 of 5 full test runs on a busy 2-core machine), head already saved.
        self.model = self.opt = self.sched = None
        self.acc.free_memory()
        gc.collect()
        self.acc.end_training()


def run(cfg: DictConfig) -> dict:
    recipe = TrainRecipe(cfg)
    recipe.setup(cfg)
    try:
        summary = recipe.train()
    finally:
        recipe.cleanup()
    if recipe.stopped_by is not None:  # the work is saved: now die of the signal as the caller expects
        os.kill(os.getpid(), recipe.stopped_by)
    return summary
