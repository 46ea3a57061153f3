"""Prompt-lookup speculative decoding without a draft model: SGLang's `--speculative-algorithm
NGRAM`, vLLM's `{"method": "ngram"}`. Any target speeds up where its answers repeat what came
before (code edits, retrieval answers, summaries), with no head trained for it.

A round, for every running sequence at once:
    lookup   the k tokens that followed the latest earlier occurrence of the sequence's last
             n tokens (n from max_match down to min_match; tree.ngram_lookup, on the host's
             history: the prompt and the output so far)
    verify   one target forward over [last, d_1 .. d_k] at positions L .. L+k (a causal chain)
    accept   the longest prefix the target agrees with (greedy), or the lossless walk with one-hot
             drafts (sampling: tree.accept_sampling), plus the target's own next token
A chain writes its KV at slots L .. L+k, so the accepted prefix is already where it belongs:
nothing is moved, L just advances. A round in which no row's history matches is a plain step,
so text that never repeats costs no verify rows.

A row with a grammar drafts what the grammar forces next (a schema's keys, closing brackets:
grammar.forced_tokens), then the lookup's continuation of it. Grammars, penalties and logit
biases apply at each chain position as if the drafted tokens before it had been emitted
(sampling.penalize over the chain as a tree), so such rows stay lossless and speculate too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from eagle_infer.cpu_linears import compile_settings, step_options
from eagle_infer.engine import PlainDecoder
from eagle_infer.errors import UserError
from eagle_infer.generate import (
    CUDA_GRAPHS,
    BucketedStep,
    batch_bucket,
    compile_step,
    compiled_kv_len,
    kv_len_for,
)
from eagle_infer.model import Transformer, causal_mask
from eagle_infer.sampling import SamplingParams, greedy_tokens
from eagle_infer.speculative import Sequence_, SpecStats, check_admissible, decode_to_end, penalize_seqs
from eagle_infer.tree import NGRAM_MAX, DraftTree, accept_sampling, ngram_lookup

# k: a chain of 6 verified with its root, 7 rows: 1.37x / 1.55x plain against 1.30x / 1.49x with 4
# (MT-bench / long prompts, Zen 4 bf16, scripts/ab_ngram.py: docs/runtime.md)
DEFAULT_DRAFT_TOKENS = 6


class NgramIndex:
    """A growing token list with the latest end position of each of its n-grams (n <= max_n),
    kept as tokens arrive: a lookup is a few dictionary reads where tree.ngram_lookup compares
    every window of the history again (~0.4 ms a round on 2 cores, 4% of a plain step). A
    sequence's own (lookup: the same answer as tree.ngram_lookup, tests/test_ngram.py), or the
    decoder's corpus of the requests it served (find)."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # the n-grams ending before this position are in `latest`

    def extend(self, tokens: list[int]) -> None:
        """Append tokens, indexing the n-grams that end before the last one (a lookup's own
        suffix ends there: an occurrence must lie before it)."""
        self.tokens += tokens
        end = len(self.tokens) - 1
        for i in range(self.indexed, end):
            for n in range(1, min(self.max_n, i + 1) + 1):
                self.latest[tuple(self.tokens[i - n + 1:i + 1])] = i
        self.indexed = max(self.indexed, end)

    def find(self, suffix: list[int], min_n: int = 1) -> tuple[int, int]:
        """(q, n): where the latest indexed occurrence of suffix's last n tokens ends, for the
        longest n from max_n down to min_n that occurs; (-1, 0) where none does."""
        for n in range(min(self.max_n, len(suffix)), min_n - 1, -1):
            q = self.latest.get(tuple(suffix[-n:]))
            if q is not None:
                return q, n
        return -1, 0

    def lookup(self, length: int) -> tuple[list[int], int]:
        """The `length` tokens after the latest earlier occurrence of the list's last n tokens
        (the longest n that occurs), continued periodically past the end, and n (0: none; the
        last token repeated)."""
        end = len(self.tokens) - 1
        q, n = self.find(self.tokens)
        if n == 0:
            return [self.tokens[end]] * length, 0
        return [self.tokens[q + 1 + i % (end - q)] for i in range(length)], n


