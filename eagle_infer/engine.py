"""Plain (non-speculative) continuous-batching decoder: the server's `--speculative-algorithm NONE`.

Same interface as `SpecDecoder` (add / step / cancel / free_rows / seqs / stats), so the server
drives either one. Row r of the target's KV cache holds active sequence r; a sequence joins by
prefilling its prompt into the next free row and leaves by moving the last row into its place.

State per active row:
    L[r]     tokens in the cache (the prompt and all outputs but the newest)
    last[r]  the newest output token, not yet in the cache (the next step's input)
"""

from __future__ import annotations

import torch

from eagle_infer.generate import kv_len_for, pick_tokens
from eagle_infer.model import Transformer, causal_mask
from eagle_infer.speculative import RowTable, Sequence_, SpecStats, prefill_row


class PlainDecoder:
    """One token per sequence per step, for all active sequences at once."""

    def __init__(self, target: Transformer, max_batch: int = 1, max_seq_len: int | None = None):
        self.target, self.max_batch = target, max_batch
        self.max_seq_len = max_seq_len or min(target.config.max_position_embeddings, 4096)
        target.setup_cache(max_batch, self.max_seq_len)
        self.device = target.embed_tokens.weight.device
        self.L = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.last = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.rows = RowTable(max_batch, [target], [self.L, self.last])
        self.seqs = self.rows.seqs
        self.cancel = self.rows.cancel
        self.stats = SpecStats()  # rounds only: nothing is drafted

    @property
    def free_rows(self) -> int:
        return self.rows.free

    @torch.no_grad()
    def add(self, seq: Sequence_) -> None:
        """Prefill a new sequence into the next free row; its first token is emitted."""
        row = self.rows.next_row()
        P = len(seq.prompt)
        first, _, _ = prefill_row(self.target, seq, row, self.max_seq_len, kv_len_for(P, self.max_seq_len))
        self.L[row], self.last[row] = P, first
        self.rows.admit(seq, first)

    @torch.no_grad()
    def step(self) -> list[tuple[Sequence_, list[int]]]:
        """One token for every active sequence; returns (sequence, new tokens)."""
        B = len(self.seqs)
        if B == 0:
            return []
        L = self.L[:B]
        mask = causal_mask(L, 1, kv_len_for(int(L.max()) + 1, self.max_seq_len))
        logits, _ = self.target(self.last[:B, None], L[:, None], L[:, None], mask)
        nxt = pick_tokens(logits[:, 0], [s.params for s in self.seqs], [s.generator for s in self.seqs])
        self.L[:B] += 1
        self.last[:B] = nxt
        results = [(seq, seq.emit([t])) for seq, t in zip(self.seqs, nxt.tolist())]
        self.stats.rounds += 1
        self.rows.drop_finished()
        return results
