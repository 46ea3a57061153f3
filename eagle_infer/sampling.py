"""Sampling settings and the functions that turn logits into a sampling distribution.

Plain decoding and speculative verification both call `penalize` and `logits_to_probs`, so "the
target's distribution" means the same thing in both: that is what makes rejection sampling
lossless. Greedy rows (temperature 0) become a one-hot distribution on the argmax.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from eagle_infer.errors import UserError


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    min_p: float = 0.0  # 0 = off; see logits_to_probs
    # OpenAI's penalties on the tokens generated so far (a logit minus frequency x its count minus
    # presence if it occurred), vLLM's and SGLang's repetition_penalty on the prompt's and the
    # generated tokens (a seen token's logit / p where > 0, else x p), and logit_bias (token id ->
    # added to its logit): see `penalize`.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # vLLM's: the row's stop tokens (EOS, stop_token_ids) are barred before then
    # vLLM's: only these tokens may be sampled (None: any)
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words, tokenized: a word's last token is barred where the output ends with the rest
    bad_words: list[list[int]] = field(default_factory=list)
    # structured outputs: a grammar.Grammar (compiled); its sequence's matcher follows
    # the output (Sequence_.matcher), and penalize bars what it forbids
    grammar: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):  # OpenAI's range
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise UserError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:  # vLLM's range
            raise UserError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise UserError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise UserError("allowed_token_ids must be a non-empty list of token ids >= 0")
        if any(not word or min(word) < 0 for word in self.bad_words):
            raise UserError("bad_words must be non-empty token id sequences (ids >= 0)")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0 or not -100.0 <= bias <= 100.0:
                raise UserError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got "
                                f"{token}: {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def distribution(self) -> tuple[float, float, int, float]:
        """logits_to_probs's settings (temperature, top_p, top_k, min_p): rows alike share a call."""
        return self.temperature, self.top_p, self.top_k, self.min_p

    def new_matcher(self) -> Any:
        """A matcher that follows one sequence's output under the grammar (None without one)."""
        if self.grammar is None:
            return None
        from eagle_infer.grammar import new_matcher  # xgrammar (seconds to import), only where asked

        return new_matcher(self.grammar)

    @property
    def penalized(self) -> bool:
        """Whether `penalize` changes this sequence's logits."""
        return self.grammar is not None or self._penalized_besides_grammar

    @property
    def _penalized_besides_grammar(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.allowed_token_ids is not None
                    or self.bad_words)

    @property
    def graph_distribution(self) -> bool:
        """Temperature and min-p alone (greedy included): the distributions a sampled round's
        graph computes in-graph (graph_probs), so its verify and walk are one graph."""
        return not self.penalized and self.top_p == 1.0 and self.top_k == 0

    @property
    def graph_argmax(self) -> bool:
        """Greedy with no setting but a grammar: the token the decoders' greedy graphs compute
        in-graph, the argmax of the logits its bitmask allows (masked_greedy_tokens; the raw
        logits' without one)."""
        return self.greedy and not self._penalized_besides_grammar

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator | None:
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g


def grammar_step(matcher: Any, token: int) -> bool:
    """A sequence's grammar matcher takes the token it emitted; True where that ended the grammar
    (its stop token accepted), which ends the sequence."""
    matcher.accept_token(token)
    return matcher.is_terminated()


def greedy_tokens(logits: Tensor) -> Tensor:
    """logits [..., V] -> logits.argmax(-1): the first of equal maxima, a NaN counting as the
    maximum, as torch's. Compiled on a CPU it is a max and then the least index that holds it:
    Inductor vectorizes both reductions where its argmax over a vocabulary runs scalar (4 x 49152
    bf16 logits, a verify's: 0.61 ms as argmax against 0.15, a round's ~3% on a 2-core Zen 2;
    eager, torch's argmax is as fast). NaNs are found as logits != logits: Inductor ran isnan()
    a value at a time (a 6-row verify's kernel 243 -> 103 us a round, a plain step's 47 -> 24 us,
    AMX Xeon, torch.profiler with TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1)."""
    if logits.device.type != "cpu" or not torch.compiler.is_compiling():
        return logits.argmax(-1)
    top = logits.amax(-1, keepdim=True)
    index = torch.arange(logits.shape[-1], dtype=torch.int32, device=logits.device)
    hit = (logits == top) | (logits != logits)
    return torch.where(hit, index, logits.shape[-1]).amin(-1).long()


