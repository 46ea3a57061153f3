"""Plain (non-speculative) continuous-batching decoder: the server's `--speculative-algorithm NONE`.

Same interface as `SpecDecoder` (check / add / add_many / step / cancel / free_rows / seqs /
stats), so the server drives either one. Row r of the target's KV cache holds active sequence
r; a sequence joins by prefilling its prompt into the next free row (sequences joining together
share a forward per group of similar lengths) and leaves by moving the last row into its place.

State per active row:
    L[r]     tokens in the cache (the prompt and all outputs but the newest)
    last[r]  the newest output token, not yet in the cache (the next step's input)

`warm_up` compiles either decoder's graphs for every batch bucket before it serves (the server's
start-up, the bench's untimed warm-up at batch > 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from eagle_infer.generate import (
    batch_bucket,
    compiled_cache_rows,
    compiled_decode,
    compiled_kv_len,
    kv_len_for,
    pick_tokens,
    prefill,
)
from eagle_infer.model import Transformer, causal_mask
from eagle_infer.prefix_cache import PrefixRows
from eagle_infer.sampling import SamplingParams, grammar_bitmask, graph_settings, step_uniforms
from eagle_infer.speculative import (
    RowTable,
    Sequence_,
    SpecDecoder,
    SpecStats,
    check_admissible,
    join_order,
    penalize_seqs,
    prefill_rows,
)


class PlainDecoder:
    """One token per sequence per step, for all active sequences at once."""

    def __init__(self, target: Transformer, max_batch: int = 1, max_seq_len: int | None = None,
                 prefix_cache: bool = False):
        """prefix_cache: a prompt that starts with tokens a row holds (the last sequence of a free
        row, or an active one) takes those slots over and prefills the rest (eagle_infer.prefix_cache)."""
        self.target, self.max_batch = target, max_batch
        self.max_seq_len = max_seq_len or min(target.config.max_position_embeddings, 4096)
        target.setup_cache(max_batch, self.max_seq_len)
        self.device = target.embed_tokens.weight.device
        self.L = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.last = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.rows = RowTable(max_batch, [target], [self.L, self.last],
                             PrefixRows(0) if prefix_cache else None)
        self.seqs = self.rows.seqs
        self.cancel = self.rows.cancel
        self.stats = SpecStats()  # rounds only: nothing is drafted
        self.compiled_step, self.max_bs = None, 0

    def compile(self, mode: str | None = None, max_bs: int | None = None) -> PlainDecoder:
        """Run each step (forward + argmax) as a compiled graph per batch bucket
        (CompiledDecode; batches whose bucket is over max_bs, default the bucket of max_batch,
        run eagerly). On CUDA, mode="reduce-overhead" replays CUDA graphs."""
        if self.seqs:
            raise RuntimeError("compile a decoder before any sequence joins")
        self.max_bs = batch_bucket(self.max_batch) if max_bs is None else max_bs
        self.target.setup_cache(compiled_cache_rows(self.max_batch, self.max_bs), self.max_seq_len)
        if self.rows.prefix is not None:
            self.rows.prefix.clear()
        self.compiled_step = compiled_decode(self.target, mode)
        return self

    @property
    def compiled(self) -> bool:
        return self.compiled_step is not None

    @property
    def free_rows(self) -> int:
        return self.rows.free

    def check(self, seq: Sequence_) -> None:
        """A UserError unless the sequence's prompt and max_new_tokens fit."""
        check_admissible(self.target, seq, self.max_seq_len, "decoding")

    def add(self, seq: Sequence_) -> None:
        """Prefill a new sequence into the next free row; its first token is emitted."""
        self.add_many([seq])

    @torch.no_grad()
    def add_many(self, seqs: Sequence[Sequence_]) -> None:
        """Prefill sequences joining together into the next free rows, a forward per group of
        similar prompt lengths (join_groups); each one's first token is emitted."""
        if len(seqs) > self.rows.free:
            raise RuntimeError(f"{len(seqs)} sequences join but {self.rows.free} rows are free")
        for seq in seqs:
            self.check(seq)
        for group, reuse in join_order(self.rows, seqs):
            self._join(group, reuse)

    def _join(self, seqs: Sequence[Sequence_], reuse: bool = False) -> None:
        row0, k = len(self.seqs), len(seqs)
        starts = self.rows.claim(seqs, reuse)
        lens = torch.tensor([len(s.prompt) for s in seqs], device=self.device)
        firsts, _ = prefill_rows(self.target, seqs, row0, kv_len_for(int(lens.max()), self.max_seq_len),
                                 start=starts)
        self.L[row0:row0 + k], self.last[row0:row0 + k] = lens, torch.tensor(firsts, device=self.device)
        for s in seqs:
            s.cached = len(s.prompt)
        self.rows.admit_many(seqs, firsts)

    @torch.no_grad()
    def prefill_chunk(self, seq: Sequence_, size: int) -> int:
        """Chunked prefill (SpecDecoder.prefill_chunk's, the target's part)."""
        row, done = self.rows.chunk_row(seq)
        end = done + size
        prefill(self.target, [seq.prompt[:end]], row0=row, kv_len=kv_len_for(end, self.max_seq_len),
                max_new_tokens=[len(seq.prompt) - end + seq.max_new_tokens], start=[done], logits=False)
        self.rows.chunk_done(seq, row, end)
        return end

    @torch.no_grad()
    def step(self) -> list[tuple[Sequence_, list[int]]]:
        """One token for every active sequence; returns (sequence, new tokens)."""
        B = len(self.seqs)
        if B == 0:
            return []
        L = self.L[:B]
        L_max = max(s.cached for s in self.seqs)  # = L.max(), from the host: no read
        params, gens = [s.params for s in self.seqs], [s.generator for s in self.seqs]
        # the graph's token is every row's: the argmax (among what each row's grammar allows), or
        # each row's draw (temperature and min-p alone)
        argmax = all(p.graph_argmax for p in params)
        drawn = not argmax and all(p.graph_distribution for p in params)
        if self.compiled_step is not None and batch_bucket(B) <= self.max_bs:
            kv = compiled_kv_len(L_max + 1, self.max_seq_len, self.compiled_step.mode)
            matchers = [s.matcher for s in self.seqs]
            bitmask = grammar_bitmask(matchers, self.target.config.vocab_size, self.device)
            sampling = (*graph_settings(params, self.device), step_uniforms(params, gens, self.device)) \
                if drawn else None
            logits, chosen = self.compiled_step(self.last[:B], L, kv, bitmask, sampling)
            logits = logits[:, None]
        else:
            mask = causal_mask(L, 1, kv_len_for(L_max + 1, self.max_seq_len))
            logits, _ = self.target(self.last[:B, None], L[:, None], L[:, None], mask)
            chosen = None
        if chosen is not None and (argmax or drawn):
            nxt = chosen
        else:  # chosen: the argmax, the greedy rows' token
            picked = penalize_seqs(logits, self.seqs)
            nxt = pick_tokens(picked[:, 0], params, gens, chosen if picked is logits else None)
        self.L[:B] += 1
        self.last[:B] = nxt
        results = []
        for b, (seq, t) in enumerate(zip(self.seqs, nxt.tolist())):
            seq.cached += 1
            seq.set_logits(logits[b])  # logprobs (when asked): the logits this token came from
            results.append((seq, seq.emit([t])))
        self.stats.rounds += 1
        self.rows.drop_finished()
        return results


