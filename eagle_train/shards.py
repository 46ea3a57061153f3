"""On-disk format of captured target states, and the reader every later stage uses.

A capture directory holds safetensors shards and one ``manifest.json``::

    capture/
      manifest.json
      shard-00000.safetensors
      shard-00001.safetensors
      ...
      heldout/            # the held-out split, same layout (evaluation reads it)

One shard = a group of samples (conversations), their tokens concatenated:

    input_ids    [N] int32      rendered conversation (chat template), N = tokens in the shard
    loss_mask    [N] uint8      1 on assistant tokens (the positions the head learns)
    hidden       [N, H]         final normed hidden state (HF hidden_states[num_layers])
    aux          [N, k*H]       EAGLE-3 states (inputs of layers aux_layer_ids, low/mid/high)
                                concatenated in that order; absent when no aux layers are kept
    offsets      [n+1] int64    sample i owns tokens offsets[i]:offsets[i+1]
    sample_ids   [n] int64      source conversation index (in the loaded data set)

A capture made with ``capture.store_states=false`` (online mode) stores no ``hidden`` / ``aux``
(manifest ``states: false``): training and evaluation run the target for them per batch
(`eagle_train.capture.OnlineStates`), which trades disk (about 4.6 KB a token for SmolLM2 with
aux states in bf16, 32 KB for a Llama-3-8B target) for one target forward per batch and epoch.

The safetensors metadata carries the rendered conversations (``conversations``: JSON list of
message lists) so a sample can be inspected or re-prompted. Tokens are concatenated rather than
stored per sample so a shard has six tensors whatever its size, and a sample is a slice:
readers memory-map the file and touch only the rows they use.

The manifest lists the shards (file, sample count, token count, assistant tokens, sample ids,
ids whose answer was cut by the length limit), the samples skipped with the reason, the target
(name, hidden size, vocab, layers, aux layer ids, EOS ids), the store dtype and the settings the
capture was made with. Writers replace shards and the manifest atomically (temp file +
rename), so a reader never sees a half-written file and a killed capture resumes exactly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle_infer.errors import UserError

FORMAT_NAME = "eagle-capture"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_PATTERN = "shard-{:05d}.safetensors"
HELDOUT_SUBDIR = "heldout"

STORE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def store_dtype(name: str) -> torch.dtype:
    if name not in STORE_DTYPES:
        raise UserError(f"unknown capture store dtype '{name}': use bf16, fp16 or fp32")
    return STORE_DTYPES[name]


KILL_ENV = "EAGLE_TEST_KILL_AT"
_kill_counts: dict[str, int] = {}


def kill_point(site: str) -> None:
    """Crash-test hook. With ``EAGLE_TEST_KILL_AT=<site>:<n>[,<site>:<n>...]`` in the environment
    the process SIGKILLs itself the n-th time (1-based) it passes `site`, so a test can stop a
    capture or a training run at an exact point (mid-generation, mid-shard-write, mid-step,
    mid-checkpoint) instead of racing a timer. Without the variable it does nothing.

    Sites: capture_generate, capture_forward, shard_write, shard_commit (capture);
    train_backward, train_step, ckpt_write, ckpt_saved (train); atomic_write:<file name> (a
    manifest, log or summary written through atomic_write_text). ``<site>:<n>=SIGTERM`` (or any
    other signal's name) sends that signal instead, to test what a process does on receiving it."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    n = _kill_counts[site] = _kill_counts.get(site, 0) + 1
    for item in spec.split(","):
        point, _, sig_name = item.strip().partition("=")
        name, _, count = point.rpartition(":")
        if name == site and count.isdigit() and int(count) == n:
            sig = signal.Signals[sig_name or "SIGKILL"]
            # The line tells the test where the process died (it cannot tell from the signal).
            print(f"{KILL_ENV}: {sig.name} at {site}:{n} (pid {os.getpid()})", file=sys.stderr, flush=True)
            os.kill(os.getpid(), sig)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in directory `path` durable (POSIX; a no-op elsewhere)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under `root` (before renaming it into place)."""
    for d, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(d)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write data so that `path` holds either the old or the new content, never a mix."""
    # A per-process temp name: ranks of a multi-process launch may write the same file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    kill_point(f"atomic_write:{path.name}")  # e.g. atomic_write:manifest.json:3 (temp written, not renamed)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """atomic_write_bytes of the text as UTF-8."""
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def read_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory) / MANIFEST
    if not Path(directory).is_dir():
        raise UserError(f"capture directory not found: {directory} (run stage=capture first)")
    if not path.is_file():
        raise UserError(f"no {MANIFEST} in {directory}: not a capture directory, or its capture "
                        f"never finished a shard (run stage=capture)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT_NAME:
        raise UserError(f"{path} is not an {FORMAT_NAME} manifest")
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise UserError(f"{path} has format version {manifest['version']}; this code reads "
                        f"up to {FORMAT_VERSION}")
    return manifest


# ---------------------------------------------------------------------------------------------
# Writing


def write_shard(path: Path, samples: Sequence[dict], dtype: torch.dtype,
                metadata: dict[str, str] | None = None) -> dict:
    """Write samples (dicts with input_ids, loss_mask, hidden, aux (or None), sample_id,
    messages) as one shard, atomically. Returns the shard's manifest entry."""
    if not samples:
        raise ValueError("write_shard needs at least one sample")
    lens = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lens).cumsum(0)
    ids = torch.cat([torch.as_tensor(s["input_ids"], dtype=torch.int32) for s in samples])
    mask = torch.cat([torch.as_tensor(s["loss_mask"]).to(torch.uint8) for s in samples])
    tensors = {
        "input_ids": ids,
        "loss_mask": mask,
        "offsets": offsets,
        "sample_ids": torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64),
    }
    if samples[0].get("hidden") is not None:  # None: online mode, tokens only
        tensors["hidden"] = torch.cat([s["hidden"].to(dtype) for s in samples]).contiguous()
    if samples[0].get("aux") is not None:
        tensors["aux"] = torch.cat([s["aux"].to(dtype) for s in samples]).contiguous()
    meta = {"format": FORMAT_NAME,
            "conversations": json.dumps([s.get("messages") for s in samples], ensure_ascii=False)}
    meta.update(metadata or {})
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    kill_point("shard_write")  # a temp shard on disk, not renamed: the next run deletes it
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return {
        "file": path.name,
        "samples": len(samples),
        "tokens": int(offsets[-1]),
        "assistant_tokens": int(mask.sum()),
        "bytes": path.stat().st_size,
        "sample_ids": [int(s["sample_id"]) for s in samples],
        "truncated_ids": [int(s["sample_id"]) for s in samples if s.get("truncated")],
    }