def masked_greedy_tokens(logits: Tensor, bitmask: Tensor) -> Tensor:
    """greedy_tokens of logits [..., V] among the tokens a grammar's bitmask [..., ceil(V / 32)]
    int32 allows (xgrammar's: bit t % 32 of word t // 32 set = token t allowed; all bits set:
    no grammar). Pointwise and a view, so a compiled step fuses it into the argmax's reductions."""
    V = logits.shape[-1]
    bit = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[..., None] >> bit) & 1).flatten(-2)[..., :V]  # [..., V]
    return greedy_tokens(logits.masked_fill(allowed == 0, float("-inf")))


def every_token_bitmask(*rows: int, vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """[*rows, ceil(V / 32)] int32 with every bit set: the grammar bitmask of rows without one."""
    return torch.full((*rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)


def grammar_bitmask(matchers: Sequence[Any], vocab_size: int,
                    device: torch.device | str = "cpu") -> Tensor | None:
    """[B, ceil(V / 32)] int32 on device: the tokens each row's grammar matcher allows next (every
    token for rows without one, or whose grammar has ended); None where no row has one."""
    if all(m is None for m in matchers):
        return None
    from eagle_infer.grammar import allowed_after

    every = every_token_bitmask(len(matchers), vocab_size=vocab_size)
    return torch.cat([every[b:b + 1] if m is None else allowed_after(m, [[]], vocab_size)
                      for b, m in enumerate(matchers)]).to(device)


def penalize(logits: Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
             outputs: Sequence[Sequence[int]], stops: Sequence[Collection[int]],
             tree_tokens: Tensor | None = None, tree_mask: Tensor | None = None,
             matchers: Sequence[Any] | None = None) -> Tensor:
    """logits [B, N, V] of N tree nodes a row (N = 1: a plain step) -> fp32 logits after each row's
    allowed_token_ids, bad_words, min_tokens (its stop tokens barred), logit_bias, repetition,
    frequency and presence penalties, in vLLM's order. A row's output is what it emitted so far; a
    tree's root (node 0) is its last token, and node j's history adds the drafted tokens on its path
    (tree_mask [B, N, N], ancestor-or-self; tokens [B, N]), so each node is penalized as plain
    decoding would be had that path been emitted and speculation stays lossless (SGLang's verify
    penalizes every node by the round's start alone). stops: the tokens that end each row (EOS
    unless ignored, stop token ids). Returns logits itself when no row has a setting; the others'
    rows are copied unchanged. A row with a grammar first has what it forbids barred, from its
    matcher's state (the output) after each node's path (grammar.allowed_after), as vLLM applies
    its grammar's bitmask before the other settings."""
    rows = [b for b, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)
    B, N, V = out.shape
    dev = out.device
    for b in rows:
        p, x = params[b], out[b]  # x [N, V]: a view, changed in place
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(torch.tensor(outputs[b], dtype=torch.long), minlength=V)
            counts = counts.to(dev, torch.float32).expand(N, V).contiguous()  # [N, V]
            if N > 1:  # each node's path below the root
                counts.scatter_add_(1, tree_tokens[b, 1:].expand(N, N - 1), tree_mask[b, :, 1:].float())
        # each node's drafted path, for the settings that read the tokens before it
        paths = node_paths(tree_tokens, tree_mask, b, N) if p.grammar is not None or p.bad_words else []
        if p.grammar is not None:
            from eagle_infer.grammar import allowed_after, apply_bitmask

            if matchers is None or matchers[b] is None:
                raise ValueError("a row with a grammar needs its matcher (Sequence_.matcher)")
            apply_bitmask(x, allowed_after(matchers[b], paths, V))
        if p.allowed_token_ids is not None:
            allowed = torch.zeros(V, dtype=torch.bool, device=dev)
            allowed[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=dev)] = True
            x.masked_fill_(~allowed, float("-inf"))
        if p.bad_words:  # a node's history: the output, then its path, as if that had been emitted
            for j, history in enumerate([*outputs[b], *path] for path in paths):
                barred = [w[-1] for w in p.bad_words
                          if len(w) <= len(history) + 1 and history[len(history) - len(w) + 1:] == w[:-1]]
                x[j, barred] = float("-inf")
        if p.min_tokens and stops[b]:  # node j's next token is the row's len(output) + depth_j + 1st
            depth = tree_mask[b, :, 1:].sum(-1) if N > 1 else torch.zeros(N, dtype=torch.long, device=dev)
            early = (len(outputs[b]) + depth < p.min_tokens)[:, None]  # [N, 1]
            ids = torch.tensor(sorted(stops[b]), dtype=torch.long, device=dev)
            x[:, ids] = x[:, ids].masked_fill(early, float("-inf"))
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            x[:, ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=dev)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[:, torch.tensor(prompts[b], dtype=torch.long, device=dev)] = True
            r = p.repetition_penalty
            x.copy_(torch.where(seen, torch.where(x > 0, x / r, x * r), x))
        if p.frequency_penalty or p.presence_penalty:
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


def node_paths(tree_tokens: Tensor | None, tree_mask: Tensor | None, b: int, N: int) -> list[list[int]]:
    """The drafted tokens on the path from row b's tree root to each of its N nodes (by depth;
    the root's own, the last emitted token, not included): what the node's logits come after."""
    if N == 1:
        return [[]]
    mask = tree_mask[b, :, 1:].cpu()  # [N, N - 1] ancestor-or-self below the root
    depth, tokens = mask.sum(-1), tree_tokens[b, 1:].tolist()
    return [[tokens[i] for i in sorted(mask[j].nonzero().flatten().tolist(), key=lambda i: int(depth[i + 1]))]
            for j in range(N)]


def logits_to_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                    min_p: float = 0.0) -> Tensor:
    """logits [..., V] -> fp32 probabilities [..., V] after temperature, min-p, top-k and top-p
    (vLLM's order). min-p drops the tokens less likely than min_p x the most likely one."""
    logits = logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).float()
    logits = logits / temperature
    if min_p > 0.0:  # p < min_p * p_max  <=>  logit < logit_max + log(min_p)
        floor = logits.amax(-1, keepdim=True) + math.log(min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = top_p_probs(probs.reshape(-1, probs.shape[-1]), top_p).reshape(probs.shape)
    return probs


def graph_probs(logits: Tensor, temperature: Tensor, log_min_p: Tensor) -> Tensor:
    """logits [B, N, V] -> fp32 probabilities [B, N, V]: logits_to_probs's for rows with top_p 1
    and top_k 0 (SamplingParams.graph_distribution), each row's settings a tensor so a compiled
    round traces them: temperature [B] (0: greedy, the argmax one-hot) and log_min_p [B] fp32
    (log(min_p), -inf for none; taken on the host in double as logits_to_probs does)."""
    logits = logits.float()
    t = temperature[:, None, None]
    scaled = logits / torch.where(t > 0, t, 1.0)
    floor = scaled.amax(-1, keepdim=True) + log_min_p[:, None, None]
    probs = torch.softmax(scaled.masked_fill(scaled < floor, float("-inf")), dim=-1)
    index = torch.arange(logits.shape[-1], device=logits.device)
    one_hot = (index == greedy_tokens(logits)[..., None]).float()
    return torch.where(t > 0, probs, one_hot)


def graph_settings(params: Sequence[SamplingParams], device: torch.device | str) -> tuple[Tensor, Tensor]:
    """graph_probs's per-row temperature [B] and log_min_p [B] (fp32, on device) for params."""
    temperature = [p.temperature for p in params]
    log_min_p = [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params]
    return (torch.tensor(temperature, dtype=torch.float32, device=device),
            torch.tensor(log_min_p, dtype=torch.float32, device=device))


# A row's nucleus is among its most likely tokens, so top-p sorts only topk candidates, more of
# them for the rows whose candidates hold less than top_p (then all: exact for every row). Sorting
# the whole 49k vocabulary cost 2.4 ms a row on a 2-core CPU (17.5 ms a 7-node verify's rows, more
# than a decode step of the 135M target); topk(64) of 7 rows 0.5 ms. The target's own answers:
# at temperature 0.7 the 64 most likely tokens held top_p 0.95 in 97.5% of positions, the 1,024
# in all; at 1.0, 71% and 99%. Off a CPU the full sort is cheap and the candidates' check would
# add a host read a step, so there rows sort whole.
TOP_P_CANDIDATES = (64, 1024)


def top_p_probs(probs: Tensor, top_p: float) -> Tensor:
    """probs [R, V] -> each row's nucleus renormalised [R, V]: its smallest most-likely prefix
    whose mass reaches top_p (a token is dropped when the mass strictly before it already does;
    keeps >= 1), zeros elsewhere. Written from the candidates alone (a zero row, then a scatter of
    the kept ones): a mask over the whole vocabulary cost more than the candidates' topk
    (masked_fill of 6 x 49,152: 0.13-0.5 ms on a 2-core Zen 4)."""
    R, V = probs.shape
    out = torch.zeros_like(probs)
    rows = torch.arange(R, device=probs.device)  # the rows whose nucleus is not found yet
    for k in [c for c in TOP_P_CANDIDATES if c < V] if probs.device.type == "cpu" else []:
        vals, idx = (probs if rows.numel() == R else probs[rows]).topk(k, dim=-1)
        cum = vals.cumsum(-1)
        # the candidates hold the nucleus when their mass reaches top_p: every other token has
        # at least that much before it
        done = cum[:, -1] >= top_p
        kept = torch.where(cum - vals < top_p, vals, 0.0)
        kept = kept / kept.sum(-1, keepdim=True)
        if bool(done.all()):
            return out.index_put_((rows[:, None], idx), kept)
        out.index_put_((rows[done][:, None], idx[done]), kept[done])
        rows = rows[~done]
    # the rest sort whole (every row off a CPU: no boolean indexing, so no host read)
    vals, idx = (probs if rows.numel() == R else probs[rows]).sort(dim=-1, descending=True)
    kept = torch.where(vals.cumsum(-1) - vals < top_p, vals, 0.0)
    return out.index_put_((rows[:, None], idx), kept / kept.sum(-1, keepdim=True))


def sample(probs: Tensor,
           generator: torch.Generator | Sequence[torch.Generator | None] | None = None) -> Tensor:
    """probs [N, V] (rows need not sum to 1) -> token ids [N].

    Inverts each row's CDF at one uniform draw: exact, and one random number per row, where
    torch.multinomial took ~1.4 ms per 49k-token row on a CPU (most of a batch-32 capture
    step's sampling). right=True never lands on a zero-probability token. `generator` is one
    for all rows, or one per row (each row's uniform from its own stream, as if sampled alone).
    """
    def uniforms(n: int, g: torch.Generator | None) -> Tensor:
        return torch.rand(n, 1, generator=g, device=probs.device, dtype=torch.float64)

    if isinstance(generator, Sequence):
        if len(generator) != probs.shape[0]:
            raise ValueError(f"{len(generator)} generators for {probs.shape[0]} rows")
        u = torch.cat([uniforms(1, g) for g in generator])
    else:
        u = uniforms(probs.shape[0], generator)
    return inverse_cdf(probs, u[:, 0])


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """probs [N, V] (rows need not sum to 1), u [N] uniforms in [0, 1) -> token ids [N]: each
    row's CDF inverted at its uniform (sample's draw; a compiled step's too, the uniforms drawn
    before it)."""
    cdf = probs.double().cumsum(-1)  # [N, V]; float64 so 49k small terms add up exactly enough
    idx = torch.searchsorted(cdf, u[:, None].double() * cdf[:, -1:], right=True)
    return idx[:, 0].clamp(max=probs.shape[-1] - 1)


def step_uniforms(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                  device: torch.device | str) -> Tensor:
    """[B] float64: the uniform each sampled row's next token is drawn at, from its own generator
    (sample's draw, so a seeded row's tokens are the same whether a compiled step or pick_tokens
    samples it); 0 for greedy rows, which draw none."""
    return torch.cat([torch.zeros(1, dtype=torch.float64, device=device) if p.greedy else
                      torch.rand(1, generator=g, device=device, dtype=torch.float64)
                      for p, g in zip(params, generators)])


def next_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token for one sequence from its logits [V] (penalized already)."""
    if params.greedy:
        return int(logits.argmax())
    probs = logits_to_probs(logits[None], *params.distribution)
    return int(sample(probs, generator)[0])
