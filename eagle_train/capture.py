"""Capture stage: on-policy answers from the target and the hidden states a draft head trains on.

    python -m eagle_train stage=capture [data=...] [capture.limit=...] [capture.offset=...]
                                        [capture.regenerate=false]

For every conversation of the train split (and, into ``capture_dir/heldout``, the held-out
split that evaluation uses; its answers are greedy unless ``capture.heldout_temperature`` says
otherwise, so that evaluation sees the sequences greedy decoding produces):

1. On-policy regeneration (``capture.regenerate``, default on): the target rewrites every
   assistant turn in order, each prompt being the conversation's system/user turns plus the
   model's *own* earlier answers. Batched over conversations; every (sample, turn) has its own
   seed, so the same seed gives the same data. An answer cut by ``max_new_tokens_per_turn``
   keeps what was generated; the end-of-turn token the chat template appends after it is left
   out of the loss mask (the target never produced it) and the sample is listed under
   ``truncated_ids`` in the manifest.
2. The conversation is rendered with the chat template and a loss mask (assistant tokens),
   cut to ``data.max_length``, and run teacher-forced through the target once (batched, right
   padded) to record the final normed hidden state and the EAGLE-3 aux states per token.
   With ``capture.store_states=false`` (online mode) this step is skipped: shards keep tokens
   and loss masks only, and training / evaluation run the same forward per batch
   (`OnlineStates`). A teacher-forced capture (``capture.regenerate=false``) is then
   tokenization alone, with no target loaded.
3. Samples are written in shards (see `eagle_train.shards`); each shard and then the manifest
   are replaced atomically, so a capture killed at any moment (mid-generation, mid-forward,
   mid-shard-write, between shard and manifest) and started again loses and duplicates
   nothing: ids already in the manifest (stored or skipped) are not redone, leftovers are
   deleted, and the redone samples come out identical, hidden states included (every answer
   has its own seed, and batches depend only on the shard's samples).
   tests/test_crash_resume.py SIGKILLs it mid-generation, mid-shard-write, between shard and
   manifest and mid-manifest-write, and compares with an uninterrupted capture.

Bad records (no assistant turn, empty, a prompt longer than the context or than
``data.max_length``) are skipped with a message naming the record; nothing captured is touched.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from eagle_infer.errors import UserError
from eagle_infer.loader import cpu_runs_bf16_fast, eos_ids, resolve_dtype
from eagle_train.shards import (
    HELDOUT_SUBDIR,
    MANIFEST,
    commit,
    kill_point,
    new_manifest,
    read_manifest,
    remove_orphans,
    store_dtype,
)

# Teacher-forced forward batches hold at most this many (padded) tokens.
FORWARD_TOKEN_BUDGET = 16384


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Settings


def _sel(cfg: DictConfig, key: str, default: Any = None) -> Any:
    v = OmegaConf.select(cfg, key, default=default)
    return OmegaConf.to_container(v) if isinstance(v, DictConfig | ListConfig) else v


def requested_aux_layers(cfg: DictConfig) -> list[int] | None:
    """capture.aux_layers, else draft.aux_layer_ids, else None (= the model's reference layers)."""
    for key in ("capture.aux_layers", "draft.aux_layer_ids"):
        v = _sel(cfg, key)
        if v is not None:
            return [int(x) for x in v]
    return None


def resolve_aux_layers(requested: list[int] | None, num_layers: int, default: list[int]) -> list[int]:
    layers = list(default) if requested is None else list(requested)
    for i in layers:
        if not 0 <= i <= num_layers:
            raise UserError(f"capture.aux_layers: hidden-state index {i} is out of range for a "
                            f"{num_layers}-layer target (valid: 0..{num_layers})")
    return layers


def split_temperature(cfg: DictConfig, split: str) -> float:
    """Sampling temperature of the regenerated answers: capture.temperature for train;
    capture.heldout_temperature (null = the same) for the held-out split, greedy by default so
    that stage=eval's chain is exactly what greedy chain drafting meets."""
    t = _sel(cfg, "capture.heldout_temperature") if split == "heldout" else None
    t = float(cfg.capture.temperature if t is None else t)
    if t < 0:
        raise UserError(f"capture temperature for the {split} split must be >= 0, got {t}")
    return t


def content_settings(cfg: DictConfig, aux_layers: list[int], split: str = "train") -> dict:
    """Everything that changes what a captured sample of `split` contains: must match to resume."""
    c = cfg.capture
    return {
        "model_name": str(cfg.model.name),
        "regenerate": bool(c.regenerate),
        "temperature": split_temperature(cfg, split),
        "top_p": float(c.top_p),
        "max_new_tokens_per_turn": int(c.max_new_tokens_per_turn),
        "max_turns": None if c.max_turns is None else int(c.max_turns),
        "dtype": str(c.dtype),
        "store_dtype": str(c.store_dtype),
        "aux_layer_ids": list(aux_layers),
        # Left out when on, so captures made before the option existed still resume.
        **({} if store_states_of(cfg) else {"store_states": False}),
        # Likewise left out for our own generator: another engine samples with its own RNG.
        **({} if generation_backend(cfg) == "ours" or not bool(c.regenerate)
           else {"backend": generation_backend(cfg)}),
        "seed": int(cfg.seed),
        "data": {
            "source": str(cfg.data.source),
            "limit": cfg.data.limit,
            "heldout": cfg.data.heldout,
            "seed": int(cfg.data.seed),
            "max_length": cfg.data.max_length,
        },
    }


def store_states_of(cfg: DictConfig) -> bool:
    return bool(_sel(cfg, "capture.store_states", True))


def generation_backend(cfg: DictConfig) -> str:
    """Who regenerates the answers: `ours` (eagle_infer.generate) or `vllm` (vLLM in its own
    environment, eagle_infer.vllm_client); the hidden states always come from our forward."""
    backend = str(_sel(cfg, "capture.backend", "ours"))
    if backend not in ("ours", "vllm"):
        raise UserError(f"capture.backend must be 'ours' or 'vllm', got '{backend}'")
    return backend


def compile_generation(cfg: DictConfig, device: torch.device) -> bool:
    """capture.compile: whether our generator's decode steps run compiled (generate's
    compile=True); auto = on CUDA only, where they replay as CUDA graphs. Off by default: on an
    H100 at batch 256 (segment 10) a step took as long either way, ~55 s of compiling aside."""
    value = str(_sel(cfg, "capture.compile", "false")).lower()
    if value not in ("auto", "true", "false"):
        raise UserError(f"capture.compile must be auto, true or false, got '{value}'")
    return device.type == "cuda" if value == "auto" else value == "true"


def heldout_limit(cfg: DictConfig) -> int | None:
    """Held-out conversations to capture: what evaluation will use (eval.num_samples)."""
    n = _sel(cfg, "eval.num_samples")
    return None if n is None else int(n)


def split_offsets(cfg: DictConfig) -> dict[str, int]:
    """Conversations passed over per split before the first one captured: capture.offset for
    train, so that a second capture (say teacher-forced) covers a slice disjoint from the first."""
    off = int(_sel(cfg, "capture.offset", 0) or 0)
    if off < 0:
        raise UserError(f"capture.offset must be >= 0, got {off}")
    return {"train": off, "heldout": 0}


def split_dirs(capture_dir: Path) -> dict[str, Path]:
    return {"train": capture_dir, "heldout": capture_dir / HELDOUT_SUBDIR}


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += _diff(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def is_complete(cfg: DictConfig) -> bool:
    """True when both splits are fully captured with the current settings (no model load)."""
    capture_dir = Path(cfg.capture_dir)
    limits = {"train": cfg.capture.limit, "heldout": heldout_limit(cfg)}
    offsets = split_offsets(cfg)
    for split, d in split_dirs(capture_dir).items():
        try:
            m = read_manifest(d)
        except UserError:
            return False
        if not m.get("complete") or m.get("limit") != limits[split] or m.get("offset", 0) != offsets[split]:
            return False
        aux = m.get("settings", {}).get("aux_layer_ids", [])
        req = requested_aux_layers(cfg)
        if _diff(m.get("settings"), content_settings(cfg, aux if req is None else req, split)):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Per-sample plan


class Skip(Exception):
    """This record cannot be captured; the message says why."""


@dataclass
class Job:
    sid: int
    messages: list[dict]  # assistant contents to regenerate are None until generated
    slots: list[int]  # indices of the assistant messages
    truncated: list[bool] = field(default_factory=list)

    def first_prompt_chars(self) -> int:
        end = self.slots[0] if self.slots else len(self.messages)
        return sum(len(m["content"] or "") for m in self.messages[:end])


def plan_conversation(sid: int, conv: Sequence[dict], regenerate: bool, max_turns: int | None) -> Job:
    msgs = [dict(m) for m in conv]
    if not msgs:
        raise Skip("empty conversation")
    if regenerate:
        # An assistant message with no user message before it has nothing to answer.
        first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if first_user is None:
            raise Skip("no user turn to answer")
        msgs = [m for i, m in enumerate(msgs) if not (m["role"] == "assistant" and i < first_user)]
        if not any(m["role"] == "assistant" for m in msgs):
            # Prompt-only records (e.g. MT-bench questions, one user message per turn):
            # answer every user turn.
            out = []
            for m in msgs:
                out.append(m)
                if m["role"] == "user":
                    out.append({"role": "assistant", "content": ""})
            msgs = out
    slots = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if max_turns is not None:
        slots = slots[:max_turns]
    if not slots:
        raise Skip("no assistant turn")
    msgs = msgs[: slots[-1] + 1]  # user turns after the last kept answer teach nothing
    if regenerate:
        for i in slots:
            msgs[i] = {"role": "assistant", "content": None}
    return Job(sid, msgs, slots, [False] * len(slots))


def sample_seed(seed: int, sid: int, turn: int) -> int:
    return ((seed * 1_000_003 + sid) * 1_009 + turn) % (2**62)


# ---------------------------------------------------------------------------------------------
# The capture engine


@dataclass
class Stats:
    samples: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    gen_tokens: int = 0
    gen_time: float = 0.0
    fwd_time: float = 0.0
    skipped: int = 0
    truncated: int = 0
    bytes: int = 0
    start: float = field(default_factory=time.perf_counter)


class Capturer:
    """`model` may be None when nothing needs the target (teacher-forced and online mode);
    `config` is its ModelConfig and `eos` its end-of-answer ids (eos_ids)."""

    def __init__(self, cfg: DictConfig, model, tokenizer, aux_layers: list[int], config, eos: set[int]):
        self.cfg = cfg
        self.model = model
        self.tok = tokenizer
        self.aux = aux_layers
        self.N = config.num_layers
        self.store_dtype = store_dtype(str(cfg.capture.store_dtype))
        self.store_states = store_states_of(cfg)
        self.context = min(int(cfg.model.context_length or 1 << 30), config.max_position_embeddings)
        self.max_length = cfg.data.max_length
        self.max_new = int(cfg.capture.max_new_tokens_per_turn)
        if self.max_new <= 0:
            raise UserError(f"capture.max_new_tokens_per_turn must be > 0, got {self.max_new}")
        self.batch_size = int(cfg.capture.batch_size)
        if self.batch_size <= 0:
            raise UserError(f"capture.batch_size must be > 0, got {self.batch_size}")
        self.eos = set(eos)
        self.compile = model is not None and compile_generation(cfg, model.embed_tokens.weight.device)
        self.stats = Stats()
        self.vllm = None  # a VLLMEngine, started by start_vllm() when answers are regenerated by vLLM
        # A cache of fixed size keeps attention shapes (and so the numbers) identical whether a
        # capture runs in one go or is resumed: the same seed gives the same data.
        limit = self.context if self.max_length is None else min(self.context, int(self.max_length))
        if model is not None:
            model.setup_cache(self.batch_size, min(self.context, limit + self.max_new))

    # -- generation ----------------------------------------------------------------------
    def start_vllm(self, folder: str | Path, dtype: torch.dtype) -> None:
        """capture.backend=vllm: regenerate through vLLM (the path a user with a GPU cluster
        takes for captures at scale); one engine for the whole capture."""
        from eagle_infer.vllm_client import VLLMEngine

        name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        t0 = time.perf_counter()
        extra = _sel(self.cfg, "capture.vllm_args", None)
        extra = OmegaConf.to_container(extra) if isinstance(extra, DictConfig) else dict(extra or {})
        if not torch.cuda.is_available() and "enable_chunked_prefill" not in extra:
            # vLLM 0.32 for CPU dies on a seeded sampled request whose prompt is prefilled in
            # chunks ("CPU Generator does not use offset": it rewinds the generator of a chunk's
            # discarded token, a CUDA-only call), which a batch of prompts over its token budget
            # gets; whole prompts never chunk (the budget then at least the context, vLLM's rule).
            budget = max(int(extra.get("max_num_batched_tokens", 8192)), self.context)
            extra |= {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}
        self.vllm = VLLMEngine(folder, dtype=name, max_model_len=self.context, seed=int(self.cfg.seed),
                               **extra)
        log(f"vLLM engine for regeneration ({name}) up in {time.perf_counter() - t0:.0f}s")

    def vllm_generate(self, prompts: list[list[int]], params: list) -> list[list[int]]:
        """The same requests as `generate`: one seed per answer, stop at the target's EOS ids."""
        outs, _ = self.vllm.generate(prompts, [
            {"temperature": p.temperature, "top_p": p.top_p, "seed": p.seed, "max_tokens": self.max_new,
             "stop_token_ids": sorted(self.eos)} for p in params])
        return outs

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None

    def regenerate(self, jobs: list[Job], skipped: list[dict], temperature: float) -> list[Job]:
        from eagle_infer.generate import generate
        from eagle_infer.sampling import SamplingParams
        from eagle_train.data import render_prompt

        c = self.cfg.capture
        alive = list(jobs)
        turn = 0
        while True:
            active, prompts = [], []
            for job in alive:
                if turn >= len(job.slots):
                    continue
                slot = job.slots[turn]
                try:
                    ids = render_prompt(self.tok, job.messages[:slot])
                except ValueError as e:
                    reason = f"turn {turn}: {e}"
                    ids = None
                else:
                    reason = None
                    if self.max_length is not None and len(ids) >= int(self.max_length):
                        reason = (f"turn {turn}: prompt has {len(ids)} tokens, not below "
                                  f"data.max_length={self.max_length}")
                    elif len(ids) + self.max_new > self.context:
                        reason = (f"turn {turn}: prompt has {len(ids)} tokens; with "
                                  f"{self.max_new} new tokens it exceeds the context ({self.context})")
                if reason is not None:
                    if turn == 0:
                        skipped.append({"id": job.sid, "reason": reason})
                        job.slots = []
                    else:  # keep the turns answered so far
                        job.messages = job.messages[:job.slots[turn - 1] + 1]
                        job.slots, job.truncated = job.slots[:turn], job.truncated[:turn]
                    continue
                active.append(job)
                prompts.append(ids)
            if not active:
                break
            params = [SamplingParams(temperature, float(c.top_p), 0,
                                     sample_seed(int(self.cfg.seed), j.sid, turn)) for j in active]
            t0 = time.perf_counter()
            if self.vllm is not None:
                outs = self.vllm_generate(prompts, params)
            else:
                outs = generate(self.model, prompts, self.max_new, params, eos_token_ids=sorted(self.eos),
                                compile=self.compile)
            self.stats.gen_time += time.perf_counter() - t0
            kill_point("capture_generate")
            for job, out in zip(active, outs):
                self.stats.gen_tokens += len(out)
                hit_eos = bool(out) and out[-1] in self.eos
                body = out[:-1] if hit_eos else out
                text = self.tok.decode(body, skip_special_tokens=True)
                job.messages[job.slots[turn]] = {"role": "assistant", "content": text}
                job.truncated[turn] = not hit_eos
            turn += 1
        return [j for j in jobs if j.slots]

    # -- rendering + teacher-forced forward -----------------------------------------------
    def render(self, job: Job) -> tuple[list[int], list[int]]:
        from eagle_train.data import render_with_loss_mask

        try:
            ids, mask = render_with_loss_mask(self.tok, job.messages, max_length=self.max_length)
        except ValueError as e:
            raise Skip(str(e)) from None
        if len(ids) > self.context:
            ids, mask = ids[: self.context], mask[: self.context]
        if any(job.truncated):
            # Runs of 1s are the assistant turns in order; a cut answer's run ends with the
            # end-of-turn token the template added, not one the target generated.
            runs, start = [], None
            for i, m in enumerate([*mask, 0]):
                if m and start is None:
                    start = i
                elif not m and start is not None:
                    runs.append((start, i))
                    start = None
            for k, cut in enumerate(job.truncated):
                if cut and k < len(runs) and ids[runs[k][1] - 1] in self.eos:
                    mask[runs[k][1] - 1] = 0
        if not any(mask):
            raise Skip(f"no assistant tokens within data.max_length={self.max_length}")
        return ids, mask

    @torch.no_grad()
    def forward(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Teacher-forced hidden states per sequence: (final [T, H], aux [T, k*H] or None)."""
        from eagle_infer.generate import join_groups

        model = self.model
        dev = model.embed_tokens.weight.device
        results: list[Any] = [None] * len(seqs)
        # Batches of similar lengths: a padded token costs as much as a real one, and one batch
        # of the whole (length-sorted) capture batch spent about half its compute on padding.
        for idx in join_groups([len(s) for s in seqs], max_rows=self.batch_size,
                               max_tokens=FORWARD_TOKEN_BUDGET):
            T = max(len(seqs[k]) for k in idx)
            B = len(idx)
            tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
            for b, k in enumerate(idx):
                tokens[b, : len(seqs[k])] = torch.tensor(seqs[k], dtype=torch.long)
            hidden = teacher_forced_states(model, tokens, [*self.aux, self.N])
            final = hidden[-1]
            aux = torch.cat(hidden[:-1], dim=-1) if self.aux else None
            for b, k in enumerate(idx):
                n = len(seqs[k])
                results[k] = (final[b, :n].to("cpu", self.store_dtype).clone(),
                              None if aux is None else aux[b, :n].to("cpu", self.store_dtype).clone())
        return results

    def process(self, jobs: list[Job], skipped: list[dict], temperature: float) -> list[dict]:
        """Regenerate (if asked, at `temperature`), render and capture one batch of jobs; returns
        samples."""
        if self.cfg.capture.regenerate:
            jobs = self.regenerate(jobs, skipped, temperature)
        rendered = []
        for job in jobs:
            try:
                rendered.append((job, *self.render(job)))
            except Skip as e:
                skipped.append({"id": job.sid, "reason": str(e)})
        if not rendered:
            return []
        if self.store_states:
            t0 = time.perf_counter()
            states = self.forward([ids for _, ids, _ in rendered])
            self.stats.fwd_time += time.perf_counter() - t0
            kill_point("capture_forward")
        else:  # online mode: training runs the target for them
            states = [(None, None)] * len(rendered)
        samples = []
        for (job, ids, mask), (hid, aux) in zip(rendered, states):
            samples.append({"sample_id": job.sid, "input_ids": ids, "loss_mask": mask, "hidden": hid,
                            "aux": aux, "messages": job.messages, "truncated": any(job.truncated)})
        return samples


@torch.no_grad()
def teacher_forced_states(model, tokens: torch.Tensor, hidden_layers: Sequence[int]) -> list[torch.Tensor]:
    """One forward of the target over right-padded tokens [B, T]: the hidden states [B, T, H] of
    `hidden_layers` (HF indices). What capture stores and what online mode computes."""
    from eagle_infer.generate import ensure_cache, forward_padded

    ensure_cache(model, *tokens.shape)
    return forward_padded(model, tokens, hidden_layers=list(hidden_layers))[1]


class OnlineStates:
    """Online mode: the states a capture would have stored, computed for a batch of a capture
    made with capture.store_states=false. Same forward, same dtype (the capture's), rounded to the
    store dtype and zero on padding, so a batch is what the stored capture would have given."""

    def __init__(self, model, aux_layers: Sequence[int], dtype: torch.dtype, tf32: bool = False):
        self.model = model
        self.layers = [*aux_layers, model.config.num_layers]
        self.has_aux = bool(aux_layers)
        self.dtype = dtype
        # An fp32 target's matmuls on TF32 tensor cores (CUDA): inputs rounded to 10 mantissa
        # bits, finer than the 7 of the bf16 the states are stored in; on an H100 the fp32
        # forward is a large share of an online training step. Off: states as a capture's.
        self.tf32 = tf32

    @classmethod
    def for_capture(cls, manifest: dict, model_path: Any, device: torch.device,
                    aux_layers: Sequence[int] | None = None, tf32: bool = False) -> OnlineStates:
        """Load the target in the capture's dtype; `aux_layers` (HF indices) default to the
        capture's."""
        from eagle_infer.loader import load_model

        dtype = str((manifest.get("settings") or {}).get("dtype", "auto"))
        model = load_model(model_path, dtype, str(device))
        aux = (manifest.get("aux_layer_ids") or []) if aux_layers is None else aux_layers
        return cls(model, list(aux), store_dtype(manifest["store_dtype"]), tf32=tf32)

    def fill(self, batch: dict) -> dict:
        """Add ``hidden`` [B, T, H] (and ``aux`` [B, T, k*H]) to a collated batch."""
        pad = ~batch["attention_mask"][..., None]
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.tf32 or before
        try:
            states = teacher_forced_states(self.model, batch["input_ids"], self.layers)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
        batch["hidden"] = states[-1].to(self.dtype).masked_fill(pad, 0)
        if self.has_aux:
            batch["aux"] = torch.cat(states[:-1], -1).to(self.dtype).masked_fill(pad, 0)
        return batch


# ---------------------------------------------------------------------------------------------
# One split


@dataclass
class SplitState:
    """One split's directory, its manifest (as on disk after `open_split`) and what is left."""

    split: str
    directory: Path
    manifest: dict
    todo: list[tuple[int, list[dict]]]


def open_split(split: str, directory: Path, planned: list[tuple[int, list[dict]]], limit: int | None,
               settings: dict, model_info: dict, offset: int = 0) -> SplitState:
    """Check an existing capture against the settings, drop leftovers of a killed run, record
    the plan and return the samples still to capture."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest: dict | None = None
    if (directory / MANIFEST).is_file():
        manifest = read_manifest(directory)
        diff = _diff(manifest.get("settings"), settings)
        for key in ("hidden_size", "vocab_size"):
            if manifest.get(key) != model_info[key]:
                diff.append(f"{key}: {manifest.get(key)} -> {model_info[key]}")
        if diff:
            hint = ""
            if split == "heldout" and any(d.startswith("temperature:") for d in diff):
                # Held-out splits captured before heldout_temperature existed were sampled at
                # the train temperature; the train split beside them is still good.
                hint = (f"; to keep this split instead: capture.heldout_temperature="
                        f"{manifest['settings'].get('temperature')}")
            raise UserError(
                f"capture in {directory} was made with other settings ({'; '.join(diff)}); "
                f"delete it or use another workdir to capture with the new ones{hint}")
    removed = remove_orphans(directory, manifest)
    if removed:
        log(f"{split}: removed leftovers of an interrupted run: {', '.join(removed)}")
    if manifest is None:
        manifest = new_manifest(split, **model_info, settings=settings)
    manifest.update(limit=limit, offset=offset, planned=len(planned), planned_ids=[sid for sid, _ in planned])
    done = {sid for s in manifest["shards"] for sid in s["sample_ids"]}
    done |= {s["id"] for s in manifest["skipped"]}
    todo = [(sid, conv) for sid, conv in planned if sid not in done]
    commit(directory, manifest, complete=not todo)
    return SplitState(split, directory, manifest, todo)


def capture_split(cap: Capturer, state: SplitState) -> dict:
    """Capture the samples left in `state`, one shard at a time (shard, then manifest, atomically)."""
    cfg, split, directory, manifest, todo = cap.cfg, state.split, state.directory, state.manifest, state.todo
    if not todo:
        log(f"{split}: all {manifest['planned']} planned samples already captured in {directory}")
        return manifest
    log(f"{split}: capturing {len(todo)} samples into {directory}"
        + (f" ({manifest['planned'] - len(todo)} already done)" if manifest["planned"] > len(todo) else ""))

    from tqdm import tqdm

    st = cap.stats
    shard_size = int(cfg.capture.shard_size)
    regenerate, max_turns = bool(cfg.capture.regenerate), cfg.capture.max_turns
    bar = tqdm(total=len(todo), desc=f"capture {split}", unit="sample", file=sys.stderr,
               dynamic_ncols=True, mininterval=1.0)
    for start in range(0, len(todo), shard_size):
        chunk = todo[start:start + shard_size]
        skipped: list[dict] = []
        jobs = []
        for sid, conv in chunk:
            try:
                jobs.append(plan_conversation(sid, conv, regenerate, max_turns))
            except Skip as e:
                skipped.append({"id": sid, "reason": str(e)})
                bar.write(f"skipped {split} conversation {sid} of {cfg.data.source}: {e}", file=sys.stderr)
        bar.update(len(skipped))
        # Similar prompt lengths share a batch (less padding); the order depends only on the
        # chunk, so a resumed capture batches exactly as an uninterrupted one.
        jobs.sort(key=lambda j: (j.first_prompt_chars(), j.sid))
        samples: list[dict] = []
        for b in range(0, len(jobs), cap.batch_size):
            before = len(skipped)
            batch = jobs[b:b + cap.batch_size]
            got = cap.process(batch, skipped, float(manifest["settings"]["temperature"]))
            samples += got
            st.samples += len(got)
            st.tokens += sum(len(s["input_ids"]) for s in got)
            st.assistant_tokens += sum(int(sum(s["loss_mask"])) for s in got)
            st.truncated += sum(bool(s["truncated"]) for s in got)
            for s in skipped[before:]:
                bar.write(f"skipped {split} conversation {s['id']} of {cfg.data.source}: {s['reason']}",
                          file=sys.stderr)
            el = time.perf_counter() - st.start
            bar.set_postfix_str(f"gen {st.gen_tokens / max(st.gen_time, 1e-9):.1f} tok/s, "
                                f"stored {st.tokens / max(el, 1e-9):.1f} tok/s", refresh=False)
            bar.update(len(batch))
        st.skipped += len(skipped)
        entry = commit(directory, manifest, samples, skipped, complete=start + shard_size >= len(todo))
        st.bytes += entry["bytes"] if entry else 0
    bar.close()
    return manifest


# ---------------------------------------------------------------------------------------------
# Stage entry point


def run(cfg: DictConfig, model=None, tokenizer=None) -> dict:
    """Capture the train split (capture.limit) and the held-out split (eval.num_samples).

    `model` / `tokenizer` may be passed in (tests, notebooks); otherwise they are loaded from
    cfg.model.path in capture.dtype. Nothing is loaded when both splits are already complete.
    """
    from eagle_infer.default_model import resolve_model_path
    from eagle_infer.loader import default_device, load_model, load_tokenizer, read_hf_config
    from eagle_infer.model import ModelConfig
    from eagle_train.data import load_conversations, split_heldout
    from eagle_train.pipeline import resolve_device, save_stage_config

    t_start = time.perf_counter()
    capture_dir = Path(cfg.capture_dir)
    limit = cfg.capture.limit
    if limit is not None and int(limit) < 0:
        raise UserError(f"capture.limit must be >= 0 or null, got {limit}")
    store_dtype(str(cfg.capture.store_dtype))  # validate before the slow part
    if int(cfg.capture.shard_size) <= 0:
        raise UserError(f"capture.shard_size must be > 0, got {cfg.capture.shard_size}")
    convs = load_conversations(cfg.data.source, cfg.data.limit)
    train_idx, held_idx = split_heldout(list(range(len(convs))), cfg.data.heldout, int(cfg.data.seed))
    hl = heldout_limit(cfg)
    offsets = split_offsets(cfg)
    off = offsets["train"]
    if off and off >= len(train_idx):
        raise UserError(f"capture.offset={off} passes over all {len(train_idx)} training conversations "
                        f"of {cfg.data.source}")
    train_idx = train_idx[off:]
    plans = {
        "train": [(i, convs[i]) for i in (train_idx if limit is None else train_idx[: int(limit)])],
        "heldout": [(i, convs[i]) for i in (held_idx if hl is None else held_idx[:hl])],
    }
    limits = {"train": None if limit is None else int(limit), "heldout": hl}

    folder = getattr(model, "source_path", None) or resolve_model_path(cfg.model.path)
    mc = model.config if model is not None else ModelConfig.from_hf(read_hf_config(Path(folder)))
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.model.path)
    aux = resolve_aux_layers(requested_aux_layers(cfg), mc.num_layers, mc.eagle3_layer_ids())
    model_info = {
        "model_name": str(cfg.model.name),
        "model_path": str(folder),
        "hidden_size": mc.hidden_size,
        "vocab_size": mc.vocab_size,
        "num_layers": mc.num_layers,
        "aux_layer_ids": aux,
        "store_dtype": str(cfg.capture.store_dtype),
        "eos_token_ids": sorted(eos_ids(mc, tok, folder)),
        "states": store_states_of(cfg),
    }
    states = [open_split(split, d, plans[split], limits[split], content_settings(cfg, aux, split), model_info,
                         offsets[split])
              for split, d in split_dirs(capture_dir).items()]
    save_stage_config(cfg, "capture")
    stats = Stats()
    if any(s.todo for s in states):
        dev = (model.embed_tokens.weight.device if model is not None
               else torch.device(resolve_device(cfg.device) or default_device()))
        if str(cfg.capture.dtype) in ("bf16", "bfloat16") and dev.type == "cpu" and not cpu_runs_bf16_fast():
            log("warning: this CPU has no bf16 instructions (AVX512-BF16/AMX) and our bf16 kernel did not "
                "build: capture.dtype=bf16 is emulated and several times slower than capture.dtype=fp32 here")
        ours_generate = bool(cfg.capture.regenerate) and generation_backend(cfg) == "ours"
        needs_target = ours_generate or store_states_of(cfg)
        if model is None and needs_target:
            t0 = time.perf_counter()
            model = load_model(folder, str(cfg.capture.dtype), resolve_device(cfg.device))
            log(f"loaded target {cfg.model.name} ({mc.num_layers} layers, hidden {mc.hidden_size}, "
                f"{cfg.capture.dtype}) on {model.embed_tokens.weight.device} in "
                f"{time.perf_counter() - t0:.1f}s")
        cap = Capturer(cfg, model, tok, aux, mc, set(model_info["eos_token_ids"]))
        stats = cap.stats
        try:
            if generation_backend(cfg) == "vllm" and bool(cfg.capture.regenerate):
                cap.start_vllm(folder, resolve_dtype(str(cfg.capture.dtype), dev))
            for state in states:
                capture_split(cap, state)
        finally:
            cap.close()
    manifests = {s.split: s.manifest for s in states}

    st = stats
    el = time.perf_counter() - st.start
    log(f"capture done in {time.perf_counter() - t_start:.1f}s: {st.samples} new samples, "
        f"{st.tokens:,} tokens ({st.assistant_tokens:,} assistant), {st.skipped} skipped, "
        f"{st.truncated} with an answer cut at max_new_tokens_per_turn")
    if st.samples:
        fwd = (f"teacher-forced forward {st.tokens / max(st.fwd_time, 1e-9):.0f} tok/s" if st.fwd_time
               else "no hidden states stored (online mode: train and eval compute them)")
        log(f"  generated {st.gen_tokens:,} tokens at {st.gen_tokens / max(st.gen_time, 1e-9):.1f} tok/s; "
            f"{fwd}; stored {st.tokens / el:.1f} tok/s overall; {st.bytes / 2**20:.1f} MiB written")
    for split, m in manifests.items():
        t = m["totals"]
        log(f"  {split}: {t['samples']} samples, {t['tokens']:,} tokens ({t['assistant_tokens']:,} "
            f"assistant), {t['skipped']} skipped, {t['bytes'] / 2**20:.1f} MiB on disk, "
            f"{'complete' if m['complete'] else 'INCOMPLETE'} -> {split_dirs(capture_dir)[split]}")
    return {"stats": st, "manifests": manifests}
