"""Plain (non-speculative) decoding on our runtime: batched, greedy or sampled, streaming.

    python -m eagle_infer.generate --prompt "Tell me about Paris."
    python -m eagle_infer.generate --messages '[{"role": "user", "content": "Hi"}]' --temperature 0.7
    python -m eagle_infer.generate --prompt "a" --prompt "a longer prompt" --max-new-tokens 32

This is also the baseline that speculative decoding must reproduce token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from eagle_infer.cpu_linears import (
    FrozenCompile,
    cached_kernel_templates,
    compile_settings,
    step_options,
    without_amx_int8_gemm,
    without_mkl_prepack,
)
from eagle_infer.errors import UserError, cli_errors
from eagle_infer.model import Transformer, causal_mask
from eagle_infer.sampling import (
    SamplingParams,
    every_token_bitmask,
    grammar_bitmask,
    grammar_step,
    graph_probs,
    graph_settings,
    greedy_tokens,
    inverse_cdf,
    logits_to_probs,
    masked_greedy_tokens,
    penalize,
    sample,
    step_uniforms,
)

# Called with (sequence index, token id); returning True stops that sequence (stop strings).
TokenCallback = Callable[[int, int], bool]


def kv_len_for(needed: int, max_seq_len: int, multiple: int = 64) -> int:
    """Attend over a few more slots than needed, rounded so shapes repeat across steps."""
    return min(max_seq_len, -(-needed // multiple) * multiple)


def check_fits(model: Transformer, prompt_lens: Sequence[int], max_new_tokens: int) -> None:
    ctx = model.config.max_position_embeddings
    for i, n in enumerate(prompt_lens):
        if n == 0:
            raise UserError(f"prompt {i} is empty")
        if n + max_new_tokens > ctx:
            raise UserError(
                f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} it exceeds the "
                f"context length of {ctx} tokens"
            )


def ensure_cache(model: Transformer, batch: int, seq_len: int) -> None:
    """(Re)allocate the KV cache only when the current one is too small."""
    if model.max_batch < batch or model.max_seq_len < seq_len:
        model.setup_cache(max(batch, model.max_batch), min(model.config.max_position_embeddings,
                                                           max(seq_len, model.max_seq_len)))


def join_groups(lengths: Sequence[int], max_padding: float = 0.1, max_rows: int | None = None,
                max_tokens: int | None = None) -> list[list[int]]:
    """Split sequences joining together into prefill batches: indices, shortest prompts first,
    grouped while the right-padded batch holds at most `max_padding` more tokens than the
    prompts (and at most `max_rows` rows and `max_tokens` padded tokens). A padded token costs
    as much as a real one, and on a CPU one forward for 8 equal prompts beats 8 forwards by only
    ~18% (scripts/bench_join_prefill.py), so padding is kept small; on a GPU, where a short
    prefill is latency-bound, batching wins far more."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        n = lengths[i]
        rows = len(groups[-1]) + 1 if groups else 0
        fits = (max_rows is None or rows <= max_rows) and (max_tokens is None or n * rows <= max_tokens)
        if groups and fits and n * rows <= (1 + max_padding) * (total + n):
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