# The corpus: requests' tokens apart (never a token id); how many tokens of past requests it keeps
# by default (~600 bytes of index a token)
SEPARATOR, DEFAULT_CORPUS_TOKENS = -1, 100_000


class Corpus:
    """The prompts and answers of the requests a decoder served (SGLang's NGRAM keeps such a
    cache), so a request's round finds a longer match in what others said than in its own
    history: answers share their phrasing and structure. The oldest half is dropped past
    `capacity` tokens."""

    def __init__(self, max_n: int, capacity: int):
        self.max_n, self.capacity = max_n, capacity
        self.index = NgramIndex(max_n)
        self.requests: list[list[int]] = []

    def add(self, tokens: list[int]) -> None:
        if self.capacity <= 0:
            return
        self.requests.append(tokens)
        self.index.extend(tokens + [SEPARATOR])
        if len(self.index.tokens) > self.capacity:  # rebuilt from the newer half
            kept, total = [], 0
            for r in reversed(self.requests):
                total += len(r) + 1
                if total > self.capacity // 2:
                    break
                kept.append(r)
            self.requests, self.index = [], NgramIndex(self.max_n)
            for r in reversed(kept):
                self.add(r)

    def lookup(self, history: list[int], length: int, min_n: int) -> tuple[list[int], int]:
        """The `length` tokens that followed the latest occurrence in the corpus of history's
        last n tokens (n >= min_n, the longest), up to that request's end, padded with its last
        one; ([], 0) where none."""
        q, n = self.index.find(history, min_n)
        tokens = self.index.tokens[q + 1:q + 1 + length] if n else []
        if SEPARATOR in tokens:
            tokens = tokens[:tokens.index(SEPARATOR)]
        if not tokens:
            return [], 0
        return tokens + [tokens[-1]] * (length - len(tokens)), n


def lookup_chain(own: NgramIndex, corpus: Corpus, length: int, min_match: int) -> tuple[list[int], int]:
    """A sequence's chain of `length` tokens and its match length: its own history's lookup
    (own, indexed up to its newest token), unless the corpus holds a longer match of at least
    min_match and 2 tokens (single tokens recur everywhere)."""
    chain, n = own.lookup(length)
    other, m = corpus.lookup(own.tokens, length, max(2, min_match, n + 1))
    return (other, m) if m else (chain, n)