def new_manifest(split: str, *, model_name: str, hidden_size: int, vocab_size: int, num_layers: int,
                 aux_layer_ids: Sequence[int], store_dtype: str, eos_token_ids: Sequence[int],
                 settings: dict, model_path: str = "", states: bool = True) -> dict:
    """An empty manifest for one split of a capture (`commit` fills it shard by shard)."""
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "split": split,
        "model_name": model_name,
        "model_path": model_path,
        "hidden_size": int(hidden_size),
        "vocab_size": int(vocab_size),
        "num_layers": int(num_layers),
        "aux_layer_ids": [int(i) for i in aux_layer_ids],  # aux = these states concatenated
        "hidden_layer_id": int(num_layers),  # `hidden` = the final normed state
        "store_dtype": store_dtype,
        "states": bool(states),  # false: tokens and masks only (online mode)
        "eos_token_ids": sorted(int(i) for i in eos_token_ids),
        "settings": settings,
        "limit": None,
        "planned": 0,
        "planned_ids": [],
        "complete": False,
        "shards": [],
        "skipped": [],
    }
    manifest["totals"] = totals(manifest)
    return manifest


def totals(manifest: dict) -> dict:
    shards = manifest["shards"]
    return {
        "samples": sum(s["samples"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "assistant_tokens": sum(s["assistant_tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "skipped": len(manifest["skipped"]),
        "truncated": sum(len(s["truncated_ids"]) for s in shards),
    }


def commit(directory: str | os.PathLike, manifest: dict, samples: Sequence[dict] = (),
           skipped: Sequence[dict] = (), complete: bool | None = None) -> dict | None:
    """Write `samples` as the next shard, then the updated manifest, each atomically.

    Killed between the two, the shard is an orphan that the next run deletes (it is not in the
    manifest): either the whole shard counts or none of it. `skipped` entries
    (``{"id", "reason"}``) are recorded so a resumed run does not retry them. Returns the new
    shard's entry (None when there were no samples).
    """
    directory = Path(directory)
    entry = None
    if samples:
        dtype = store_dtype(manifest["store_dtype"])
        path = directory / SHARD_PATTERN.format(len(manifest["shards"]))
        entry = write_shard(path, sorted(samples, key=lambda s: s["sample_id"]), dtype,
                            {"split": manifest.get("split", "")})
        kill_point("shard_commit")  # the shard in place, the manifest not yet: an orphan
        manifest["shards"].append(entry)
    manifest["skipped"] += list(skipped)
    if complete is not None:
        manifest["complete"] = bool(complete)
    manifest["totals"] = totals(manifest)
    atomic_write_json(directory / MANIFEST, manifest)
    return entry


def remove_orphans(directory: str | os.PathLike, manifest: dict | None) -> list[str]:
    """Delete shard files the manifest does not list and temp files (leftovers of a kill)."""
    directory = Path(directory)
    listed = {s["file"] for s in (manifest or {}).get("shards", [])}
    removed = []
    for f in [*directory.glob("shard-*.safetensors*"), *directory.glob(MANIFEST + ".*tmp")]:
        if f.exists() and f.name not in listed:
            f.unlink()
            removed.append(f.name)
    return removed


# ---------------------------------------------------------------------------------------------
# Reading


class CaptureDataset(torch.utils.data.Dataset):
    """All samples of a capture directory, one conversation per item.

    ``CaptureDataset(capture_dir)`` reads the train split, ``CaptureDataset(capture_dir,
    split="heldout")`` the held-out one. Pass the target's ``hidden_size`` / ``vocab_size``
    (or ``model=`` our Transformer / its ModelConfig) to refuse a capture made for another
    model. Items are dicts::

        input_ids  [T] int64     loss_mask [T] bool
        hidden     [T, H]        aux       [T, k*H] (only when the capture kept aux states;
                                           neither in an online-mode capture, see has_states)
        sample_id  int           index     int (position in this dataset)

    Tensors keep the store dtype (bf16 by default); files are memory-mapped and opened lazily
    per process, so the dataset works with DataLoader workers.
    """

    def __init__(self, path: str | os.PathLike, split: str = "train", *, hidden_size: int | None = None,
                 vocab_size: int | None = None, model: Any = None, model_name: str | None = None,
                 require_aux: bool = False, require_complete: bool = False):
        root = Path(path)
        if split not in ("train", "heldout"):
            raise UserError(f"unknown capture split '{split}': use train or heldout")
        self.path = root / HELDOUT_SUBDIR if split == "heldout" else root
        self.split = split
        self.manifest = read_manifest(self.path)
        m = self.manifest
        if model is not None:
            cfg = getattr(model, "config", model)
            hidden_size = hidden_size or cfg.hidden_size
            vocab_size = vocab_size or cfg.vocab_size
        problems = []
        if hidden_size is not None and m["hidden_size"] != hidden_size:
            problems.append(f"hidden size {m['hidden_size']} != {hidden_size}")
        if vocab_size is not None and m["vocab_size"] != vocab_size:
            problems.append(f"vocab size {m['vocab_size']} != {vocab_size}")
        if problems:
            raise UserError(
                f"capture {self.path} was made for model '{m.get('model_name')}' and does not fit "
                f"this target ({'; '.join(problems)}): capture again for this model")
        if model_name is not None and m.get("model_name") != model_name:
            warnings.warn(f"capture {self.path} was made for '{m.get('model_name')}', "
                          f"not '{model_name}' (shapes match; using it)", stacklevel=2)
        if require_aux and not m.get("aux_layer_ids"):
            raise UserError(f"capture {self.path} has no EAGLE-3 aux hidden states "
                            f"(captured with capture.aux_layers=[]): capture again with aux layers")
        if require_complete and not m.get("complete"):
            raise UserError(f"capture {self.path} is incomplete ({self.num_samples_done()} of "
                            f"{m.get('planned')} samples): run stage=capture again to finish it")
        self.hidden_size = m["hidden_size"]
        self.vocab_size = m["vocab_size"]
        self.aux_layer_ids = list(m.get("aux_layer_ids") or [])
        self.dtype = store_dtype(m["store_dtype"])
        self.has_states = bool(m.get("states", True))  # False: online mode, tokens only
        self._shards: list[str] = []
        self._index: list[tuple[int, int]] = []  # (shard, row within the shard)
        self.sample_ids: list[int] = []
        for si, sh in enumerate(m["shards"]):
            if not (self.path / sh["file"]).is_file():
                raise UserError(f"capture {self.path}: shard {sh['file']} listed in the manifest is "
                                f"missing")
            self._shards.append(sh["file"])
            for row, sid in enumerate(sh["sample_ids"]):
                self._index.append((si, row))
                self.sample_ids.append(int(sid))
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    # -- bookkeeping ----------------------------------------------------------------------
    def num_samples_done(self) -> int:
        return sum(s["samples"] for s in self.manifest["shards"])

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for s in self.manifest["shards"])

    @property
    def num_assistant_tokens(self) -> int:
        return sum(s["assistant_tokens"] for s in self.manifest["shards"])

    def __len__(self) -> int:
        return len(self._index)

    def __getstate__(self):  # file handles do not pickle: reopen in each worker
        state = dict(self.__dict__)
        state["_handles"], state["_offsets"] = {}, {}
        return state

    def _open(self, si: int):
        h = self._handles.get(si)
        if h is None:
            h = safe_open(str(self.path / self._shards[si]), framework="pt")
            self._handles[si] = h
            self._offsets[si] = h.get_tensor("offsets")
        return h

    def _span(self, i: int) -> tuple[Any, int, int]:
        si, row = self._index[i]
        h = self._open(si)
        off = self._offsets[si]
        return h, int(off[row]), int(off[row + 1])

    def lengths(self) -> list[int]:
        """Tokens per sample (for length-bucketed batching), read from the offsets only."""
        out = []
        for si in range(len(self._shards)):
            self._open(si)
            out.extend(self._offsets[si].diff().tolist())
        return out

    # -- items ------------------------------------------------------------------------------
    def __getitem__(self, i: int) -> dict:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        h, a, b = self._span(i)
        item = {
            "input_ids": h.get_slice("input_ids")[a:b].long(),
            "loss_mask": h.get_slice("loss_mask")[a:b].bool(),
            "sample_id": self.sample_ids[i],
            "index": i,
        }
        if self.has_states:
            item["hidden"] = h.get_slice("hidden")[a:b]
            if self.aux_layer_ids:
                item["aux"] = h.get_slice("aux")[a:b]
        return item

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) of sample i without reading its hidden states."""
        h, a, b = self._span(i)
        return h.get_slice("input_ids")[a:b].long(), h.get_slice("loss_mask")[a:b].bool()

    def iter_token_shards(self):
        """Yield (input_ids [N], loss_mask [N]) per shard: the whole capture's tokens, cheaply."""
        for si in range(len(self._shards)):
            h = self._open(si)
            yield h.get_tensor("input_ids").long(), h.get_tensor("loss_mask").bool()

    def conversation(self, i: int) -> list[dict] | None:
        """The rendered conversation (messages, with the regenerated answers) of sample i."""
        si, row = self._index[i]
        meta = self._open(si).metadata() or {}
        convs = json.loads(meta.get("conversations", "[]"))
        return convs[row] if row < len(convs) else None


class CaptureSet(torch.utils.data.ConcatDataset):
    """The train splits of several captures of one target, read as one dataset.

    For growing the data with a second kind of capture (say teacher-forced ShareGPT answers
    beside the on-policy ones) without capturing again: every part must fit the same target
    and hold the same aux layers and store dtype. ``manifest`` is the first part's with the
    shards of all parts, so totals and fingerprints count everything; ``index`` in an item is
    its position in the whole set.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], **kw: Any):
        if not paths:
            raise UserError("CaptureSet needs at least one capture directory")
        parts = [CaptureDataset(p, **kw) for p in paths]
        first = parts[0]
        for p in parts[1:]:
            for key in ("hidden_size", "vocab_size", "aux_layer_ids", "dtype", "has_states"):
                if getattr(p, key) != getattr(first, key):
                    raise UserError(f"captures {first.path} and {p.path} differ in {key} "
                                    f"({getattr(first, key)} vs {getattr(p, key)}): train on captures "
                                    f"of one target with the same capture.aux_layers, store_dtype "
                                    f"and store_states")
        super().__init__(parts)
        self.parts = parts
        self.path = first.path
        self.hidden_size, self.vocab_size = first.hidden_size, first.vocab_size
        self.aux_layer_ids, self.dtype = first.aux_layer_ids, first.dtype
        self.has_states = first.has_states
        self.manifest = merged_manifest([p.manifest for p in parts])

    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.parts)

    @property
    def num_assistant_tokens(self) -> int:
        return sum(p.num_assistant_tokens for p in self.parts)

    def lengths(self) -> list[int]:
        return [n for p in self.parts for n in p.lengths()]

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        item["index"] = i if i >= 0 else i + len(self)
        return item


def merged_manifest(manifests: Sequence[dict]) -> dict:
    """The first manifest with the shards (and completeness) of all: what a CaptureSet reads."""
    out = dict(manifests[0])
    out["shards"] = [s for m in manifests for s in m.get("shards", [])]
    out["complete"] = all(bool(m.get("complete")) for m in manifests)
    return out


def pad_collate(batch: Sequence[dict], pad_id: int = 0) -> dict:
    """Right-pad a list of CaptureDataset items into a batch (adds ``attention_mask``)."""
    T = max(len(x["input_ids"]) for x in batch)
    B = len(batch)
    out: dict[str, Any] = {
        "input_ids": torch.full((B, T), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "attention_mask": torch.zeros(B, T, dtype=torch.bool),
        "sample_id": torch.tensor([x["sample_id"] for x in batch]),
    }
    for key in ("hidden", "aux"):
        if key in batch[0]:
            first = batch[0][key]
            out[key] = torch.zeros(B, T, first.shape[-1], dtype=first.dtype)
    for b, x in enumerate(batch):
        n = len(x["input_ids"])
        out["input_ids"][b, :n] = x["input_ids"]
        out["loss_mask"][b, :n] = x["loss_mask"]
        out["attention_mask"][b, :n] = True
        for key in ("hidden", "aux"):
            if key in out:
                out[key][b, :n] = x[key]
    return out