@torch.no_grad()
def prefill(model: Transformer, prompts: Sequence[Sequence[int]], hidden_layers: Sequence[int] = (),
            row0: int = 0, kv_len: int | None = None,
            max_new_tokens: Sequence[int] | None = None,
            start: Sequence[int] | None = None,
            logits: bool = True) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Write the prompts (right-padded) into cache rows row0, row0+1, ...; logits [B, V] at each
    last token (None without `logits`: a chunk of a prompt, chunked prefill), and the requested
    hidden states [B, T, H] at every position written. max_new_tokens: how many tokens each
    sequence may add (Transformer.start_rows; None: none). start: slots each row already holds (a
    prefix taken over, prefix_cache): its prompt is written from there.

    Padding tokens land in slots beyond each prompt, where no later query looks, and are
    overwritten by the first generated tokens.
    """
    dev = model.embed_tokens.weight.device
    first = list(start or [0] * len(prompts))
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    new = [len(p) - f for p, f in zip(prompts, first)]
    B, T = len(prompts), max(new)
    tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
    for i, (p, f) in enumerate(zip(prompts, first)):
        tokens[i, : new[i]] = torch.tensor(p[f:], dtype=torch.long)
    max_lens = lens + torch.tensor(max_new_tokens or [0] * B, device=dev)
    counts = torch.tensor(new, device=dev) if logits else None  # forward_padded's lens: logits at their ends
    return forward_padded(model, tokens, counts, hidden_layers, row0, kv_len, max_lens,
                          torch.tensor(first, device=dev) if any(first) else None)


@torch.no_grad()
def forward_padded(model: Transformer, tokens: torch.Tensor, lens: torch.Tensor | None = None,
                   hidden_layers: Sequence[int] = (), row0: int = 0, kv_len: int | None = None,
                   max_lens: torch.Tensor | None = None,
                   start: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """One forward over right-padded tokens [B, T] into cache rows row0.., from position 0 (or
    start [B], the slots a row holds already): logits [B, V] at each row's last token (lens [B],
    tokens in this call; None = no logits, as capture wants) and the hidden states [B, T, H] of
    `hidden_layers`. What prefill and the capture's teacher-forced pass share. max_lens [B]: how
    long each sequence may grow (Transformer.start_rows; None: lens, else T, as transformers'
    forward over the padded batch decides)."""
    B, T = tokens.shape
    dev = tokens.device
    model.start_rows(row0, max_lens if max_lens is not None else lens if lens is not None
                     else torch.full((B,), T))
    first = torch.zeros(B, dtype=torch.long, device=dev) if start is None else start
    pos = first[:, None] + torch.arange(T, device=dev)[None]
    kv_len = kv_len or kv_len_for(T if start is None else int(start.max()) + T, model.max_seq_len)
    mask = causal_mask(first, T, kv_len)
    # rows that all start at one slot (from 0, or a chunk's): a causal mask past that slot
    starts = [0] if start is None else start.tolist()
    logits, hidden = model(tokens, pos, pos, mask, logits_at=None if lens is None else (lens - 1)[:, None],
                           hidden_layers=hidden_layers, compute_logits=lens is not None, row0=row0,
                           causal=len(set(starts)) == 1, offset=starts[0])
    return (None if logits is None else logits[:, 0]), hidden


def pick_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> next token per sequence, each with its own settings (greedy: the
    argmax, when a compiled step computed it already)."""
    out = greedy_tokens(logits) if greedy is None else greedy.clone()
    # Sampled rows with the same settings share one softmax and one CDF search: one at a time,
    # a row cost ~14 ATen ops a step (scripts/probe_capture_ops.py), ~3,600 launches a step for a
    # GPU capture of 256 sampled answers. Each row still draws its uniform from its own
    # generator, so its token is the one it would get alone.
    groups: dict[tuple[float, float, int, float], list[int]] = {}  # SamplingParams.distribution
    for b, p in enumerate(params):
        if not p.greedy:
            groups.setdefault(p.distribution, []).append(b)
    for setting, rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        probs = logits_to_probs(logits[idx], *setting)  # [len(rows), V]
        out[idx] = sample(probs, [generators[b] for b in rows])
    return out


# Compiled steps run at a few fixed batch shapes, so a new batch size reuses a graph instead of
# recompiling: batches pad to the next bucket. The kv length (slots attention reads) is a traced
# symbol (mark_kv_dynamic): one compile per batch bucket serves every length. CUDA graphs record
# one graph per concrete shape, so there the length comes in power-of-two buckets (kv_bucket).
BATCH_BUCKETS = (1, 2, 4, 8)
RECOMPILE_LIMIT = 64
CUDA_GRAPHS = "reduce-overhead"  # the torch.compile mode that records and replays CUDA graphs


