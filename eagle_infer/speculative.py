"""Speculative decoding (EAGLE-2 / EAGLE-3) over our target runtime and a draft head.

State per active sequence (row r of both caches; rows 0..B-1 are the active ones):
    L[r]        committed tokens, in the target cache and (paired with features) the draft's
    root[r]     the next token, already sampled from the target, not yet in either cache
    root_g[r]   the draft's feature after the root;  root_logp[r]: its log-probs [V']
    pending_*[r] pairs of rounds without drafts the draft has not caught up on yet (pending_n[r])
    history[r]  its tokens in slot order, the root at L[r]: where the n-gram branch looks up

A round (`SpecDecoder.step`), for all active rows at once:
    draft_tree  -> tree of num_draft_tokens nodes (root first; the draft's candidates and the
                   n-gram branch's compete for them)                     num_steps-1 draft calls
    verify      -> one target forward over the tree, logits + features   1 target call
    accept      -> accepted path + bonus token (greedy or lossless rejection sampling)
    commit      -> keep the path's target KV; draft catch-up on the path  1 draft call
A round drafts the next round's tree at its end (draft ahead): the next root, its feature and
log-probs are known there, so the head runs on weights the catch-up has just read. Compiled, a
greedy round is one graph (verify to the next draft phase), a sampled one two (the verify; the
walk, commit, catch-up and next draft phase), the target's sampling distributions and each
row's uniforms (its own generator) made eagerly between. A round whose rows lack a tree drafted
ahead (a sequence just joined, or rounds without drafts came before) drafts first, in a graph
of its own.
A round without drafts (more than disable_by_batch_size sequences running) is the target's step
on each root alone, one graph; the draft catches up on such rounds' tokens later, in one call.
A sequence that finishes leaves the batch: the last row moves into its place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from eagle_infer.cpu_linears import compile_settings, step_options
from eagle_infer.errors import UserError
from eagle_infer.generate import (
    CUDA_GRAPHS,
    BucketedStep,
    batch_bucket,
    check_fits,
    compile_step,
    compiled_cache_rows,
    compiled_kv_len,
    join_groups,
    kv_len_for,
    prefill,
)
from eagle_infer.heads import DraftHead
from eagle_infer.kernels.tree_accept import kernel_available
from eagle_infer.model import Transformer, build_attn_mask, causal_mask
from eagle_infer.prefix_cache import MIN_HIT, Held, PrefixRows
from eagle_infer.sampling import (
    SamplingParams,
    every_token_bitmask,
    grammar_step,
    graph_probs,
    graph_settings,
    masked_greedy_tokens,
    next_token,
    node_paths,
    penalize,
)
from eagle_infer.tree import (
    Acceptance,
    DraftTree,
    TreeConfig,
    accept_greedy,
    accept_sampling,
    draft_tree,
    graft_chains,
    sampling_probs,
    sampling_uniforms,
    walk_sampling,
)

TokenLogprob = tuple[float, list[int], list[float]]  # a token's log-prob, the top ids, their log-probs


@dataclass
class Sequence_:
    """One request being decoded."""

    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    eos: set[int]
    on_token: Callable[[int], bool] | None = None  # returns True to stop (stop strings)
    output: list[int] = field(default_factory=list)
    done: bool = False
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    accepted: list[int] = field(default_factory=list)  # accepted drafts per round
    tag: object = None  # caller's handle (the server's request)
    cached: int = 0  # tokens in the caches (L of its row), known on the host: no read to size a step
    prefix_hit: int = 0  # prompt tokens whose slots it took over from another sequence (prefix_cache)
    partial: Any = None  # chunked prefill: what the free row holding its first chunks holds (Held)
    pending: int = 0  # plain rounds whose pair the draft head has not caught up on yet
    ahead: bool = False  # its row holds the next round's tree, drafted at the end of the last one
    ngrams: Any = None  # NgramDecoder's index of its tokens' n-grams (ngram.NgramIndex)
    # logprobs (the server's `logprobs`): None = not asked; k = per emitted token, its log-prob
    # under the raw target distribution and the k most likely alternatives. The decoders hand
    # emit() the target logits they already computed (set_logits); no extra forward.
    logprobs: int | None = None
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    # prompt logprobs (the server's echo with logprobs, as lm-eval's loglikelihood asks): k = each
    # prompt token's but the first, from the prefill's final states (score_prompt)
    prompt_logprobs: int | None = None
    prompt_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_token_ranks: list[int] = field(default_factory=list)  # each one's rank among the vocabulary
    matcher: Any = None  # the grammar's matcher (params.grammar: structured outputs), made at prefill
    _logits: Tensor | None = field(default=None, repr=False)

    def set_logits(self, logits: Tensor) -> None:
        """logprobs: the target's logits [n, V] in front of each of the next tokens emit() gets."""
        if self.logprobs is not None:
            self._logits = logits

    def emit(self, tokens: Sequence[int]) -> list[int]:
        """Append tokens until EOS / stop / length; returns what was actually appended."""
        out = []
        for t in tokens:
            if self.done:
                break
            self.output.append(t)
            out.append(t)
            stop = self.on_token(t) if self.on_token else False
            if self.matcher is not None:  # the grammar's end (its stop token accepted) ends it too
                stop = grammar_step(self.matcher, t) or stop
            if t in self.eos or stop:
                self.done, self.finish_reason = True, "stop"
            elif len(self.output) >= self.max_new_tokens:
                self.done, self.finish_reason = True, "length"
        if self._logits is not None and out:  # logprobs
            self.token_logprobs += logprob_rows(self._logits[: len(out)], out, self.logprobs)
        self._logits = None
        return out

    def score_prompt(self, lm_head: Callable[[Tensor], Tensor], states: Tensor, chunk: int = 256) -> None:
        """prompt_logprobs from the target's final (normed) states [P, H] of the prompt: the
        log-prob of each prompt token after the first, the k most likely alternatives, and its
        rank (1 + the tokens likelier than it; vLLM's). Logits [chunk, V] at a time: a long
        prompt's [P, V] in fp32 would be hundreds of MB."""
        for i in range(0, len(self.prompt) - 1, chunk):
            nxt = self.prompt[i + 1:i + 1 + chunk]
            logits = lm_head(states[i:i + len(nxt)]).float()
            self.prompt_token_logprobs += logprob_rows(logits, nxt, self.prompt_logprobs)
            chosen = logits.gather(1, torch.tensor(nxt, device=logits.device)[:, None])
            self.prompt_token_ranks += (1 + (logits > chosen).sum(-1)).tolist()


