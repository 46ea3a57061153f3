"""Prefix caching across requests, at the grain of a cache row.

A sequence that leaves keeps its row's keys and values (the decoders swap it to the end of the
active rows instead of overwriting it), and a new prompt that starts with tokens some row holds
(a free row's last sequence, or an active row's) takes those slots over and prefills only the
rest: a chat's next turn (its history is the last turn's prompt and answer), a shared system
prompt, few-shot examples. What vLLM's automatic prefix caching and SGLang's radix cache do with
paged blocks, here with whole rows, which the runtime's one-row-per-sequence cache already has:
free rows are the store, and no block table enters the compiled steps.

A row's slot i holds the target's KV of token i; a speculative decoder's head also keeps there its
pair (feature i, token i + 1), so its slots are valid one token less far (`lookahead` 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_HIT = 16  # fewer shared slots are prefilled again: a join of its own costs more (vLLM's block)
PINNED = 1 << 62  # Held.left of a prompt being prefilled in chunks: the last a free row gives up


@dataclass
class Held:
    """What a row holds: tokens in slot order, of which the first `valid` slots' KV is theirs;
    `left`: when its sequence left (PrefixRows.clock), the least recent is overwritten first."""

    tokens: list[int]
    valid: int
    left: int = 0


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b have in common."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PrefixRows:
    """The free rows' contents (`held`, by row) and the choice of a new prompt's source row.
    Counts tokens queried and hit, as vLLM's prefix_cache_queries / prefix_cache_hits."""

    def __init__(self, lookahead: int):
        self.lookahead = lookahead
        self.held: dict[int, Held] = {}
        self.queries = self.hits = self.clock = 0

    def held_by(self, tokens: list[int], cached: int, pending: int = 0) -> Held:
        """A sequence's row: `cached` slots written, the head `pending` of them behind."""
        return Held(tokens, max(0, min(cached - pending, len(tokens) - self.lookahead)))

    def pin(self, row: int, held: Held) -> None:
        """`row` holds the first chunks of a prompt not yet joined (chunked prefill): free rows
        give it up last. One at a time: an earlier one (its request gone) is unpinned."""
        for other in self.held.values():
            self.unpin(other)
        held.left = PINNED
        self.held[row] = held

    def unpin(self, held: Held) -> None:
        """A pinned prompt's chunks (its request cancelled) stay as any free row's, the latest."""
        if held.left == PINNED:
            self.clock += 1
            held.left = self.clock

    def row_of(self, held: Held | None) -> int | None:
        """The free row that holds `held` now (rows swap), or None (overwritten, or taken)."""
        return next((r for r, h in self.held.items() if h is held), None)

    def keep(self, row: int, held: Held) -> None:
        """A sequence left `row`, which now holds its slots."""
        self.clock += 1
        held.left = self.clock
        self.held[row] = held

    def spare_for(self, row: int, free: Sequence[int]) -> int | None:
        """Where the slots `row` holds may go before a new sequence overwrites them: a row of
        `free` that holds nothing, else the one that holds the least recent sequence, if that
        one left before row's; None: row's are the least recent (or it holds nothing)."""
        mine = self.held.get(row)
        if mine is None:
            return None
        empty = [r for r in free if r not in self.held]
        if empty:
            return empty[0]
        oldest = min(free, key=lambda r: self.held[r].left, default=None)
        return oldest if oldest is not None and self.held[oldest].left < mine.left else None

    def reusable(self, held: Held, prompt: Sequence[int]) -> int:
        """Slots of `held` a sequence with this prompt can keep (at least one prompt token is
        prefilled again: its logits give the first output token)."""
        shared = shared_prefix(held.tokens, prompt)
        return min(held.valid, shared - self.lookahead, len(prompt) - 1)

    def best(self, prompt: Sequence[int], rows: dict[int, Held],
             row_ok: Callable[[int], bool] = lambda r: True) -> tuple[int | None, int]:
        """The row (of `rows`) with the longest reusable prefix of at least MIN_HIT slots, and that
        length; (None, 0) without one. row_ok: rows whose RoPE tables suit the prompt (LongRoPE)."""
        src, keep = None, MIN_HIT - 1
        for row, held in rows.items():
            n = self.reusable(held, prompt)
            if n > keep and row_ok(row):
                src, keep = row, n
        return (src, keep) if src is not None else (None, 0)

    def record(self, prompt_len: int, hit: int) -> None:
        self.queries += prompt_len
        self.hits += hit

    def clear(self) -> None:
        """The caches were made anew: nothing is held."""
        self.held.clear()
