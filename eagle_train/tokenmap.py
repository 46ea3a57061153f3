"""FR-Spec token maps and the EAGLE-3 draft vocabulary, mined from token frequencies.

Both shrink the draft head's output layer to the tokens the target actually emits: an FR-Spec
map slices the rows of an EAGLE-2 draft's (shared) lm_head at serving time, an EAGLE-3 draft
trains its own lm_head over a reduced vocabulary and ships the `d2t` / `t2d` index tensors.
File formats follow SGLang / the EAGLE-3 reference checkpoints (see reference.md, section 4):

- FR-Spec map: ``torch.save`` of a plain Python list of target ids, most frequent first, EOS
  forced in; consumers run ``torch.tensor(torch.load(path))``.
- ``d2t``: int64 [draft_vocab_size], ``target_id = draft_id + d2t[draft_id]``, draft ids
  sorted by target id; ``t2d``: bool [vocab], true for target ids in the draft vocabulary.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle_infer.errors import UserError

# Tokens buffered before one bincount: per-sequence bincounts over a 100k+ vocabulary would
# cost more than the counting itself.
_FLUSH_TOKENS = 1 << 20


def _is_single_sequence(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dim() <= 1
    if isinstance(x, Sequence) and not isinstance(x, str | bytes):
        return len(x) == 0 or isinstance(x[0], numbers.Integral)
    return False


def _sequences(x: Any) -> Iterable[Any]:
    if _is_single_sequence(x):
        return [x]
    if isinstance(x, torch.Tensor):
        if x.dim() != 2:
            raise ValueError(f"token ids tensor must be 1-D or 2-D, got shape {tuple(x.shape)}")
        return list(x)
    return x


def _eos_list(eos_token_ids: int | Iterable[int] | None, vocab_size: int) -> list[int]:
    if eos_token_ids is None:
        return []
    ids = [eos_token_ids] if isinstance(eos_token_ids, numbers.Integral) else list(eos_token_ids)
    out: list[int] = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= int(i) < vocab_size:
            raise UserError(f"EOS token id {i!r} is not a token id of a vocabulary of {vocab_size}")
        if int(i) not in out:
            out.append(int(i))
    return out


def count_tokens(token_ids: Any, loss_mask: Any = None, *, vocab_size: int) -> torch.LongTensor:
    """Occurrences of every token id, optionally counting only positions where the mask is 1.

    ``token_ids`` is one sequence (list / 1-D tensor) or an iterable of them (a 2-D tensor
    counts row by row); ``loss_mask`` has the same shape. The draft vocabulary should be mined
    on what the head must predict, i.e. the loss-masked assistant tokens, not the prompts.
    """
    if vocab_size <= 0:
        raise UserError(f"vocab_size must be positive, got {vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    seqs = _sequences(token_ids)
    masks = None if loss_mask is None else iter(_sequences(loss_mask))
    buffer: list[torch.Tensor] = []
    buffered = 0

    def flush() -> None:
        nonlocal buffer, buffered
        if buffer:
            flat = torch.cat(buffer)
            counts.add_(torch.bincount(flat, minlength=vocab_size))
            buffer, buffered = [], 0

    for n, seq in enumerate(seqs):
        ids = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
        if masks is not None:
            try:
                m = torch.as_tensor(next(masks)).reshape(-1).bool()
            except StopIteration:
                raise ValueError(f"loss_mask has fewer sequences than token_ids ({n})") from None
            if m.numel() != ids.numel():
                raise ValueError(f"sequence {n}: {ids.numel()} token ids but {m.numel()} mask values")
            ids = ids[m]
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise UserError(
                    f"sequence {n}: token id {bad} outside the vocabulary [0, {vocab_size}): "
                    "counts must use the target model's vocab_size"
                )
            buffer.append(ids)
            buffered += ids.numel()
            if buffered >= _FLUSH_TOKENS:
                flush()
    flush()
    return counts


def count_corpus(
    tokenizer, texts: Iterable[str], vocab_size: int | None = None, batch_size: int = 256
) -> torch.LongTensor:
    """Token counts of any text corpus, the way FR-Spec mined its maps.

    ``vocab_size`` defaults to ``len(tokenizer)``; pass the target model's vocab_size when its
    embedding is padded beyond the tokenizer, so the counts index the model's rows.
    """
    vocab = vocab_size if vocab_size is not None else len(tokenizer)
    counts = torch.zeros(vocab, dtype=torch.long)
    batch: list[str] = []

    def flush() -> None:
        if batch:
            enc = tokenizer(batch, add_special_tokens=False)["input_ids"]
            counts.add_(count_tokens(enc, vocab_size=vocab))
            batch.clear()

    for text in texts:
        if not isinstance(text, str):
            raise UserError(f"corpus entries must be strings, got {type(text).__name__}")
        batch.append(text)
        if len(batch) >= batch_size:
            flush()
    flush()
    return counts


def _counts_1d(counts: Any) -> torch.Tensor:
    c = torch.as_tensor(counts)
    if c.dim() != 1 or c.numel() == 0:
        raise ValueError(f"counts must be a non-empty 1-D tensor, got shape {tuple(c.shape)}")
    return c


def frspec_token_map(counts: Any, size: int, eos_token_ids: int | Iterable[int] | None) -> list[int]:
    """The ``size`` most frequent target ids, most frequent first (ties: lower id first).

    EOS ids are always included even when rare in the counts: a draft that cannot propose EOS
    can never end a turn early, which costs a verify round at the end of every answer.
    """
    c = _counts_1d(counts)
    vocab = c.numel()
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size <= 0:
        raise UserError(f"token map size must be a positive integer, got {size!r}")
    if size > vocab:
        raise UserError(f"token map size {size} exceeds the vocabulary size {vocab}")
    eos = _eos_list(eos_token_ids, vocab)
    if len(eos) > size:
        raise UserError(f"token map size {size} cannot hold the {len(eos)} EOS ids {eos}")
    # A stable sort keeps ascending id order among equal counts.
    order = torch.sort(c, descending=True, stable=True).indices
    chosen = torch.zeros(vocab, dtype=torch.bool)
    if eos:
        chosen[torch.tensor(eos)] = True
    rest = order[~chosen[order]]
    chosen[rest[: size - len(eos)]] = True
    return order[chosen[order]].tolist()


def save_token_map(ids: Iterable[int], path: str | os.PathLike) -> None:
    """Write an FR-Spec map as SGLang reads it: ``torch.save`` of a plain list of ints."""
    ids = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ids, path)


def load_token_map(path: str | os.PathLike, vocab_size: int) -> torch.LongTensor:
    """Read and validate an FR-Spec map; a wrong map otherwise fails late as an index error.

    Accepts a list of ints or a 1-D integer tensor; every id must lie in [0, vocab_size) and
    appear once.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"token map not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"token map {path} is not a torch.save file: {e}") from e
    if isinstance(obj, torch.Tensor):
        if obj.dim() != 1 or obj.is_floating_point() or obj.is_complex() or obj.dtype == torch.bool:
            raise UserError(
                f"token map {path}: expected a 1-D integer tensor, "
                f"got {obj.dtype} of shape {tuple(obj.shape)}"
            )
        ids = obj.tolist()
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise UserError(f"token map {path}: entry {i} is {v!r}, not a token id")
        ids = [int(v) for v in obj]
    else:
        raise UserError(f"token map {path}: expected a list of token ids, got {type(obj).__name__}")
    if not ids:
        raise UserError(f"token map {path} is empty")
    seen: set[int] = set()
    for i, v in enumerate(ids):
        if not 0 <= v < vocab_size:
            raise UserError(
                f"token map {path}: id {v} at position {i} is outside the target vocabulary [0, {vocab_size})"
            )
        if v in seen:
            raise UserError(f"token map {path}: id {v} appears more than once (again at position {i})")
        seen.add(v)
    return torch.tensor(ids, dtype=torch.long)