def chain_tree(tokens: Tensor) -> DraftTree:
    """tokens [B, T] (the root, then the draft) as a DraftTree that is one chain: node i's parent
    i - 1, its depth i, each node seeing itself and those before it."""
    B, T = tokens.shape
    nodes = torch.arange(T, device=tokens.device)
    parent = (nodes - 1).clamp(min=0).expand(B, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril().expand(B, T, T)
    return DraftTree(tokens, parent, nodes.expand(B, T), mask)


class NgramDecoder(PlainDecoder):
    """PlainDecoder's rows and joins, with rounds that verify each row's prompt-lookup chain."""

    def __init__(self, target: Transformer, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                 min_match: int = 1, max_match: int = NGRAM_MAX, max_batch: int = 1,
                 max_seq_len: int | None = None, prefix_cache: bool = False,
                 disable_by_batch_size: int | None = None, corpus_tokens: int = DEFAULT_CORPUS_TOKENS):
        """num_draft_tokens: the chain's length k (vLLM's num_speculative_tokens); min_match /
        max_match: the shortest and longest run of latest tokens looked up (vLLM's
        prompt_lookup_min / prompt_lookup_max); disable_by_batch_size: while more sequences run,
        every round is a plain step (vLLM's name; the server's CPU default, as with a head: a
        batch's chains make the verify compute-bound); corpus_tokens: how many tokens of the
        requests it served it keeps to look up in too (Corpus; 0: none)."""
        if num_draft_tokens < 1:
            raise UserError(f"an n-gram draft needs num_draft_tokens >= 1, got {num_draft_tokens}")
        if not 1 <= min_match <= max_match:
            raise UserError(f"n-gram lookup needs 1 <= min_match <= max_match, got {min_match}, {max_match}")
        super().__init__(target, max_batch, max_seq_len, prefix_cache)
        self.k, self.min_match, self.max_match = num_draft_tokens, min_match, max_match
        self.disable_by_batch_size = disable_by_batch_size
        self.corpus = Corpus(max_match, corpus_tokens)
        self.max_pending = num_draft_tokens  # a round's slots past a sequence's end
        self.last_round_plain = False  # (the server's metrics count drafts only where a round made them)
        self.verify_fn: BucketedStep | None = None  # compile()

    def compile(self, mode: str | None = None, max_bs: int | None = None) -> NgramDecoder:
        """PlainDecoder's compiled plain steps, and the chain's verify (forward and argmax) as one
        graph per batch bucket (BucketedStep, the kv length traced), compiled at its first call."""
        super().compile(mode, max_bs)
        settings = compile_settings(self.target)
        options = step_options(self.target, settings, mode)
        self.verify_fn = BucketedStep(self._verify, compile_step(self._verify, mode, settings, options),
                                      self.max_bs, clone=mode == CUDA_GRAPHS, mask_arg=2,
                                      max_kv=self.max_seq_len)
        return self

    def _verify(self, tokens: Tensor, L: Tensor, kv_ref: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [B, T] (the root, then the chain) at positions = slots L..L+T-1; kv_ref [B, kv_len]:
        only its length is read (the mask is built here, in the graph). Returns the logits
        [B, T, V] and their argmaxes [B, T]."""
        T = tokens.shape[1]
        pos = L[:, None] + torch.arange(T, device=tokens.device)
        logits, _ = self.target(tokens, pos, pos, causal_mask(L, T, kv_ref.shape[-1]))
        return logits, greedy_tokens(logits)

    def check(self, seq: Sequence_) -> None:
        """A UserError unless the sequence fits (its prompt, max_new_tokens and a round's chain)."""
        check_admissible(self.target, seq, self.max_seq_len - self.k, "n-gram speculative decoding")

    def lookup(self, forced: dict[int, list[int]]) -> tuple[Tensor, Tensor]:
        """Each running row's chain [B, k] and the length of its match [B] (0: none), from its
        history on the host (prompt and output: the newest output token is the root; its
        NgramIndex). A row in `forced` (what its grammar forces next) drafts those tokens first,
        then the lookup's continuation after them (tree.ngram_lookup: its index holds only
        emitted tokens); it counts as matched."""
        chains, matched = [], []
        for b, s in enumerate(self.seqs):
            history = s.prompt + s.output
            if b in forced:
                tokens = forced[b][:self.k]
                ahead = history + tokens
                more, _ = ngram_lookup(torch.tensor([ahead]), torch.tensor([len(ahead) - 1]), self.k,
                                       self.max_match)
                chains.append((tokens + more[0].tolist())[:self.k])
                matched.append(self.max_match)
                continue
            if s.ngrams is None:
                s.ngrams = NgramIndex(self.max_match)
            s.ngrams.extend(history[len(s.ngrams.tokens):])
            chain, n = lookup_chain(s.ngrams, self.corpus, self.k, self.min_match)
            chains.append(chain)
            matched.append(n)
        return torch.tensor(chains), torch.tensor(matched)

    def warm_up_passes(self) -> Iterator[None]:
        """engine.warm_up's passes: every round a verify, matched or not (min_match 0: a row
        without a match verifies its root repeated), then every round a plain step (no match
        that long), so both paths' graphs compile; then the settings are restored and the
        warm-up's requests forgotten."""
        min_match = self.min_match
        try:
            for shortest in (0, self.max_match + 1):
                self.min_match = shortest
                yield
        finally:
            self.min_match = min_match
            self.forget()

    def forget(self) -> None:
        """Drop the corpus of served requests (a warm-up's: the bench's are the prompts it times)."""
        self.corpus = Corpus(self.max_match, self.corpus.capacity)

    def _learn(self, results: list[tuple[Sequence_, list[int]]]) -> list[tuple[Sequence_, list[int]]]:
        """The corpus takes the prompt and answer of each sequence that finished this round."""
        for seq, _ in results:
            if seq.done:
                self.corpus.add(seq.prompt + seq.output)
        return results

    def forced(self) -> dict[int, list[int]]:
        """{row: the tokens its grammar forces next} for the rows whose grammar forces any."""
        if all(s.matcher is None for s in self.seqs):
            return {}
        from eagle_infer.grammar import forced_tokens

        found = {b: forced_tokens(s.matcher, s.params.grammar.encode, self.k) if s.matcher is not None else []
                 for b, s in enumerate(self.seqs)}
        return {b: tokens for b, tokens in found.items() if tokens}

    @torch.no_grad()
    def step(self) -> list[tuple[Sequence_, list[int]]]:
        """One round for every active sequence: its chain verified where any row's lookup
        matched, else a plain step; returns (sequence, new tokens)."""
        B = len(self.seqs)
        if B == 0:
            return []
        params = [s.params for s in self.seqs]
        plain_above = self.disable_by_batch_size
        if plain_above is not None and B > plain_above:
            return self._plain()
        chain, matched = self.lookup(self.forced())
        if not bool((matched >= self.min_match).any()):
            return self._plain()
        self.last_round_plain = False
        L, T = self.L[:B], self.k + 1
        tokens = torch.cat([self.last[:B, None], chain.to(self.device)], 1)  # [B, T]
        L_max = max(s.cached for s in self.seqs)
        compiled = self.verify_fn is not None and batch_bucket(B) <= self.max_bs
        kv = (compiled_kv_len(L_max + T, self.max_seq_len, self.compiled_step.mode) if compiled
              else kv_len_for(L_max + T, self.max_seq_len))
        kv_ref = torch.zeros(B, kv, dtype=torch.bool, device=self.device)
        verify = self.verify_fn if compiled else self._verify
        logits, picked = verify(tokens, L, kv_ref)  # [B, T, V], [B, T]
        drafted, tree = chain.tolist(), chain_tree(tokens)
        scored = penalize_seqs(logits, self.seqs, tree)  # logits itself where no row has a setting
        if all(p.greedy for p in params):  # a chain's walk on the host: one read of the argmaxes
            picks = (picked if scored is logits else greedy_tokens(scored)).tolist()  # [B][T]
            accepted = [next((i for i, t in enumerate(d) if t != pick[i]), self.k)
                        for d, pick in zip(drafted, picks)]
            bonuses = [pick[n] for n, pick in zip(accepted, picks)]
        else:
            gens = [s.generator for s in self.seqs]
            acc = accept_sampling(tree, scored, params, gens, self.k)
            accepted, bonuses = acc.n_accepted.tolist(), acc.bonus.tolist()
        # the chain's first n tokens are in the cache already, at their slots
        self.L[:B] += torch.tensor(accepted, device=self.device) + 1
        self.last[:B] = torch.tensor(bonuses, device=self.device)
        results = []
        for b, (seq, k, drafted_b, bonus) in enumerate(zip(self.seqs, accepted, drafted, bonuses)):
            drafted_b = drafted_b[:k]
            seq.cached += k + 1
            seq.accepted.append(k)
            self.stats.record(k)
            seq.set_logits(logits[b])  # logprobs: row i is the distribution in front of token i
            results.append((seq, seq.emit(drafted_b + [bonus])))
        self.stats.rounds += 1
        self.rows.drop_finished()
        return self._learn(results)

    def _plain(self) -> list[tuple[Sequence_, list[int]]]:
        self.last_round_plain = True
        self.stats.plain_rounds += 1
        return self._learn(super().step())


def generate_ngram(target: Transformer, prompts: list[list[int]], max_new_tokens: int,
                   params: list[SamplingParams] | None = None, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                   min_match: int = 1, eos_token_ids: list[int] | None = None,
                   max_seq_len: int | None = None, decoder: NgramDecoder | None = None,
                   on_token: Callable[[int, int], bool] | None = None) -> tuple[list[list[int]], SpecStats]:
    """Decode a batch of prompts with prompt-lookup speculation; the new tokens of each and the
    decoder's SpecStats (generate_speculative's shape; on_token(index, token) as there)."""
    if max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    params = params or [SamplingParams()] * len(prompts)
    eos = set(target.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    dec = decoder or NgramDecoder(target, num_draft_tokens, min_match, max_batch=len(prompts),
                                  max_seq_len=max_seq_len)
    return decode_to_end(dec, prompts, max_new_tokens, params, eos, on_token)