def logprob_rows(logits: Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """logits [n, V] in front of n tokens -> per token (its log-prob, the k most likely ids, their
    log-probs), from one log_softmax, so a greedy token's log-prob equals the top one's exactly."""
    lp = torch.log_softmax(logits.float(), -1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    top = lp.topk(k, -1) if k else None
    return [(c, top.indices[i].tolist() if top else [], top.values[i].tolist() if top else [])
            for i, c in enumerate(chosen)]


@dataclass
class SpecStats:
    rounds: int = 0
    # accepted_hist[k]: (sequence, round) pairs that accepted k draft tokens. A histogram, not
    # a list of rounds, so a long-running server's stats stay a few integers.
    accepted_hist: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0  # verify and the graphs after it: acceptance, commit, catch-up, draft ahead
    other_s: float = 0.0
    draft_calls: int = 0  # draft forwards timed in draft_s (a round's catch-up is in verify_s)
    # rounds run without drafts (the batch over SpecDecoder's disable_by_batch_size): not in
    # accepted_hist, so tau stays the head's
    plain_rounds: int = 0

    def record(self, k: int, count: int = 1) -> None:
        if k >= len(self.accepted_hist):
            self.accepted_hist += [0] * (k + 1 - len(self.accepted_hist))
        self.accepted_hist[k] += count

    def merge(self, other: SpecStats) -> None:
        self.rounds += other.rounds
        for k, n in enumerate(other.accepted_hist):
            self.record(k, n)
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        self.other_s += other.other_s
        self.draft_calls += other.draft_calls
        self.plain_rounds += other.plain_rounds

    @property
    def row_rounds(self) -> int:
        return sum(self.accepted_hist)

    @property
    def accepted_tokens(self) -> int:
        return sum(k * n for k, n in enumerate(self.accepted_hist))

    def acceptance_length(self) -> float:
        """tau: accepted drafts + 1 (the bonus token) per verify round, averaged."""
        return 1.0 + self.accepted_tokens / max(1, self.row_rounds)

    def accept_rate_per_position(self, num_steps: int) -> list[float]:
        """P(draft position d accepted | position d-1 accepted), d = 1..num_steps."""
        rates, reached = [], self.row_rounds
        for d in range(1, num_steps + 1):
            got = sum(self.accepted_hist[d:])
            rates.append(got / reached if reached else 0.0)
            reached = got
        return rates


class RowTable:
    """Which sequence lives in which cache row, kept compact (rows 0..B-1 are the active ones,
    so every step runs on a plain [:B] slice): a sequence that leaves is replaced by the last
    one, whose cache rows (`models`: objects with a KVCache `cache`, the target first) and
    per-row state move with it. With a prefix cache (`prefix`), the two rows swap instead, so the
    one left free keeps the leaving sequence's slots, and a joining prompt takes over the longest
    prefix a row holds (prefix_cache). slack: slots past its cached tokens an active row may
    still read (its round's tree and drafts)."""

    def __init__(self, max_batch: int, models: Sequence, per_row: Sequence[Tensor],
                 prefix: PrefixRows | None = None, slack: int = 1):
        self.max_batch, self.models, self.per_row = max_batch, list(models), list(per_row)
        self.prefix, self.slack = prefix, slack
        self.seqs: list[Sequence_] = []

    @property
    def free(self) -> int:
        return self.max_batch - len(self.seqs)

    def next_row(self) -> int:
        if not self.free:
            raise RuntimeError("no free row: the batch is full")
        return len(self.seqs)

    def admit_many(self, seqs: Sequence[Sequence_], firsts: Sequence[int]) -> None:
        """Take sequences prefilled into the rows from next_row() on and emit each one's first
        token; a sequence that finished on that token leaves again at once."""
        for seq, first in zip(seqs, firsts):
            self.seqs.append(seq)
            seq.emit([first])
        self.drop_finished()

    def remove(self, row: int) -> None:
        last, seq = len(self.seqs) - 1, self.seqs[row]
        if row != last:  # only the slots the rows use
            n = self.seqs[last].cached + self.slack
            if self.prefix is None:  # the last row's move in
                for m in self.models:
                    m.cache.copy_prefix(last, row, min(n, m.cache.kv.shape[4]))
            else:  # and the leaving row's out, for the prefix cache
                for m in self.models:
                    m.cache.swap_rows(last, row, min(max(seq.cached, n), m.cache.kv.shape[4]))
            for t in self.per_row:
                t[row] = t[last]
            self.seqs[row] = self.seqs[last]
        if self.prefix is not None:
            self.prefix.keep(last, self.prefix.held_by(seq.prompt + seq.output, seq.cached, seq.pending))
        self.seqs.pop()

    def prefilled(self, seq: Sequence_) -> int:
        """Chunked prefill: how many of seq's prompt tokens a free row holds for it (0: none)."""
        if self.prefix is None or self.prefix.row_of(seq.partial) is None:
            return 0
        return seq.partial.valid

    def left_to_prefill(self, seq: Sequence_) -> int:
        """Prompt tokens seq's join would prefill now: past its chunks, or past the prefix it
        would take over (a chat's next turn has little left, however long its prompt)."""
        return len(seq.prompt) - max(self.prefilled(seq), self.prefix_hint(seq))

    def chunk_row(self, seq: Sequence_) -> tuple[int, int]:
        """Chunked prefill: the free row holding seq's first prompt tokens and how many; where
        none does, the last free row, holding the longest prefix of seq's prompt a row holds (a
        free row's swapped in, an active row's copied, as a join takes one over: a chat's next
        turn, a shared system prompt) and its length (seq.prefix_hit), else 0 (what the row
        held moved aside first, PrefixRows.spare_for)."""
        row = self.prefix.row_of(seq.partial)
        if row is not None:
            return row, seq.partial.valid
        row, active = self.max_batch - 1, len(self.seqs)
        if row < active:
            raise RuntimeError("chunked prefill needs a free row: the batch is full")
        src, hit = self._best(seq)
        if src is not None and src >= active:  # a free row's prefix: swapped in
            if src != row:
                self._swap_free(src, row)
        else:
            if (spare := self.prefix.spare_for(row, range(active, row))) is not None:
                self._swap_free(row, spare)
            if src is not None:  # an active row's: copied
                for m in self.models:
                    m.cache.copy_prefix(src, row, hit)
        self.prefix.held.pop(row, None)
        seq.prefix_hit = hit
        return row, hit

    def chunk_done(self, seq: Sequence_, row: int, end: int) -> None:
        """Row holds seq's first `end` prompt tokens now (the head's pairs too): pinned for its join."""
        seq.partial = Held(seq.prompt[:end + self.prefix.lookahead], end)
        self.prefix.pin(row, seq.partial)

    def _swap_free(self, a: int, b: int) -> None:
        """Exchange two free rows' slots and what each holds."""
        held = self.prefix.held
        n = max(h.valid for h in (held.get(a), held.get(b)) if h is not None)
        for m in self.models:
            m.cache.swap_rows(a, b, n)
        ha, hb = held.pop(a, None), held.pop(b, None)
        if hb is not None:
            held[a] = hb
        if ha is not None:
            held[b] = ha

    def _sources(self, row0: int) -> dict[int, Held]:
        """The rows a prompt joining at row0 may take a prefix from: free ones past it, active ones."""
        rows = {r: h for r, h in self.prefix.held.items() if r >= row0}
        for r, s in enumerate(self.seqs):
            rows[r] = self.prefix.held_by(s.prompt + s.output, s.cached, s.pending)
        return rows

    def _best(self, seq: Sequence_) -> tuple[int | None, int]:
        """The row whose prefix seq would take over if it joined now, and its length ((None, 0):
        none, no prefix cache, or a prompt scored for logprobs, which needs every state)."""
        if self.prefix is None or seq.prompt_logprobs is not None:
            return None, 0
        return self.prefix.best(seq.prompt, self._sources(len(self.seqs)), prefix_row_ok(self.models[0], seq))

    def prefix_hint(self, seq: Sequence_) -> int:
        """The prefix seq would take over if it joined now (0: none, or no prefix cache)."""
        return self._best(seq)[1]

    def claim(self, seqs: Sequence[Sequence_], reuse: bool = False) -> list[int]:
        """The rows from next_row() on for sequences about to be prefilled there. With reuse, a
        lone sequence takes over the longest prefix a row holds (a free row's is swapped in, an
        active row's copied). What the claimed rows held moves to free rows that hold less recent
        sequences (PrefixRows.spare_for), so the free rows keep the latest ones. Returns each
        one's slots already written (where its prefill starts)."""
        row0, starts = len(self.seqs), [0] * len(seqs)
        if self.prefix is None:
            return starts
        held, src = self.prefix.held, None
        if reuse and len(seqs) == 1:
            src, starts[0] = self._best(seqs[0])
        # its own chunks (chunked prefill) are not a hit of the prefix cache, the prefix they
        # started past is (chunk_row)
        own = src is not None and src >= row0 and held[src] is seqs[0].partial
        if src is not None and src > row0:  # a free row's: swap it in, keeping what row0 held
            self._swap_free(src, row0)
        free = range(row0 + len(seqs), self.max_batch)
        for dst in range(row0, row0 + len(seqs)):
            taken = src is not None and src >= row0 and dst == row0
            if not taken and (spare := self.prefix.spare_for(dst, free)) is not None:
                self._swap_free(dst, spare)
        if src is not None and src < row0:  # an active row's
            for m in self.models:
                m.cache.copy_prefix(src, row0, starts[0])
        for i, seq in enumerate(seqs):
            held.pop(row0 + i, None)
            seq.prefix_hit = seq.prefix_hit if own else starts[i]  # its chunks': where they started
            self.prefix.record(len(seq.prompt), seq.prefix_hit)
        return starts

    def cancel(self, seq: Sequence_) -> None:
        """Drop a sequence now (a client went away); its row is reused at once, and a row that
        holds its chunks (chunked prefill, not joined yet) is no longer pinned for it."""
        if seq in self.seqs:
            self.remove(self.seqs.index(seq))
        elif self.prefix is not None and seq.partial is not None:
            self.prefix.unpin(seq.partial)
        seq.done, seq.finish_reason = True, seq.finish_reason or "abort"

    def drop_finished(self) -> None:
        for row in reversed(range(len(self.seqs))):
            if self.seqs[row].done:
                self.remove(row)


def check_admissible(target: Transformer, seq: Sequence_, room: int, what: str = "decoding") -> None:
    """A UserError unless the sequence's prompt plus max_new_tokens fit in `room` cache slots."""
    P = len(seq.prompt)
    check_fits(target, [P], seq.max_new_tokens)
    if P + seq.max_new_tokens > room:
        raise UserError(f"prompt of {P} tokens + max_new_tokens {seq.max_new_tokens} exceeds the "
                        f"context of {room} tokens available to {what}")


def prefill_rows(target: Transformer, seqs: Sequence[Sequence_], row0: int, kv_len: int,
                 hidden_layers: Sequence[int] = (), start: Sequence[int] | None = None,
                 ) -> tuple[list[int], list[Tensor]]:
    """Write the prompts of sequences joining together into cache rows row0.. in one target
    forward (from start[i], the slots a row holds already: RowTable.claim) and sample each one's
    first token; returns (first tokens, hidden states [k, T, H] of the positions written). The
    caller has checked them (check_admissible)."""
    dev = target.embed_tokens.weight.device
    for seq in seqs:
        seq.generator = seq.params.generator(dev)
        seq.matcher = seq.params.new_matcher()
    final = len(target.layers)  # the normed final states, lm_head's input: prompt logprobs
    scored = [s.prompt_logprobs is not None for s in seqs]
    layers = list(hidden_layers) + ([final] if any(scored) and final not in hidden_layers else [])
    logits, hidden = prefill(target, [s.prompt for s in seqs], layers, row0=row0, kv_len=kv_len,
                             max_new_tokens=[s.max_new_tokens for s in seqs], start=start)
    for i, s in enumerate(seqs):
        if scored[i]:
            s.score_prompt(target.logits, hidden[layers.index(final)][i, :len(s.prompt) - 1])
    hidden = hidden[:len(hidden_layers)]
    for i, s in enumerate(seqs):
        s.set_logits(logits[i:i + 1])  # logprobs of the first token
    picked = penalize_seqs(logits[:, None], seqs)[:, 0]
    return [next_token(picked[i], s.params, s.generator) for i, s in enumerate(seqs)], hidden


def join_order(rows: RowTable, seqs: Sequence[Sequence_]) -> list[tuple[list[Sequence_], bool]]:
    """The joins of sequences arriving together: each that takes over a prefix a row holds
    (prefix_cache) alone and first, before other joins overwrite the free rows; then the others
    per group of similar prompt lengths (join_groups), but for those whose prompt starts as one
    of theirs does (n choices of a prompt, a burst of questions about one document): each of
    these alone after them, taking that prefix over from its running row. Pairs (sequences,
    whether to reuse a prefix)."""
    hits = [i for i, s in enumerate(seqs) if rows.prefix_hint(s)]
    leaders: list[int] = []
    followers: list[int] = []
    for i, s in enumerate(seqs):
        if i in hits:
            continue
        shares = rows.prefix is not None and s.prompt_logprobs is None and any(
            rows.prefix.reusable(Held(seqs[j].prompt, len(seqs[j].prompt)), s.prompt) >= MIN_HIT
            for j in leaders)
        (followers if shares else leaders).append(i)
    groups = join_groups([len(seqs[i].prompt) for i in leaders])
    return ([([seqs[i]], True) for i in hits] + [([seqs[leaders[j]] for j in g], False) for g in groups]
            + [([seqs[i]], True) for i in followers])


def prefix_row_ok(target: Transformer, seq: Sequence_) -> Callable[[int], bool]:
    """Rows whose RoPE tables suit seq (LongRoPE: the same set of factors; any row otherwise)."""
    if not target.config.long_rope_from():
        return lambda row: True
    want = int(target.rope_row0_for(torch.tensor([len(seq.prompt) + seq.max_new_tokens]))[0])
    return lambda row: int(target.cache.rope_row0[row]) == want


def penalize_seqs(logits: Tensor, seqs: Sequence[Sequence_], tree: DraftTree | None = None) -> Tensor:
    """sampling.penalize for the decoders' rows: logits [B, N, V] of each sequence's tree (or its
    last token, N = 1)."""
    return penalize(logits, [s.params for s in seqs], [s.prompt for s in seqs], [s.output for s in seqs],
                    [s.eos for s in seqs], None if tree is None else tree.tokens,
                    None if tree is None else tree.mask, [s.matcher for s in seqs])


def disable_by_batch_size_for(given: int | None, device_type: str, quantization: str = "none",
                              batch_tree: tuple[int, TreeConfig] | None = None) -> int | None:
    """Above how many running sequences rounds draft nothing (SpecDecoder's disable_by_batch_size):
    `given` (--speculative-disable-by-batch-size, the server's and the bench's), else the default
    here. Measured on a 2-core AMD EPYC Zen 4 (8 MT-bench
    prompts x 128 tokens, EAGLE-3 2/4/4, docs/measurements.md): bf16 1.19x plain at batch 2, 0.87x at batch 4
    (rounds without drafts there: 0.97x); int8 weights 0.82x at batch 2, 0.57x at batch 4 (rounds
    without drafts: 0.90-0.94x), so a CPU speculates up to batch 2 (fp32: unmeasured, as bf16),
    an int8 target only alone. On a GPU never: verifying a batch's trees costs about what a plain
    step does there. With a batch tree (TreeConfig.batch_tree_for) a CPU speculates up to 4
    sequences (or its first batch), the most measured (AMX Xeon, batch 4: bf16 1.15x plain,
    int8 0.99x, against 0.90x / 0.74x in rounds without drafts)."""
    if given is not None:
        return given
    if device_type != "cpu":
        return None
    if batch_tree is not None:
        return max(4, batch_tree[0])
    return 1 if quantization == "int8" else 2


class SpecDecoder:
    def __init__(self, target: Transformer, head: DraftHead, tree: TreeConfig, max_batch: int = 1,
                 max_seq_len: int | None = None, static_kv: bool = False,
                 disable_by_batch_size: int | None = None, draft_ahead: bool = True,
                 batch_tree: tuple[int, TreeConfig] | None = None, prefix_cache: bool = False):
        """prefix_cache: a prompt that starts with tokens a row holds (the last sequence of a free
        row, or an active one) takes those slots over, the target's and the head's, and prefills
        the rest (eagle_infer.prefix_cache).
        draft_ahead: a round drafts the next round's tree at its end (module docstring);
        False drafts at the start of each round, in a call of its own.
        batch_tree (min_batch, smaller tree): while at least min_batch sequences run, rounds
        draft and verify that tree instead of `tree` (a tree that shrinks as the batch grows: on
        a CPU a batch's trees make the verify compute-bound). A compiled decoder keeps a graph
        for each tree and batch bucket; where the batch crosses min_batch the next round drafts
        its tree anew.
        disable_by_batch_size (vLLM's name): while more sequences than this are running, rounds
        verify only each sequence's root (no drafts): a plain decode step whose tokens the draft
        head catches up on later, in one forward over up to max_pending of them, so speculation
        resumes when the batch shrinks. On a 2-core CPU a batch's trees make the verify
        compute-bound (docs/measurements.md: batch 4 EAGLE-3 0.87x plain in bf16, 0.57x with int8). None:
        always speculate."""
        if head.config.hidden_size != target.config.hidden_size:
            raise UserError("draft head and target disagree on hidden size")
        if disable_by_batch_size is not None and disable_by_batch_size < 0:
            raise UserError(f"disable_by_batch_size must be >= 0, got {disable_by_batch_size}")
        self.disable_by_batch_size = disable_by_batch_size
        if batch_tree is not None and batch_tree[0] < 2:
            raise UserError(f"a batch tree is for 2 or more sequences, got from {batch_tree[0]}")
        self.batch_tree = batch_tree
        trees = [tree] + ([batch_tree[1]] if batch_tree else [])
        self.round_tree = tree  # the tree the compiled steps trace: tree_for(the round's batch)
        self.keep_history = any(t.ngram_branch for t in trees)  # the n-gram branch's lookups
        self.last_round_plain = False  # the last step() drafted nothing (its sequences record no round)
        self.target, self.head, self.tree = target, head, tree
        self.max_seq_len = max_seq_len or min(target.config.max_position_embeddings, 4096)
        self.max_batch = max_batch
        # static_kv: attend over the whole cache every call, so shapes never change (graphs).
        self.static_kv = static_kv
        self.compiled = False
        target.setup_cache(max_batch, self.max_seq_len)
        head.setup_cache(max_batch, self.max_seq_len)
        self.layers = head.target_layers(target.config.num_layers)
        dev = target.embed_tokens.weight.device
        self.device = dev
        h = head.config.hidden_size
        v_draft = head.draft_lm_head.shape[0] if head.draft_lm_head is not None else (
            head.config.draft_vocab_size if head.eagle3 else head.config.vocab_size)
        self.L = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.root = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.root_g = torch.zeros(max_batch, h, dtype=head.weight_like.dtype, device=dev)
        self.root_logp = torch.zeros(max_batch, v_draft, dtype=torch.float32, device=dev)
        # Rounds without drafts leave the head's catch-up for later: each row's pairs (the
        # target's next token, the draft feature of the token before it) wait here, at most
        # max_pending (what check() reserves past a sequence's end for a round's tree), and the
        # head runs once over all of them (_catch_up_pending).
        self.max_pending = max(t.slots_past_end for t in trees)
        self.pending_tokens = torch.zeros(max_batch, self.max_pending, dtype=torch.long, device=dev)
        self.pending_feats = torch.zeros(max_batch, self.max_pending, h, dtype=head.weight_like.dtype,
                                         device=dev)
        self.pending_n = torch.zeros(max_batch, dtype=torch.long, device=dev)
        # The next round's tree, drafted by the round before (Sequence_.ahead says whose is ready).
        self.draft_ahead = draft_ahead
        N = max(t.num_draft_tokens for t in trees)
        # A greedy round's grammar bitmask where no row has a grammar: every token allowed.
        self.all_allowed = every_token_bitmask(max_batch, N, vocab_size=target.config.vocab_size, device=dev)
        self.ahead_tree = DraftTree(torch.zeros(max_batch, N, dtype=torch.long, device=dev),
                                    torch.zeros(max_batch, N, dtype=torch.long, device=dev),
                                    torch.zeros(max_batch, N, dtype=torch.long, device=dev),
                                    torch.zeros(max_batch, N, N, dtype=torch.bool, device=dev))
        # Each row's tokens in slot order (prompt, output, the root at L), which the n-gram branch
        # looks up in. The steps that draft take its first kv_len columns in place of a kv_ref
        # (its length is the kv length, the one traced symbol) and return them written.
        self.history = torch.zeros(max_batch, self.max_seq_len, dtype=torch.long, device=dev)
        per_row = [self.L, self.root, self.root_g, self.root_logp, self.pending_tokens, self.pending_feats,
                   self.pending_n, self.history, *vars(self.ahead_tree).values()]
        self.rows = RowTable(max_batch, [target, head], per_row, PrefixRows(1) if prefix_cache else None,
                             self.max_pending + 1)
        self.seqs = self.rows.seqs
        self.cancel = self.rows.cancel
        self.stats = SpecStats()
        self.draft_fn = self._draft_step  # one draft forward; inside the tree's growth
        self.draft_tree_fn = self._draft_tree
        self._greedy_round = self._greedy_round_ahead if draft_ahead else self._verify_commit_greedy
        self.greedy_round_fn = self._greedy_round
        self.plain_round_fn = self._plain_round_greedy  # greedy rounds without drafts
        self.plain_sampled_fn = self._plain_round_sampled  # and those at a temperature (and min-p)
        # sampled rounds whose distributions the graph computes (graph_distribution): one call too
        self._sampled_round = self._sampled_round_ahead if draft_ahead else self._verify_commit_sampled
        self.sampled_round_fn = self._sampled_round
        self.verify_fn = self._verify  # other sampled rounds: verify, then the rest (sampled_tail_fn)
        self._sampled_tail = self._sampled_tail_ahead if draft_ahead else self._sampled_tail_only
        self.sampled_tail_fn = self._sampled_tail
        self.catch_up_fn = self._catch_up  # the catch-up after rounds without drafts

    # -- the fixed-shape steps (what torch.compile / CUDA graphs capture) ---------------------

    def _draft_tree(self, root: Tensor, root_logp: Tensor, root_g: Tensor, L: Tensor,
                    history: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The round's whole draft phase: draft_tree's num_steps - 1 draft forwards and the
        tree's construction (the n-gram branch looked up in history), one graph when compiled
        (eagerly on a GPU the construction's ~400 small ops cost more than the forwards).
        history [B, kv_len]: the rows' tokens (self.history's first kv_len columns); its length
        is the kv length, a traced symbol like a mask's. Returns the DraftTree's tensors."""
        t = draft_tree(self.round_tree, self.draft_fn, root, root_logp, root_g, L, history.shape[-1],
                       self.head.draft_to_target, history)
        return t.tokens, t.parent, t.depth, t.mask

    def _draft_step(self, tokens: Tensor, feat: Tensor, pos: Tensor, mask: Tensor,
                    slots: Tensor) -> tuple[Tensor, Tensor]:
        logits, g, _ = self.head(tokens, feat, pos, mask, slots=slots)
        return logits, g

    def _verify(self, tokens: Tensor, pos: Tensor, slots: Tensor,
                mask: Tensor) -> tuple[Tensor, list[Tensor]]:
        logits, hidden = self.target(tokens, pos, slots, mask, hidden_layers=self.layers)
        return logits, hidden

    def _commit(self, tree_tokens: Tensor, acc: Acceptance, hidden: Sequence[Tensor],
                L: Tensor, history: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Keep the accepted path's target KV (moved to slots L..L+n) and build the draft's
        catch-up pairs along it: tokens [B, D+1] (the path shifted left, then the bonus; past n
        the bonus again, never read), features [B, D+1, h]; the path's tokens [B, D+1]; and, with
        an n-gram branch, history [B, kv_len] with the path and the bonus (the next root) written
        at L..L+n+1 (a new tensor: a compiled round returns it, the caller keeps it)."""
        self.target.keep_slots(L[:, None] + acc.path, L)
        path_tokens = torch.gather(tree_tokens, 1, acc.path)  # [B, D+1], root first
        steps = torch.arange(acc.path.shape[1], device=L.device)[None]
        shifted = torch.cat([path_tokens[:, 1:], acc.bonus[:, None]], 1)
        next_tokens = torch.where(steps < acc.n_accepted[:, None], shifted, acc.bonus[:, None])
        feats = self.head.project([torch.gather(h, 1, acc.path[:, :, None].expand(-1, -1, h.shape[-1]))
                                   for h in hidden])
        if self.keep_history:  # past n the path repeats its leaf: the bonus overwrites L + n + 1
            history = history.scatter(1, L[:, None] + steps, path_tokens)
            history = history.scatter(1, (L + acc.n_accepted + 1)[:, None], acc.bonus[:, None])
        return next_tokens, feats, path_tokens, history

    def _catch_up_inputs(self, start: Tensor, T: int, kv_len: int) -> tuple[Tensor, Tensor]:
        """Positions [B, T] (= slots) and causal attention mask [B, T, kv_len] of T catch-up pairs
        from slot start [B] on."""
        return start[:, None] + torch.arange(T, device=start.device)[None], causal_mask(start, T, kv_len)

    def _verify_commit(self, tokens: Tensor, parent: Tensor, depth: Tensor, tree_mask: Tensor, L: Tensor,
                       history: Tensor, accept: Callable[[DraftTree, Tensor], Acceptance],
                       ) -> tuple[Tensor, ...]:
        """A round after its draft phase: verify, acceptance (accept(tree, logits)), commit and the
        draft's catch-up, one graph when compiled (on a GPU the eager glue between verify and
        catch-up was ~40 small launches a round). history [B, kv_len] (as _draft_tree's): its
        length is the verify's and the catch-up's kv length (so the verify's mask is built in the
        graph, as the plain step's). Returns (logits [B, N, V], path [B, D+1], n [B], bonus [B],
        path tokens [B, D+1], the next root's draft feature [B, h] and log-probs [B, V'], history
        (_commit))."""
        tree, N = DraftTree(tokens, parent, depth, tree_mask), tokens.shape[1]
        mask = build_attn_mask(L, tree_mask, history.shape[-1])  # [B, N, kv_len]
        slots = L[:, None] + torch.arange(N, device=L.device)[None]
        logits, hidden = self._verify(tokens, L[:, None] + depth, slots, mask)
        acc = accept(tree, logits)
        next_tokens, feats, path_tokens, history = self._commit(tokens, acc, hidden, L, history)
        pos, catch_mask = self._catch_up_inputs(L, next_tokens.shape[1], mask.shape[-1])
        g_last, logp = self._catch_up(next_tokens, feats, pos, catch_mask, acc.n_accepted + 1)
        return logits, acc.path, acc.n_accepted, acc.bonus, path_tokens, g_last, logp, history

    def _verify_commit_greedy(self, tokens: Tensor, parent: Tensor, depth: Tensor, tree_mask: Tensor,
                              L: Tensor, history: Tensor, bitmask: Tensor) -> tuple[Tensor, ...]:
        """_verify_commit accepting greedily. bitmask [B, N, ceil(V / 32)]: the tokens each row's
        grammar allows after each node (_grammar_bitmask; all, for rows without one)."""
        def accept(tree: DraftTree, logits: Tensor) -> Acceptance:
            return accept_greedy(tree, logits, self.round_tree.max_depth, bitmask)

        return self._verify_commit(tokens, parent, depth, tree_mask, L, history, accept)

    def _verify_commit_sampled(self, tokens: Tensor, parent: Tensor, depth: Tensor, tree_mask: Tensor,
                               L: Tensor, history: Tensor, temperature: Tensor, log_min_p: Tensor,
                               u: Tensor) -> tuple[Tensor, ...]:
        """_verify_commit with the rejection-sampling walk, for rows whose distributions the graph
        computes (SamplingParams.graph_distribution: graph_probs of temperature [B] and
        log_min_p [B]), with the uniforms u drawn before the verify (tree.sampling_uniforms).
        One graph, where other sampled rounds run the verify, the distributions eagerly, then
        the rest (_sampled_tail_only): a round 1.22 -> 1.18 plain steps on a 2-core Zen 4, bf16
        (docs/runtime.md)."""
        def accept(tree: DraftTree, logits: Tensor) -> Acceptance:
            probs = graph_probs(logits, temperature, log_min_p)  # [B, N, V]
            return walk_sampling(tree, probs, u, self.round_tree.max_depth)

        return self._verify_commit(tokens, parent, depth, tree_mask, L, history, accept)

    def _then_draft(self, out: tuple[Tensor, ...], L: Tensor) -> tuple[Tensor, ...]:
        """A round's tensors (_verify_commit's), then the next round's draft phase from its root
        (the bonus) at L + n + 1, in the same graph when compiled: the head's weights are still
        in the caches from the catch-up (a draft phase of its own ran ~0.4 ms slower after a
        round than at once again), and a round is one call. history's kv length covers the next
        tree's draft slots too. Returns out, then the next tree's tensors (_draft_tree)."""
        _, _, n, bonus, _, g_last, logp, history = out
        return *out, *self._draft_tree(bonus, logp, g_last, L + n + 1, history)

    def _greedy_round_ahead(self, tokens: Tensor, parent: Tensor, depth: Tensor, tree_mask: Tensor,
                            L: Tensor, history: Tensor, bitmask: Tensor) -> tuple[Tensor, ...]:
        """_verify_commit_greedy, then the next round's draft phase (_then_draft)."""
        out = self._verify_commit_greedy(tokens, parent, depth, tree_mask, L, history, bitmask)
        return self._then_draft(out, L)

    def _sampled_round_ahead(self, tokens: Tensor, parent: Tensor, depth: Tensor, tree_mask: Tensor,
                             L: Tensor, history: Tensor, temperature: Tensor, log_min_p: Tensor,
                             u: Tensor) -> tuple[Tensor, ...]:
        """_verify_commit_sampled, then the next round's draft phase (_then_draft)."""
        out = self._verify_commit_sampled(tokens, parent, depth, tree_mask, L, history, temperature,
                                          log_min_p, u)
        return self._then_draft(out, L)

    def _sampled_tail_only(self, tokens: Tensor, parent: Tensor, depth: Tensor, tree_mask: Tensor, L: Tensor,
                           history: Tensor, probs: Tensor, u: Tensor, *hidden: Tensor) -> tuple[Tensor, ...]:
        """A sampled round after its verify: the rejection-sampling walk over the target's
        distributions probs [B, N, V] with the uniforms u (tree.sampling_uniforms), commit and
        the draft's catch-up, one graph when compiled. hidden: the verify's states (target_layers).
        Returns (path [B, D+1], n [B], bonus [B], path tokens [B, D+1], the next root's draft
        feature [B, h] and log-probs [B, V'], history (_commit))."""
        tree = DraftTree(tokens, parent, depth, tree_mask)
        acc = walk_sampling(tree, probs, u, self.round_tree.max_depth)
        next_tokens, feats, path_tokens, history = self._commit(tokens, acc, hidden, L, history)
        pos, catch_mask = self._catch_up_inputs(L, next_tokens.shape[1], history.shape[-1])
        g_last, logp = self._catch_up(next_tokens, feats, pos, catch_mask, acc.n_accepted + 1)
        return acc.path, acc.n_accepted, acc.bonus, path_tokens, g_last, logp, history

    def _sampled_tail_ahead(self, tokens: Tensor, parent: Tensor, depth: Tensor, tree_mask: Tensor, L: Tensor,
                            history: Tensor, probs: Tensor, u: Tensor, *hidden: Tensor) -> tuple[Tensor, ...]:
        """_sampled_tail_only, then the next round's draft phase (as _then_draft)."""
        out = self._sampled_tail_only(tokens, parent, depth, tree_mask, L, history, probs, u, *hidden)
        _, n, bonus, _, g_last, logp, history = out
        return *out, *self._draft_tree(bonus, logp, g_last, L + n + 1, history)

    def _plain_round_greedy(self, tokens: Tensor, L: Tensor, kv_ref: Tensor,
                            bitmask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A greedy round without drafts: the target's step on each root tokens [B, 1] at slot L,
        one graph when compiled. Returns its logits [B, 1, V], the next token [B] (accept_greedy's
        bonus for a tree of the root alone, among what bitmask [B, 1, ceil(V / 32)] allows: a
        grammar's, as _grammar_bitmask) and the root's draft feature [B, h] for the head's
        deferred catch-up."""
        mask = causal_mask(L, 1, kv_ref.shape[-1])  # [B, 1, kv_len]
        logits, hidden = self._verify(tokens, L[:, None], L[:, None], mask)
        return logits, masked_greedy_tokens(logits, bitmask)[:, 0], self.head.project(hidden)[:, 0]

    def _plain_round_sampled(self, tokens: Tensor, L: Tensor, kv_ref: Tensor, temperature: Tensor,
                             log_min_p: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """_plain_round_greedy for rows whose distributions the graph computes
        (SamplingParams.graph_distribution: graph_probs of temperature [B] and log_min_p [B]): the
        next token [B] is the walk's bonus for a tree of the root alone at the uniforms u
        (tree.sampling_uniforms, drawn before the step), the draw an eager round makes after its
        verify (accept_sampling), so seeded rows give the same tokens; one graph when compiled."""
        mask = causal_mask(L, 1, kv_ref.shape[-1])  # [B, 1, kv_len]
        logits, hidden = self._verify(tokens, L[:, None], L[:, None], mask)
        zero = torch.zeros_like(tokens)  # [B, 1]
        root = DraftTree(tokens, zero, zero, (zero == 0)[:, :, None])  # the root alone
        bonus = walk_sampling(root, graph_probs(logits, temperature, log_min_p), u, 0).bonus
        return logits, bonus, self.head.project(hidden)[:, 0]

    def _catch_up(self, next_tokens: Tensor, feats: Tensor, pos: Tensor, mask: Tensor, count: Tensor,
                  row0: int = 0) -> tuple[Tensor, Tensor]:
        """Draft catch-up over pairs (feature_i, token_i+1) [B, T] at positions pos (= their
        slots), count [B] of them real: the draft's feature after the last real pair [B, h] and
        its log-probs [B, V'] (the next round's root)."""
        B = next_tokens.shape[0]
        _, g, _ = self.head(next_tokens, feats, pos, mask, slots=pos, compute_logits=False, row0=row0)
        g_last = torch.gather(g, 1, (count - 1)[:, None, None].expand(B, 1, g.shape[-1]))[:, 0]
        return g_last, torch.log_softmax(self.head.logits(g_last).float(), -1)

    def compile(self, mode: str | None = None, max_bs: int | None = None) -> SpecDecoder:
        """torch.compile the draft phase (its num_steps - 1 draft forwards and the tree's
        construction: _draft_tree), a greedy round's rest (_verify_commit_greedy, or
        _greedy_round_ahead with the next round's draft phase), a sampled round's verify and its
        rest (_sampled_tail_only or _sampled_tail_ahead), rounds without drafts (greedy, or sampled
        at a temperature) and the catch-up after them, each lazily, with full graphs: the batch in
        buckets of 1, 2, 4, 8, then multiples of 8 (BucketedStep; a bucket over max_bs, default
        the bucket of max_batch, runs eagerly). On CPU Inductor traces the kv length as a symbol
        (one graph per batch bucket); on CUDA, mode="reduce-overhead" (compile_mode_for) compiles
        the same way and records a CUDA graph per batch and power-of-two kv bucket
        (compiled_kv_len)."""
        if self.seqs:
            raise RuntimeError("compile a decoder before any sequence joins")
        max_bs = batch_bucket(self.max_batch) if max_bs is None else max_bs
        rows = compiled_cache_rows(self.max_batch, max_bs)
        self.target.setup_cache(rows, self.max_seq_len)  # padding rows write past the active ones
        self.head.setup_cache(rows, self.max_seq_len)
        if self.rows.prefix is not None:
            self.rows.prefix.clear()
        self.compiled, self.max_bs, self.compile_mode = True, max_bs, mode
        graphs = mode == CUDA_GRAPHS
        inductor = compile_settings(self.target, self.head)
        options = step_options(self.target, inductor, mode)
        # Argument mask_arg of each step carries the kv length (a mask, a kv_ref or the history, whose
        # length it is).
        (self.draft_tree_fn, self.greedy_round_fn, self.sampled_round_fn, self.verify_fn,
         self.sampled_tail_fn, self.catch_up_fn, self.plain_round_fn, self.plain_sampled_fn) = (
            BucketedStep(f, compile_step(f, mode, inductor, options), max_bs, clone=graphs, mask_arg=arg,
                         max_kv=self.max_seq_len)
            for f, arg in ((self._draft_tree, 4), (self._greedy_round, 5), (self._sampled_round, 5),
                           (self._verify, 3), (self._sampled_tail, 5), (self._catch_up, 3),
                           (self._plain_round_greedy, 2), (self._plain_round_sampled, 2)))
        return self

    def kv_len(self, needed: int) -> int:
        if self.static_kv:
            return self.max_seq_len
        if self.compiled:
            return compiled_kv_len(needed, self.max_seq_len, self.compile_mode)
        return kv_len_for(needed, self.max_seq_len)

    # -- joining and leaving -----------------------------------------------------------------

    @property
    def free_rows(self) -> int:
        return self.rows.free

    def check(self, seq: Sequence_) -> None:
        """A UserError unless the sequence fits (its prompt, max_new_tokens and one round's tree)."""
        room = self.max_seq_len - self.max_pending  # the largest tree's slots past the end
        check_admissible(self.target, seq, room, "speculative decoding")

    def add(self, seq: Sequence_) -> None:
        """Prefill a new sequence into the next free row; its first token is emitted."""
        self.add_many([seq])

    @torch.no_grad()
    def add_many(self, seqs: Sequence[Sequence_]) -> None:
        """Prefill sequences joining together into the next free rows: per group of similar
        prompt lengths (join_groups) one target forward and one draft forward, right-padded.
        Each one's first token is emitted."""
        if len(seqs) > self.rows.free:
            raise RuntimeError(f"{len(seqs)} sequences join but {self.rows.free} rows are free")
        for seq in seqs:
            self.check(seq)
        for group, reuse in join_order(self.rows, seqs):
            self._join(group, reuse)

    def _join(self, seqs: Sequence[Sequence_], reuse: bool = False) -> None:
        row0, k, dev = len(self.seqs), len(seqs), self.device
        starts = self.rows.claim(seqs, reuse)
        lens = torch.tensor([len(s.prompt) for s in seqs], device=dev)
        start = torch.tensor(starts, device=dev)
        P = int(lens.max())
        firsts, hidden = prefill_rows(self.target, seqs, row0, self.kv_len(P), self.layers, starts)
        # Draft pairs (feature_i, token_{i+1}) from each row's start: the prompt shifted left, then
        # the first token; the history: the prompt, then the first token (the root).
        nxt = torch.zeros(k, hidden[0].shape[1], dtype=torch.long, device=dev)
        for i, (s, first) in enumerate(zip(seqs, firsts)):
            ids = torch.tensor(s.prompt + [first], dtype=torch.long)
            nxt[i, :len(s.prompt) - starts[i]] = ids[starts[i] + 1:]
            self.history[row0 + i, :len(ids)] = ids
        self._draft_extend(row0, nxt, self.head.project(hidden), start, lens - start, self.kv_len(P))
        self.L[row0:row0 + k], self.root[row0:row0 + k] = lens, torch.tensor(firsts, device=dev)
        self.pending_n[row0:row0 + k] = 0
        for s in seqs:
            s.cached = len(s.prompt)
        self.rows.admit_many(seqs, firsts)

    def _draft_extend(self, row0: int, next_tokens: Tensor, feats: Tensor, start: Tensor,
                      count: Tensor, kv_len: int) -> None:
        """A join's draft catch-up, eagerly (T = the longest prompt, rows from row0): pairs
        (feature_i, token_{i+1}) at positions start..start+count-1 (padded to T; kv_len covers
        start + T); remember the draft's output after the last real pair."""
        B, T = next_tokens.shape
        pos, mask = self._catch_up_inputs(start, T, kv_len)
        g_last, logp = self._catch_up(next_tokens, feats, pos, mask, count, row0)
        self.root_g[row0:row0 + B], self.root_logp[row0:row0 + B] = g_last, logp

    @torch.no_grad()
    def prefill_chunk(self, seq: Sequence_, size: int) -> int:
        """Chunked prefill (with the prefix cache): the next `size` tokens of a prompt longer
        than what is written plus `size`, target and head, into a free row ahead of its join,
        between rounds, so that running sequences do not wait for a long prompt's whole prefill;
        its join then takes them over (a prefix hit). Returns its prompt tokens written."""
        row, done = self.rows.chunk_row(seq)
        end = done + size
        kv = self.kv_len(end)
        _, hidden = prefill(self.target, [seq.prompt[:end]], self.layers, row0=row, kv_len=kv,
                            max_new_tokens=[len(seq.prompt) - end + seq.max_new_tokens], start=[done],
                            logits=False)
        nxt = torch.tensor([seq.prompt[done + 1:end + 1]], device=self.device)
        first = torch.tensor([done], device=self.device)
        self._draft_extend(row, nxt, self.head.project(hidden), first, first.new_tensor([size]), kv)
        self.rows.chunk_done(seq, row, end)
        return end

    # -- one round ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[tuple[Sequence_, list[int]]]:
        """One speculative round for every active sequence; returns (sequence, new tokens)."""
        B = len(self.seqs)
        if B == 0:
            return []
        plain = self.disable_by_batch_size is not None and B > self.disable_by_batch_size
        self.last_round_plain = plain
        if plain:
            return self._plain_round(B)
        if any(s.pending for s in self.seqs):  # the batch shrank: once a phase of rounds without drafts
            self._catch_up_pending(B, self._catch_up)
        cfg, dev = self.tree_for(B), self.device
        if cfg is not self.round_tree:  # the trees drafted ahead are the other tree's
            self.round_tree = cfg
            for s in self.seqs:
                s.ahead = False
        L = self.L[:B]
        L_max = max(s.cached for s in self.seqs)  # = L.max(), from the host: no read
        N = cfg.num_draft_tokens  # tree nodes
        depth = cfg.max_depth  # the deepest node; catch-up pairs: its path + the bonus
        T = depth + 1
        drafted = cfg.num_steps * cfg.eagle_topk  # draft cache slots a draft phase writes past L
        params = [s.params for s in self.seqs]
        # the round's one graph: greedy on the raw logits, or on those a grammar allows
        greedy = all(p.graph_argmax for p in params)
        # or sampled on distributions the round's graph computes: one graph too
        in_graph = not greedy and all(p.graph_distribution for p in params)
        ahead = self.draft_ahead
        t0 = time.perf_counter()
        if ahead and all(s.ahead for s in self.seqs):
            tree = DraftTree(*(t.contiguous() for t in self._ahead_rows(B, N)))
            drafts = 0
        else:
            with record_function("spec.draft_tree"):
                history = self.history[:B, :self.kv_len(L_max + drafted)].contiguous()
                tree = DraftTree(*self.draft_tree_fn(self.root[:B], self.root_logp[:B], self.root_g[:B], L,
                                                     history))
            drafts = cfg.num_steps - 1
        if any(s.matcher is not None for s in self.seqs):
            tree = self._with_forced(tree, cfg)
        t1 = time.perf_counter()
        # verify's and catch-up's kv, the next round's draft phase's (from L + n + 1 <= L + T), and
        # the history's next root at L + n + 1
        kv = self.kv_len(L_max + max(N, T + drafted if ahead else T + 1))
        history = self.history[:B, :kv].contiguous()
        if greedy or in_graph:
            if greedy:
                round_fn, inputs = self.greedy_round_fn, (self._grammar_bitmask(tree),)
            else:  # each row's uniforms from its generator, as the eager walk draws them after a verify
                u = self._walk_uniforms(depth, N, tree.tokens)
                round_fn, inputs = self.sampled_round_fn, (*graph_settings(params, dev), u)
            with record_function("spec.verify_commit"):
                logits, path, n, bonus, path_tokens, g_last, logp, history, *next_tree = round_fn(
                    tree.tokens, tree.parent, tree.depth, tree.mask, L, history, *inputs)
            t2 = t3 = t4 = time.perf_counter()
        else:
            mask = build_attn_mask(L, tree.mask, kv)
            with record_function("spec.verify"):
                pos, slots = L[:, None] + tree.depth, L[:, None] + torch.arange(N, device=dev)[None]
                logits, hidden = self.verify_fn(tree.tokens, pos, slots, mask)
            t2 = time.perf_counter()
            with record_function("spec.sampling_inputs"):  # eager: per-request settings, generators
                probs = sampling_probs(penalize_seqs(logits, self.seqs, tree), params)
                u = self._walk_uniforms(depth, N, probs)
            t3 = time.perf_counter()
            with record_function("spec.accept_commit_catch_up"):
                path, n, bonus, path_tokens, g_last, logp, history, *next_tree = self.sampled_tail_fn(
                    tree.tokens, tree.parent, tree.depth, tree.mask, L, history, probs, u, *hidden)
            t4 = time.perf_counter()
        for dst, src in zip(self._ahead_rows(B, N), next_tree):
            dst.copy_(src)
        self.root_g[:B], self.root_logp[:B] = g_last, logp
        if self.keep_history:
            self.history[:B, :kv] = history
        self.L[:B] = L + n + 1
        self.root[:B] = bonus
        results = []
        # The round's one host read: drafted tokens on the path, bonus and count per row.
        rows = torch.cat([path_tokens[:, 1:], bonus[:, None], n[:, None]], 1).tolist()
        for b, (seq, row) in enumerate(zip(self.seqs, rows)):
            k = row[-1]
            seq.cached += k + 1
            seq.ahead = ahead
            seq.accepted.append(k)
            self.stats.record(k)
            seq.set_logits(logits[b, path[b, :k + 1]])  # logprobs: verify logits in front of each token
            results.append((seq, seq.emit(row[:k] + [row[-2]])))  # drafted tokens, then the bonus
        self.rows.drop_finished()
        t5 = time.perf_counter()
        self.stats.rounds += 1
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += (t2 - t1) + (t4 - t3)
        self.stats.other_s += (t3 - t2) + (t5 - t4)
        self.stats.draft_calls += drafts
        return results

    def _with_forced(self, tree: DraftTree, cfg: TreeConfig) -> DraftTree:
        """The round's tree with what each row's grammar forces next (grammar.forced_tokens) as
        its first branch (tree.graft_chains): a tool's name, a schema's keys, the closing tags,
        which the head cannot know. The verify decides as for any draft."""
        from eagle_infer.grammar import forced_tokens

        chains = {}
        for b, s in enumerate(self.seqs):
            if s.matcher is not None and (chain := forced_tokens(s.matcher, s.params.grammar.encode,
                                                                 cfg.max_depth)):
                chains[b] = chain
        return graft_chains(tree, chains, cfg.max_depth) if chains else tree

    def _grammar_bitmask(self, tree: DraftTree) -> Tensor:
        """[B, N, ceil(V / 32)] int32: the tokens each row's grammar allows after each node of its
        tree (grammar.allowed_after, from the output so far along the node's path), every token
        for rows without one. On the host, before the verify: a greedy round's graph takes it."""
        B, N = tree.tokens.shape
        every = self.all_allowed[:B, :N]
        rows = [b for b, s in enumerate(self.seqs) if s.matcher is not None]
        if not rows:  # contiguous: a batch tree's N < the buffer's, and the graph traced these strides
            return every.contiguous()
        from eagle_infer.grammar import allowed_after

        bitmask, V = every.clone(memory_format=torch.contiguous_format), self.target.config.vocab_size
        for b in rows:
            bitmask[b] = allowed_after(self.seqs[b].matcher, node_paths(tree.tokens, tree.mask, b, N), V)
        return bitmask

    def tree_for(self, B: int) -> TreeConfig:
        """The tree a round of B sequences drafts and verifies (batch_tree)."""
        if self.batch_tree is not None and B >= self.batch_tree[0]:
            return self.batch_tree[1]
        return self.tree

    def _ahead_rows(self, B: int, N: int) -> list[Tensor]:
        """The ahead tree's buffers (sized for the largest tree) as B rows of N nodes: tokens,
        parent, depth [B, N] and mask [B, N, N]."""
        t = self.ahead_tree
        return [t.tokens[:B, :N], t.parent[:B, :N], t.depth[:B, :N], t.mask[:B, :N, :N]]

    def _walk_uniforms(self, depth: int, N: int, like: Tensor) -> Tensor:
        """The walk's uniforms for the running rows' trees of N nodes and depth `depth`, each row's
        from its own generator (tree.sampling_uniforms), in the layout the walk will read: a
        compiled step traces the torch walk, so it gets that one's, never the CUDA kernel's."""
        return sampling_uniforms([s.generator for s in self.seqs], depth, N, like,
                                 fused=kernel_available(like) and not self.compiled)

    def _plain_round(self, B: int) -> list[tuple[Sequence_, list[int]]]:
        """A round without drafts (more than disable_by_batch_size sequences running): the target's
        step on each root and its next token, as plain decoding. The head does not run: the pair
        it will need waits in the row's pending buffer for one catch-up over all of them, when
        the buffer fills or speculation resumes (_catch_up_pending); a catch-up a round (a head
        forward and its draft logits for every row) cost an int8 batch-4 round ~20% (docs/measurements.md).
        Not counted in tau: its sequences record no round. Greedy rows, and rows at a temperature
        and min-p alone (their bonus drawn in the graph: _plain_round_sampled), run one call; others
        the verify, then their distributions and the walk eagerly."""
        dev, L = self.device, self.L[:B]
        kv = self.kv_len(max(s.cached for s in self.seqs) + 1)
        params = [s.params for s in self.seqs]
        zero = torch.zeros(B, 1, dtype=torch.long, device=dev)
        tree = DraftTree(self.root[:B, None], zero, zero, torch.ones(B, 1, 1, dtype=torch.bool, device=dev))
        with record_function("spec.plain_round"):  # the root alone as a tree
            kv_ref = torch.empty(B, kv, dtype=torch.bool, device=dev)
            if all(p.graph_argmax for p in params):
                logits, bonus, feat = self.plain_round_fn(tree.tokens, L, kv_ref, self._grammar_bitmask(tree))
            elif all(p.graph_distribution for p in params):  # drawn in the graph, at uniforms drawn first
                u = self._walk_uniforms(0, 1, tree.tokens)
                settings = graph_settings(params, dev)
                logits, bonus, feat = self.plain_sampled_fn(tree.tokens, L, kv_ref, *settings, u)
            else:  # the bonus drawn from the target as in any round
                logits, hidden = self.verify_fn(tree.tokens, L[:, None], L[:, None], causal_mask(L, 1, kv))
                bonus = accept_sampling(tree, penalize_seqs(logits, self.seqs), params,
                                        [s.generator for s in self.seqs], 0).bonus
                feat = self.head.project(hidden)[:, 0]
            n, rows = self.pending_n[:B], torch.arange(B, device=dev)
            self.pending_tokens[rows, n], self.pending_feats[rows, n] = bonus, feat
            self.pending_n[:B] = n + 1
            if self.keep_history:
                self.history[rows, L + 1] = bonus
            self.L[:B] = L + 1
            self.root[:B] = bonus
        results = []
        for b, (seq, token) in enumerate(zip(self.seqs, bonus.tolist())):  # the round's one host read
            seq.cached += 1
            seq.pending += 1
            seq.ahead = False
            seq.set_logits(logits[b, :1])
            results.append((seq, seq.emit([token])))
        self.stats.plain_rounds += 1
        self.rows.drop_finished()
        if self.seqs and max(s.pending for s in self.seqs) == self.max_pending:
            self._catch_up_pending(len(self.seqs), self.catch_up_fn)
        return results

    def _catch_up_pending(self, B: int, catch_up: Callable[..., tuple[Tensor, Tensor]]) -> None:
        """The head's deferred catch-up through `catch_up` (_catch_up or its compiled step): one
        forward over each row's pending pairs, at positions L - n .. L - 1, writing its cache
        there and the next root's feature and draft log-probs; rows without pairs keep theirs.
        Equal to a catch-up a round: the same pairs at the same positions, causally masked.
        Always max_pending pairs a row (the rest padding, written past L where the next round's
        writes land first): compiled, one graph for each batch bucket that runs rounds without
        drafts (engine.warm_up compiles them); where speculation resumes it runs eagerly, once a
        phase, so batch sizes that speculate compile nothing for it."""
        T = self.max_pending
        L_max = max(s.cached for s in self.seqs)
        n = self.pending_n[:B]
        pos, mask = self._catch_up_inputs(self.L[:B] - n, T, self.kv_len(L_max + T))
        g_last, logp = catch_up(self.pending_tokens[:B], self.pending_feats[:B], pos, mask, n.clamp(min=1))
        some = (n > 0)[:, None]
        self.root_g[:B] = torch.where(some, g_last, self.root_g[:B])
        self.root_logp[:B] = torch.where(some, logp, self.root_logp[:B])
        self.pending_n[:B] = 0
        for s in self.seqs:
            s.pending = 0


def generate_speculative(
    target: Transformer,
    head: DraftHead,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    tree: TreeConfig | None = None,
    eos_token_ids: Sequence[int] | None = None,
    max_seq_len: int | None = None,
    decoder: SpecDecoder | None = None,
    on_token: Callable[[int, int], bool] | None = None,
) -> tuple[list[list[int]], SpecStats]:
    """Decode a batch of prompts speculatively; returns the new tokens of each and the stats.
    on_token(index, token), as in generate, sees each token as it is emitted; True stops that
    sequence."""
    if max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    tree = tree or TreeConfig()
    params = [params or SamplingParams()] * len(prompts) if not isinstance(params, Sequence) else list(params)
    eos = set(target.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    dec = decoder or SpecDecoder(target, head, tree, max_batch=len(prompts), max_seq_len=max_seq_len)
    return decode_to_end(dec, prompts, max_new_tokens, params, eos, on_token)


def decode_to_end(dec: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  params: Sequence[SamplingParams], eos: set[int],
                  on_token: Callable[[int, int], bool] | None = None) -> tuple[list[list[int]], SpecStats]:
    """Every prompt decoded to its end on a decoder (SpecDecoder, ngram.NgramDecoder: add_many,
    step, stats) that has the rows: the new tokens of each, and the stats of these rounds."""
    dec.stats = SpecStats()
    seqs = [Sequence_(list(p), params[i], max_new_tokens, eos,
                      on_token=None if on_token is None else (lambda t, i=i: on_token(i, t)))
            for i, p in enumerate(prompts)]
    dec.add_many(seqs)
    while dec.seqs:
        dec.step()
    return [s.output for s in seqs], dec.stats