def batch_bucket(B: int) -> int:
    """The batch a compiled step runs at: the next of 1, 2, 4, 8, then a multiple of 8."""
    return next((b for b in BATCH_BUCKETS if B <= b), -(-B // 8) * 8)


def kv_bucket(needed: int, max_seq_len: int) -> int:
    """kv_len of a compiled step: the next power of two >= needed (at least 128), capped at the
    cache: attention reads at most 2x the slots it needs, over a handful of shapes."""
    return min(max_seq_len, max(128, 1 << (needed - 1).bit_length()))


def compile_mode_for(device: torch.device | str) -> str | None:
    """The torch.compile mode of compiled steps on a device: CUDA graphs on CUDA, where a small
    model's step is bound by kernel launches; Inductor's default (C++/OpenMP kernels) on a CPU."""
    return CUDA_GRAPHS if torch.device(device).type == "cuda" else None


def compiled_kv_len(needed: int, max_seq_len: int, mode: str | None) -> int:
    """kv_len of a compiled step: a power-of-two bucket under CUDA graphs (each length records a
    graph), else rounded like an eager step's (kv_len_for); either way short of the full cache
    while that still covers `needed`: the full length compiles a graph of its own
    (mark_kv_dynamic). Under CUDA graphs the length below the full cache is a multiple of 8,
    since Inductor's CUDA kernels guard kv % 8 == 0 (another length would recompile)."""
    if mode == CUDA_GRAPHS:
        kv, below = kv_bucket(needed, max_seq_len), (max_seq_len - 1) // 8 * 8
    else:
        kv, below = kv_len_for(needed, max_seq_len), max_seq_len - 1
    return below if kv == max_seq_len and needed <= below else kv


def mark_kv_dynamic(mask: torch.Tensor, max_seq_len: int) -> None:
    """Trace the mask's last dimension, the kv length, as a symbol (below max_seq_len), so one
    graph serves every length below the full cache. Measured in one process on the AMD EPYC
    (AVX512-BF16, 2 threads, bf16, plain step, a capture job sharing the cores): the same logits
    as the static graphs at kv 128 / 256 / 512 / 1024, one compile of 16 s instead of four of
    43-65 s; on idle cores the bench's tokens/s are the same as with static graphs (docs/runtime.md).
    The full cache length is a specialisation of its own (there the slice of the cache is the
    whole, contiguous tensor, which the graph's guards tell apart): it compiles once if reached."""
    if mask.shape[-1] >= max_seq_len:
        return
    # maybe_mark_dynamic, not mark_dynamic's declared range: a graph compiled (and cached on disk)
    # by a run with a shorter cache carries a guard kv <= its length; loaded by a run with a longer
    # one, it broke a declared range with a ConstraintViolationError, where it now just misses.
    # (CUDA: Inductor's kernels also guard kv % 8 == 0, which a range would violate.)
    torch._dynamo.maybe_mark_dynamic(mask, mask.dim() - 1)


def compiled_cache_rows(max_batch: int, max_bs: int) -> int:
    """Cache rows a decoder of max_batch rows needs when batches up to the bucket max_bs run
    padded to their bucket."""
    return max(max_batch, batch_bucket(min(max_batch, max_bs)))


class WithInductorSettings:
    """A compiled step called under Inductor settings and a compile-cache tag
    (cpu_linears.FrozenCompile): compilation happens lazily inside a call, at any batch
    bucket, so every call carries them. torch.compile's `options` would not do: freezing is
    decided outside their scope. The patches are built at the first call (which compiles; the
    tag hashes the weights then) and re-entered (38 us a call; built per call, 112 us: AMD EPYC
    AVX2)."""

    def __init__(self, fn: Callable, settings: FrozenCompile):
        self.fn, self.settings, self.patches = fn, settings, None

    def __call__(self, *args: torch.Tensor):
        if self.patches is None:
            import torch._inductor.config as inductor_config

            self.patches = (inductor_config.patch(self.settings.options),
                            torch.compiler.config.patch(cache_key_tag=self.settings.cache_tag),
                            without_mkl_prepack(), cached_kernel_templates(), without_amx_int8_gemm())
        inductor, compiler, no_mkl, templates, no_amx = self.patches
        # freezing needs grad off (else the template has no constant weight and no kernel)
        with torch.no_grad(), inductor, compiler, no_mkl, templates, no_amx:
            return self.fn(*args)


def compile_step(fn: Callable, mode: str | None = None, inductor: FrozenCompile | None = None,
                 options: dict | None = None) -> Callable:
    """torch.compile with full graphs and static shapes (but a traced kv length where the
    caller marks it: mark_kv_dynamic). Measured in one process on a 2-core Xeon (AVX-512, no
    AVX512-BF16: fp32), 1 thread, default model: plain step 72 ms compiled vs 83 ms eager,
    16-token verify 157 vs 169 ms. Several buckets share one code object, so the recompile limit
    is raised to hold them all.

    No Inductor weight freezing where the Linears run on oneDNN's prepacked weights (bf16 with
    native bf16; cpu_linears="onednn"): there it does not change a step's time (AMD EPYC
    AVX512-BF16, 2 threads, one process: 1 / 4 rows bf16 20.4 / 22.4 ms frozen, 20.6 / 22.2
    not; 16 rows 30.0 vs 29.4 bf16, 45.6 vs 45.7 fp32; 1 row fp32 39.0 vs 38.8; AMD EPYC AVX2
    only, fp32 one-row steps on MKL, one process, three rounds: 44.6-44.8 ms frozen, 38.8-43.2
    not), and it turns AOTAutograd's cache off, so a second start compiled a plain step in 19 s
    with it, 12 s without.

    Int8 targets and cpu_linears="inductor" (the fp32 default on AVX2 / AVX-512 CPUs) are the
    exception: `inductor` (cpu_linears.compile_settings) turns freezing on for Inductor's GEMM
    template, which needs constant weights.

    `options` (cpu_linears.step_options): Inductor options for Inductor's default mode (the C++
    wrapper, eager's bf16 rounding)."""
    import torch._dynamo.config

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if options and mode is not None:
        raise ValueError(f"Inductor options are for its default mode, not {mode!r}")
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, mode=mode, options=options)
    return compiled if inductor is None else WithInductorSettings(compiled, inductor)


class BucketedStep:
    """A compiled step run at batch buckets (batch_bucket), so a new batch size reuses a
    captured graph instead of compiling one. Inputs are padded by repeating the last real row:
    the padding rows' cache writes land in the rows past the active ones, which no sequence
    reads (a joining sequence's prefill overwrites them), so the cache needs
    batch_bucket(max_batch) rows. Batches whose bucket is over max_bs run the eager step.
    Where max_kv is set, argument mask_arg is the attention mask, whose kv length is traced as
    a symbol below max_kv (mark_kv_dynamic)."""

    def __init__(self, eager: Callable, compiled: Callable, max_bs: int, clone: bool = False,
                 mask_arg: int = 3, max_kv: int | None = None):
        self.eager, self.compiled, self.max_bs = eager, compiled, max_bs
        self.clone = clone  # CUDA graphs reuse their output buffers at the next replay
        self.mask_arg, self.max_kv = mask_arg, max_kv

    def __call__(self, *args: torch.Tensor):
        from torch.utils._pytree import tree_map

        B = args[0].shape[0]
        Bp = batch_bucket(B)
        if Bp > self.max_bs:
            return self.eager(*args)
        if Bp > B:
            args = tuple(torch.cat([a, a[-1:].expand(Bp - B, *a.shape[1:])]) for a in args)
        if self.max_kv:
            mark_kv_dynamic(args[self.mask_arg], self.max_kv)
        out = self.compiled(*args)
        if Bp == B and not self.clone:
            return out
        return tree_map(lambda t: t[:B].clone() if self.clone else t[:B], out)


class CompiledDecode:
    """The plain decode step, forward + argmax, as one compiled graph per batch bucket (and, under
    CUDA graphs, a recorded graph per kv bucket: compiled_kv_len).

    Rows past the real batch are padding: they decode token 0 at slot 0 of their own cache rows
    (the caller sizes the cache for batch_bucket(B) rows), which no real row ever reads."""

    def __init__(self, model: Transformer, mode: str | None = None):
        self.model, self.mode = model, mode
        self.every_token: dict[int, torch.Tensor] = {}  # all-allowed bitmasks by batch bucket
        settings = compile_settings(model)
        options = step_options(model, settings, mode)
        self.fn = compile_step(self._step, mode, settings, options)
        # rows sampled at a temperature and min-p alone (SamplingParams.graph_distribution)
        self.sampled_fn = compile_step(self._sampled_step, mode, settings, options)

    def __deepcopy__(self, memo: dict) -> None:
        # a copied model compiles its own steps: these graphs read the original's weights
        return None

    def _sampled_step(self, tokens: torch.Tensor, cur: torch.Tensor, kv_ref: torch.Tensor,
                      temperature: torch.Tensor, log_min_p: torch.Tensor,
                      u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """_step's forward, then each row's token drawn in the graph from its distribution
        (temperature and min-p, graph_probs; a greedy row's one-hot argmax) at its uniform u
        [Bp] (step_uniforms: drawn before the step from the row's generator, sample's draw), so
        the step's one host read is its tokens. Eagerly after the step, the distribution and the
        inverse CDF cost 0.2-0.7 ms a token on a 2-core Zen 4 (index gathers, a float64 cumsum
        over 49k)."""
        mask = causal_mask(cur, 1, kv_ref.shape[-1])  # [Bp, 1, kv_len]
        logits, _ = self.model(tokens[:, None], cur[:, None], cur[:, None], mask)
        probs = graph_probs(logits, temperature, log_min_p)[:, 0]  # [Bp, V]
        return logits[:, 0], inverse_cdf(probs, u)

    def _step(self, tokens: torch.Tensor, cur: torch.Tensor, kv_ref: torch.Tensor,
              bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_ref [kv_len]: only its length is read (a traced symbol), so the mask is built in the
        graph: built eagerly before it (~15 small ops), an int8 plain step took 5.77 ms against
        5.68 (Zen 4, in-process A/B). bitmask [Bp, ceil(V / 32)]: what each row's grammar allows
        (grammar_bitmask; every token without one): the argmax is taken among those."""
        mask = causal_mask(cur, 1, kv_ref.shape[-1])  # [Bp, 1, kv_len]
        logits, _ = self.model(tokens[:, None], cur[:, None], cur[:, None], mask)
        return logits[:, 0], masked_greedy_tokens(logits[:, 0], bitmask)

    def __call__(self, tokens: torch.Tensor, cur: torch.Tensor, kv_len: int,
                 bitmask: torch.Tensor | None = None,
                 sampling: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, cur [B] (next token, its slot = position), kv_len from the caller's host-side
        count (compiled_kv_len: no device read), bitmask [B, ceil(V / 32)] (grammar_bitmask;
        None: no row has a grammar) -> logits [B, V], the argmax [B] among the allowed tokens.
        With `sampling` (temperature [B], log_min_p [B]: graph_settings; u [B]: step_uniforms;
        rows of graph_distribution, no grammar), each row's token drawn in the graph instead."""
        B, m = tokens.shape[0], self.model
        Bp = batch_bucket(B)
        if sampling is not None:
            fn, extra = self.sampled_fn, list(sampling)
        else:
            fn = self.fn
            if bitmask is None:  # one per batch bucket, made once: every plain step passes it
                if Bp not in self.every_token:
                    self.every_token[Bp] = every_token_bitmask(Bp, vocab_size=m.config.vocab_size,
                                                               device=tokens.device)
                bitmask = self.every_token[Bp]
            extra = [bitmask]
        if Bp > B:  # padding rows: token 0, greedy, every token allowed
            tokens, cur = F.pad(tokens, (0, Bp - B)), F.pad(cur, (0, Bp - B))
            extra = [F.pad(t, (0, Bp - t.shape[0])) if t.dim() == 1 else
                     F.pad(t, (0, 0, 0, Bp - t.shape[0]), value=-1) for t in extra]
        kv_ref = torch.empty(kv_len, dtype=torch.bool, device=tokens.device)
        mark_kv_dynamic(kv_ref, m.max_seq_len)
        logits, chosen = fn(tokens, cur, kv_ref, *extra)
        if self.mode == CUDA_GRAPHS:  # CUDA graphs reuse their output buffers
            return logits[:B].clone(), chosen[:B].clone()
        return logits[:B], chosen[:B]


def compiled_decode(model: Transformer, mode: str | None = None) -> CompiledDecode:
    """The model's compiled decode step, built once per model and mode. It lives on the model: a
    module-wide table kept every model a process ever compiled alive (1.6 GB each for the default
    target in fp32; a test building servers reached 15 GB)."""
    steps = model.compiled_decode_steps
    if steps.get(mode) is None:  # None in a deep copy (CompiledDecode.__deepcopy__)
        steps[mode] = CompiledDecode(model, mode)
    return steps[mode]


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    eos_token_ids: Sequence[int] | None = None,
    on_token: TokenCallback | None = None,
    compile: bool = False,
) -> list[list[int]]:
    """Decode a batch of prompts of different lengths; returns the new tokens of each.

    A sequence stops at an EOS token (kept in its output), when `on_token` says so, or after
    max_new_tokens. `compile` runs each decode step (forward + argmax) as a compiled graph
    (CompiledDecode: batches in buckets, kv_len a traced symbol, so graphs are reused).
    """
    B = len(prompts)
    if max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    params = [params or SamplingParams()] * B if not isinstance(params, Sequence) else list(params)
    eos = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    check_fits(model, [len(p) for p in prompts], max_new_tokens)
    # Cache rows hold the prompts shortest first, so each prefill group (join_groups) is a run
    # of rows: one padded forward over very uneven prompts (chat data) computed mostly padding.
    order = sorted(range(B), key=lambda i: len(prompts[i]))  # row r holds prompt order[r]
    prompts = [prompts[i] for i in order]
    params = [params[i] for i in order]
    lens = [len(p) for p in prompts]
    if compile:  # sized in buckets too: a new cache tensor means new graphs
        ctx = model.config.max_position_embeddings
        ensure_cache(model, batch_bucket(B), kv_bucket(max(lens) + max_new_tokens, ctx))
    else:
        ensure_cache(model, B, max(lens) + max_new_tokens)
    dev = model.embed_tokens.weight.device
    step = compiled_decode(model, compile_mode_for(dev)) if compile else None
    generators = [p.generator(dev) for p in params]
    matchers = [p.new_matcher() for p in params]  # structured outputs: each follows its output

    logits = torch.cat([prefill(model, prompts[g[0]:g[-1] + 1], row0=g[0],
                                max_new_tokens=[max_new_tokens] * len(g))[0] for g in join_groups(lens)])
    cur = torch.tensor(lens, device=dev)  # [B] tokens in the cache so far
    top = max(lens)  # = cur.max(), kept on the host: the kv length needs no device read
    # the compiled step's token: the argmax among what each grammar allows (or its draw, below)
    chosen = None
    masked = all(p.graph_argmax for p in params)  # that argmax is every row's token
    # or the compiled step draws every row's token (temperature and min-p alone)
    drawn = step is not None and not masked and all(p.graph_distribution for p in params)
    settings = graph_settings(params, dev) if drawn else None
    bitmask = None
    outputs: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for _ in range(max_new_tokens):
        if any(p.penalized for p in params) and not (masked and chosen is not None):
            logits, chosen = penalize(logits[:, None], params, prompts, outputs, [eos] * B,
                                      matchers=matchers)[:, 0], None
        if drawn and chosen is not None:  # the step's draw
            nxt = chosen
        else:  # chosen: the argmax, the greedy rows' token
            nxt = pick_tokens(logits, params, generators, chosen)  # [B]
        for b, t in enumerate(nxt.tolist()):  # the step's one host read
            if done[b]:
                continue
            outputs[b].append(t)
            stop = on_token(order[b], t) if on_token else False
            if matchers[b] is not None:  # as Sequence_.emit: the grammar's end ends it
                stop = grammar_step(matchers[b], t) or stop
            if t in eos or stop or len(outputs[b]) >= max_new_tokens:
                done[b] = True
        if all(done):
            break
        if step is not None:
            if masked:
                bitmask = grammar_bitmask(matchers, model.config.vocab_size, dev)
            sampling = (*settings, step_uniforms(params, generators, dev)) if drawn else None
            logits, chosen = step(nxt, cur, compiled_kv_len(top + 1, model.max_seq_len, step.mode), bitmask,
                                  sampling)
        else:
            kv = kv_len_for(top + 1, model.max_seq_len)
            logits = model(nxt[:, None], cur[:, None], cur[:, None], causal_mask(cur, 1, kv))[0][:, 0]
        cur = cur + 1
        top += 1
    by_prompt: list[list[int]] = [[] for _ in range(B)]
    for r, i in enumerate(order):
        by_prompt[i] = outputs[r]
    return by_prompt


# ---------------------------------------------------------------------------------------
# Command line


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    chat_template: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
    """Token ids of the chat template (the tokenizer's, or chat_template) applied to messages,
    ready for the assistant turn (or continuing the last message); tools are shown to the
    template, template_kwargs are its extra variables."""
    out = tokenizer.apply_chat_template(messages, tools=tools, chat_template=chat_template,
                                        add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, tokenize=True,
                                        **template_kwargs)
    if hasattr(out, "keys"):  # transformers >= 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


class StreamPrinter:
    """Prints one sequence's text as tokens arrive (holding back incomplete UTF-8)."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.printed = tokenizer, [], 0

    def __call__(self, b: int, token: int) -> bool:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[self.printed :])
            sys.stdout.flush()
            self.printed = len(text)
        return False


def parse_messages(arg: str) -> list[dict]:
    src = Path(arg).read_text() if Path(arg).is_file() else arg
    try:
        msgs = json.loads(src)
    except json.JSONDecodeError as e:
        raise UserError(f"--messages is not valid JSON: {e}") from None
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                             for m in msgs):
        raise UserError("--messages must be a JSON list of {\"role\": ..., \"content\": ...} objects")
    return msgs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eagle_infer.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default", help="HF folder; 'default' = embedded SmolLM2")
    ap.add_argument("--prompt", action="append", help="user message (repeat for a batch)")
    ap.add_argument("--messages", help="chat messages as JSON (or a file holding it)")
    ap.add_argument("--no-chat-template", action="store_true", help="feed --prompt as raw text")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                    help="auto = bf16 where the hardware runs it fast, else fp32")
    ap.add_argument("--quantization", default="none", choices=["none", "int8"],
                    help="int8: the Linears weight-only int8 (CPU)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--compile", action="store_true",
                    help="compiled decode step (torch.compile): faster "
                         "per token, but the first call compiles for a minute or more")
    return ap


@cli_errors
def main(argv: list[str] | None = None) -> None:
    from eagle_infer.loader import load_model, load_tokenizer

    args = build_parser().parse_args(argv)
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed, args.min_p,
                            args.presence_penalty, args.frequency_penalty, args.repetition_penalty)
    tok = load_tokenizer(args.model_path)
    if args.messages:
        prompts = [chat_prompt_ids(tok, parse_messages(args.messages))]
    else:
        texts = args.prompt or ["Write a short poem about fast decoding."]
        if args.no_chat_template:
            prompts = [tok(t)["input_ids"] for t in texts]
        else:
            prompts = [chat_prompt_ids(tok, [{"role": "user", "content": t}]) for t in texts]
    model = load_model(args.model_path, args.dtype, args.device, quantization=args.quantization)
    t0 = time.perf_counter()
    streamer = StreamPrinter(tok) if len(prompts) == 1 else None
    outs = generate(model, prompts, args.max_new_tokens, params, on_token=streamer, compile=args.compile)
    dt = time.perf_counter() - t0
    if streamer is None:
        for i, o in enumerate(outs):
            print(f"--- [{i}] {tok.decode(o, skip_special_tokens=True)}")
    n = sum(len(o) for o in outs)
    print(f"\n[{n} tokens in {dt:.2f}s, {n / dt:.1f} tokens/s, batch {len(prompts)}, {args.dtype}]",
          file=sys.stderr)


if __name__ == "__main__":
    main()