def warm_up_sizes(dec: PlainDecoder | SpecDecoder) -> list[int]:
    """The batch sizes warm_up runs: one per batch bucket up to the decoder's max_bs (at most
    max_batch), and with a batch tree the batches on either side of its first batch (a bucket
    may hold both trees)."""
    buckets = [b for b in range(1, dec.max_bs + 1) if batch_bucket(b) == b]
    sizes = {min(b, dec.max_batch) for b in buckets}  # a size per bucket the server reaches
    batch_tree = getattr(dec, "batch_tree", None)  # SpecDecoder only
    if batch_tree:
        sizes |= {n for n in (batch_tree[0] - 1, batch_tree[0]) if n <= min(dec.max_bs, dec.max_batch)}
    return sorted(sizes)


def warm_up(dec: PlainDecoder | SpecDecoder,
            progress: Callable[[int, list[int], float], None] | None = None,
            sizes: list[int] | None = None) -> list[int]:
    """Compile every batch bucket's graphs before serving: a bucket's first step compiles them
    (tens of seconds a graph on a 2-core CPU), which would otherwise stall the first requests
    that reach it. Runs a 4-token prompt for two tokens at each bucket up to the decoder's
    max_bs, greedy, sampled at a temperature, then with top-p (a plain decoder's step at a
    temperature draws its tokens in a graph of its own; a speculative decoder runs a greedy
    round's verify to catch-up, and the next round's draft phase, as one graph; a round sampled
    at a temperature (and min-p) as one too; one with top-p, top-k or penalties as two, its
    distributions made eagerly between), then resets the
    statistics; at a batch that runs rounds without drafts, long enough for the head's deferred
    catch-up (max_pending + 2 tokens), whose graph is its own. The batch sizes are
    warm_up_sizes' (or `sizes`); returns them. progress(size, sizes, seconds) after each (the
    server logs it: a first start compiles for minutes on a 2-core CPU)."""
    sizes = warm_up_sizes(dec) if sizes is None else sizes
    disable = getattr(dec, "disable_by_batch_size", None)
    # a decoder with paths the warm-up's requests would not all take (NgramDecoder: a verify,
    # a plain step) runs them once per pass it sets up (warm_up_passes)
    passes = getattr(dec, "warm_up_passes", lambda: [None])
    for n in sizes:
        t0 = time.perf_counter()
        tokens = dec.max_pending + 2 if disable is not None and n > disable else 2
        for _ in passes():
            for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=0),
                           SamplingParams(temperature=1.0, top_p=0.9, seed=0)):
                dec.add_many([Sequence_([1, 2, 3, 4], params, tokens, set()) for _ in range(n)])
                while dec.seqs:
                    dec.step()
        if progress is not None:
            progress(n, sizes, time.perf_counter() - t0)
    dec.stats = SpecStats()
    return sizes