def draft_vocab(
    counts: Any, draft_vocab_size: int, eos_token_ids: int | Iterable[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3 draft vocabulary as ``(d2t, t2d)``: the most frequent ids, EOS forced in.

    Draft ids are the chosen target ids in ascending order, so ``d2t`` holds the non-negative
    offset ``target_id - draft_id`` (the layout SGLang and the reference checkpoints expect).
    """
    c = _counts_1d(counts)
    chosen = sorted(frspec_token_map(c, draft_vocab_size, eos_token_ids))
    target = torch.tensor(chosen, dtype=torch.long)
    d2t = target - torch.arange(len(chosen), dtype=torch.long)
    t2d = torch.zeros(c.numel(), dtype=torch.bool)
    t2d[target] = True
    return d2t, t2d


def coverage(counts: Any, ids: Any) -> float:
    """Share of the counted tokens that ``ids`` covers: the best-case hit rate of a map."""
    c = _counts_1d(counts)
    total = float(c.sum())
    if total == 0:
        return 0.0
    idx = torch.unique(torch.as_tensor(ids, dtype=torch.long).reshape(-1))
    return float(c[idx].sum()) / total


def mine_token_maps(
    counts: Any,
    sizes: Iterable[int],
    out_dir: str | os.PathLike,
    model_name: str,
    eos_token_ids: int | Iterable[int] | None,
    draft_vocab_size: int | None,
) -> dict:
    """Write the FR-Spec maps of every size, the EAGLE-3 draft vocab and a coverage summary.

    Layout: ``<out_dir>/<model_name>/frspec_<size>.pt``, ``d2t_t2d_<draft_vocab_size>.safetensors``
    (keys ``d2t``, ``t2d``) and ``summary.json``. Sizes not smaller than the vocabulary are
    skipped with a note (such a map would select every token and save nothing). A '/' in
    ``model_name`` (hub ids) becomes '--' so the folder stays one level deep.
    Returns the summary: ``{"model", "vocab_size", "total_tokens", "coverage": {size: share},
    "draft_vocab_coverage": {size: share}, "files": [...], "skipped_sizes": [...]}``.
    """
    from safetensors.torch import save_file

    c = _counts_1d(counts).long()
    vocab = c.numel()
    total = int(c.sum())
    if total == 0:
        raise UserError("no tokens were counted: cannot mine token maps from an empty corpus")
    folder = Path(out_dir) / model_name.replace("/", "--")
    folder.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "model": model_name,
        "vocab_size": vocab,
        "total_tokens": total,
        "coverage": {},
        "draft_vocab_coverage": {},
        "files": [],
        "skipped_sizes": [],
    }
    rows = []
    for size in sorted({int(s) for s in sizes}):
        if size >= vocab:
            print(f"note: token map size {size} >= vocabulary {vocab}: skipped (it would keep every token)")
            summary["skipped_sizes"].append(size)
            continue
        ids = frspec_token_map(c, size, eos_token_ids)
        path = folder / f"frspec_{size}.pt"
        save_token_map(ids, path)
        cov = coverage(c, ids)
        summary["coverage"][str(size)] = cov
        summary["files"].append(str(path))
        rows.append((f"frspec {size}", cov, path))
    if draft_vocab_size is not None:
        if draft_vocab_size > vocab:
            raise UserError(f"draft_vocab_size {draft_vocab_size} exceeds the vocabulary size {vocab}")
        d2t, t2d = draft_vocab(c, draft_vocab_size, eos_token_ids)
        path = folder / f"d2t_t2d_{draft_vocab_size}.safetensors"
        save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(path))
        cov = coverage(c, torch.nonzero(t2d).flatten())
        summary["draft_vocab_coverage"][str(draft_vocab_size)] = cov
        summary["files"].append(str(path))
        rows.append((f"draft vocab {draft_vocab_size}", cov, path))
    with open(folder / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    print(f"token coverage for {model_name} ({total:,} counted tokens, vocabulary {vocab}):")
    for label, cov, path in rows:
        print(f"  {label:<18} {cov:7.2%}  {path}")
    return summary
