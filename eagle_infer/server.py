"""OpenAI-compatible HTTP server with continuous batching over EAGLE-2/EAGLE-3 speculative decoding.

    python -m eagle_infer.server                     # default target + reference EAGLE-3 head, :30000
    python -m eagle_infer.server --speculative-algorithm NONE --port 8000
    python -m eagle_infer.server --model-path /m/llama --speculative-algorithm EAGLE \\
        --speculative-draft-model-path /m/eagle2-head --speculative-token-map /m/freq_32k.pt

Endpoints: POST /v1/chat/completions (with `tools`: tool_calls.py), POST /v1/completions (both
with `stream`, `logprobs`), GET /v1/models, GET /health, GET /metrics (Prometheus, vLLM's names
under `eagle:`, see metrics.py). Flags follow SGLang's names (vLLM's where SGLang has none).

One engine thread owns the decoder (SpecDecoder, or PlainDecoder for NONE). Between rounds it
drops cancelled requests and admits queued ones into free rows (up to --max-running-requests);
every round advances all running requests together. Requests reach the handlers through an
asyncio queue per request. Per-request speculative statistics are reported in
`usage.speculative` ({rounds, accepted_tokens, acceptance_length}).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import gc
import hmac
import inspect
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from eagle_infer.anthropic_api import CountTokensRequest, MessageShape, MessagesRequest
from eagle_infer.anthropic_api import error_body as anthropic_error
from eagle_infer.api_schema import (
    MAX_LOGPROBS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Generation,
    LogprobEntry,
    TokenizeRequest,
    chat_logprobs,
    check_logprobs,
    completion_logprobs,
    engine_error,
)
from eagle_infer.default_model import default_head_path
from eagle_infer.detokenize import IncrementalDetokenizer
from eagle_infer.errors import UserError, cli_errors
from eagle_infer.generate import chat_prompt_ids
from eagle_infer.metrics import CONTENT_TYPE, Metrics
from eagle_infer.reasoning import PARSERS as REASONING_PARSERS
from eagle_infer.reasoning import ReasoningParser
from eagle_infer.responses_api import (
    EventLog,
    ResponseShape,
    ResponsesRequest,
    ResponseStore,
    page_of,
    stream_event,
)
from eagle_infer.sampling import SamplingParams
from eagle_infer.server_flags import (
    SAMPLING_DEFAULT_FIELDS,
    apply_vllm_flags,
    build_parser,
    chat_template_of,
    compile_settings,
    content_format_of,
    resolve_batch_tree,
    resolve_disable_by_batch_size,
    resolve_tree,
    sampling_defaults_of,
    tool_parser_of,
)
from eagle_infer.sglang_api import GenerateRequest, GenerateShape, server_info
from eagle_infer.speculative import Sequence_, TokenLogprob
from eagle_infer.tool_calls import PARSERS, ToolPlan, ToolStream, history_ids, merge_deltas

Body = TypeVar("Body", bound=BaseModel)  # a request body's schema
log = logging.getLogger("eagle_infer.server")

DEFAULT_HEAD = default_head_path("eagle3")
MAX_BODY_BYTES = 1 << 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
HEALTH_GENERATE_S = 20  # /health_generate: seconds it waits for its one token
MAX_STOPS = 16
MAX_CHOICES = 128  # n x prompts of one request (OpenAI's limit on n)
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 128, 1024  # after tokenization (vLLM's defaults)
Thinking = tuple[ReasoningParser, bool]  # a chat answer's reasoning parser, and whether it thinks


# ---------------------------------------------------------------------------------------
# One request in flight


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class Job:
    """A request's sequence, its text so far, and the queue its handler reads events from.

    Events: {"delta": str, "logprobs": [...]} while decoding; with "finish_reason", "stop_reason"
    and "usage" at the end; {"error": ApiError} on failure; each with the job's choice "index" (a
    request's choices share one queue). The engine thread detokenizes each token as it is emitted
    (incrementally, IncrementalDetokenizer) and checks stop strings on the new text only, so a stop
    string that straddles tokens of one speculative round stops the sequence right there. Text is
    released only once it can no longer turn into a stop string or an incomplete UTF-8 character;
    what follows a matched stop string is cut, and the string too unless include_stop (vLLM's
    include_stop_str_in_output). The end reports vLLM's stop_reason: the stop string matched, or
    the stop_ids token that ended the answer (None for EOS, the length, a grammar's end). logprobs
    travel with the text of their tokens. Everything but `cancel` runs on the engine thread. A job
    that does not stream pushes its answer once, at the end (see update).
    """

    def __init__(self, prompt: list[int], params: SamplingParams, max_tokens: int, stops: list[str],
                 eos: set[int], tokenizer, loop: asyncio.AbstractEventLoop, logprobs: int | None = None,
                 tokens_as_ids: bool = False, stream: bool = True, stream_interval: int = 1,
                 index: int = 0, events: asyncio.Queue | None = None, echo: bool = False,
                 skip_special_tokens: bool = True, include_stop: bool = False,
                 stop_ids: Collection[int] = (), prompt_logprobs: int | None = None):
        self.id = uuid.uuid4().hex[:24]
        self.index = index  # the answer's choice (a request's choices share one events queue)
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.metrics: Metrics | None = None  # the engine's, set by submit
        self.recorded = False  # counted in the finished-request metrics
        self.stops, self.tok, self.loop, self.tokens_as_ids = stops, tokenizer, loop, tokens_as_ids
        self.stream, self.stream_interval = stream, stream_interval
        self.streamed_at = 0  # output tokens when text was last released
        # the prompt is scored for echo with logprobs and for vLLM's prompt_logprobs, with the
        # alternatives of either
        self.prompt_logprobs = prompt_logprobs
        asked = [k for k in (logprobs if echo else None, prompt_logprobs) if k is not None]
        self.seq = Sequence_(prompt, params, max_tokens, eos, on_token=self._on_token, tag=self,
                             logprobs=logprobs, prompt_logprobs=max(asked) if asked else None)
        self.echo_pending, self.echo_len = echo, 0  # completions' echo: the prompt's text leads
        self.ends = eos  # EOS and stop_token_ids: the token that ends the answer has no text (vLLM's)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue() if events is None else events
        self.sent = 0  # characters already released
        self.lp_sent = 0  # tokens whose logprobs were released
        self.cut: str | None = None  # the final text when a stop string matched
        self.include_stop, self.stop_ids = include_stop, set(stop_ids)
        self.stop_reason: str | int | None = None  # the stop string matched (or, at the end, token)
        self.failure: Exception | None = None
        self.finished = False  # the final event was pushed
        self.failed = False
        self.cancelled = False

    def _on_token(self, token: int) -> bool:
        """Called by Sequence_.emit after each token: True stops the sequence."""
        try:
            before = len(self.detok.text)
            if not self.detok.add(token, render=token not in self.ends) or not self.stops:
                return False
        except Exception as e:  # never let one request break the round of all of them
            self.failure = e
            return True
        text = self.detok.text
        found = ((text.find(s, max(0, before - len(s) + 1)), s) for s in self.stops)
        hits = [(i, s) for i, s in found if i >= 0]
        if hits:
            i, self.stop_reason = min(hits, key=lambda hit: hit[0])  # the first in the text (then in stop)
            self.cut = text[: i + len(self.stop_reason) if self.include_stop else i]
            return True
        return False

    def usage(self) -> dict[str, Any]:
        return usage_of(len(self.seq.prompt), len(self.seq.output), len(self.seq.accepted),
                        sum(self.seq.accepted), self.seq.prefix_hit)

    def push(self, event: dict[str, Any]) -> None:
        event["index"] = self.index
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    def update(self) -> None:
        """Release new text; at the end, the rest with the finish reason and usage. Without
        streaming only the end (vLLM's FINAL_ONLY outputs): a handler waiting for the whole answer
        has no use for the pieces, and each push wakes the event loop's thread mid-round.
        Streaming, the first token's text at once and then text every stream_interval tokens
        (SGLang's and vLLM's --stream-interval): fewer, larger chunks, fewer wake-ups."""
        end = self.seq.done or self.failure is not None
        if self.finished or not (self.stream or end):
            return
        if not end and self.streamed_at and len(self.seq.output) - self.streamed_at < self.stream_interval:
            return  # --stream-interval: the first token at once, then every stream_interval tokens
        self.streamed_at = len(self.seq.output)
        try:
            if self.failure is not None:
                raise self.failure
            self._release()
        except Exception as e:
            log.exception("detokenizing request %s failed", self.id)
            self.fail(engine_error(f"decoding the output failed: {type(e).__name__}: {e}"))

    def _piece(self, token: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token}"
        return self.tok.decode([token], skip_special_tokens=False)

    def _entry(self, token: int, scored: TokenLogprob | None) -> LogprobEntry:
        if scored is None:  # a prompt's first token: nothing before it to score it by
            return token, self._piece(token), None, None
        lp, top_ids, top_lps = scored
        return token, self._piece(token), lp, [(a, self._piece(a), v) for a, v in zip(top_ids, top_lps)]

    def _logprob_entries(self, end: int) -> tuple[list[LogprobEntry], list[int]]:
        """Tokens lp_sent..end-1 as (id, text, log-prob, top alternatives), and their text offsets."""
        if self.seq.logprobs is None or end <= self.lp_sent:
            return [], []
        out = [self._entry(self.seq.output[i], self.seq.token_logprobs[i]) for i in range(self.lp_sent, end)]
        offsets = [self.echo_len + o for o in self.detok.offsets[self.lp_sent:end]]
        self.lp_sent = end
        return out, offsets

    def _echo(self) -> tuple[str, list[LogprobEntry], list[int]]:
        """With echo, once, ahead of the first release: the prompt's text and, with logprobs, its
        tokens' entries (the prefill scored them: Sequence_.score_prompt) and offsets."""
        if not self.echo_pending:
            return "", [], []
        self.echo_pending = False
        d = IncrementalDetokenizer(self.tok)
        for t in self.seq.prompt:
            d.add(t)
        d.flush()
        self.echo_len = len(d.text)
        if self.seq.logprobs is None:
            return d.text, [], []
        k = self.seq.logprobs
        scored = [None, *((lp, ids[:k], vals[:k]) for lp, ids, vals in self.seq.prompt_token_logprobs)]
        return d.text, [self._entry(t, s) for t, s in zip(self.seq.prompt, scored)], d.offsets

    def prompt_logprobs_field(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs (None unless asked): per prompt token (the first None), its
        entry and its k likeliest alternatives', keyed by token id: {"logprob", "rank",
        "decoded_token"}."""
        if self.prompt_logprobs is None:
            return None
        k, out = self.prompt_logprobs, [None]
        scored = zip(self.seq.prompt[1:], self.seq.prompt_token_logprobs, self.seq.prompt_token_ranks)
        for token, (lp, ids, vals), rank in scored:
            entry = {str(token): {"logprob": lp, "rank": rank, "decoded_token": self._piece(token)}}
            for r, (a, v) in enumerate(zip(ids[:k], vals[:k])):
                entry.setdefault(str(a), {"logprob": v, "rank": r + 1, "decoded_token": self._piece(a)})
            out.append(entry)
        return out

    def _release(self) -> None:
        d = self.detok
        echo, echo_entries, echo_offsets = self._echo()
        if self.seq.done:
            if self.cut is None:
                d.flush()
            text = self.cut if self.cut is not None else d.text
            # Tokens whose text starts before a stop string's cut; all of them otherwise.
            n = len(self.seq.output) if self.cut is None else sum(o < len(text) for o in d.offsets)
            entries, offsets = self._logprob_entries(n)
            self.finished = True  # before the push: a handler that sees the end must not cancel
            if self.metrics is not None:  # counted before the client can see the end (and scrape)
                self.metrics.finish(self, self.seq.finish_reason or "stop", time.perf_counter())
            last = self.seq.output[-1] if self.seq.output else None
            if self.cut is None and self.seq.finish_reason == "stop" and last in self.stop_ids:
                self.stop_reason = last
            self.push({"delta": echo + text[self.sent:], "logprobs": echo_entries + entries,
                       "offsets": echo_offsets + offsets, "finish_reason": self.seq.finish_reason,
                       "stop_reason": self.stop_reason, "usage": self.usage()})
            return
        end = len(d.text) - stop_prefix_len(d.text, self.stops)
        entries, offsets = self._logprob_entries(self.tokens_within(end, self.lp_sent))
        if end > self.sent or entries or echo:
            self.push({"delta": echo + d.text[self.sent:end], "logprobs": echo_entries + entries,
                       "offsets": echo_offsets + offsets})
            self.sent = max(self.sent, end)

    def tokens_within(self, chars: int, start: int = 0) -> int:
        """How many output tokens (from `start`, whose text is known to lie there) the detokenizer
        has read whose text ends within the first `chars` characters of the answer."""
        d, n = self.detok, start
        while n < d.read and (d.offsets[n + 1] if n + 1 < len(d.offsets) else len(d.text)) <= chars:
            n += 1
        return n

    def fail(self, err: ApiError) -> None:
        if not self.finished:
            self.finished = self.failed = True
            self.push({"error": err})


def usage_of(n_prompt: int, n_out: int, rounds: int, accepted: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage (prompt_tokens_details.cached_tokens where the prefix cache gave some), and
    `speculative` (our extension) where rounds drafted."""
    usage: dict[str, Any] = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                             "total_tokens": n_prompt + n_out}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    if rounds:
        usage["speculative"] = {"rounds": rounds, "accepted_tokens": accepted,
                                "acceptance_length": round(1 + accepted / rounds, 4)}
    return usage


def merged_usage(usages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One request's usage from its choices' (Job.usage, by choice index, n a prompt): each
    prompt's tokens once however many choices it has (vLLM's count), every choice's output
    tokens and rounds."""
    if len(usages) == 1:
        return usages[0]
    spec = [u["speculative"] for u in usages if "speculative" in u]
    return usage_of(sum(u["prompt_tokens"] for u in usages[::n]), sum(u["completion_tokens"] for u in usages),
                    sum(s["rounds"] for s in spec), sum(s["accepted_tokens"] for s in spec),
                    sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages[::n]))


def with_reasoning_tokens(usage: dict[str, Any], jobs: list[Job], texts: list[str],
                          reasoning: Thinking) -> dict[str, Any]:
    """usage with OpenAI's and vLLM's completion_tokens_details.reasoning_tokens: the output
    tokens whose text starts inside the reasoning of each choice's answer (texts, by job)."""
    count = 0
    for job, text in zip(jobs, texts):
        start, end = reasoning[0].span(text, reasoning[1])
        count += sum(start <= offset < end for offset in job.detok.offsets)
    return usage | {"completion_tokens_details": {"reasoning_tokens": count}}


def developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """messages (Message.for_template's) with OpenAI's "developer" turns as "system" ones, for a
    template that does not name the role (vLLM's rule); system turns past the first are then
    merged into one first turn, their texts joined by blank lines, since templates such as
    Qwen's refuse a system turn anywhere else."""
    msgs = [m | {"role": "system"} if m["role"] == "developer" else m for m in messages]
    systems = [m for m in msgs if m["role"] == "system"]
    if not systems or (len(systems) == 1 and msgs[0] is systems[0]):
        return msgs
    texts = [m["content"] if isinstance(m["content"], str) else "\n".join(p["text"] for p in m["content"])
             for m in systems]
    text = "\n\n".join(t for t in texts if t)
    content = text if isinstance(systems[0]["content"], str) else [{"type": "text", "text": text}]
    return [{"role": "system", "content": content}, *(m for m in msgs if m["role"] != "system")]


def template_parameters_of(tokenizer) -> frozenset[str]:
    """apply_chat_template's own parameters: not names a template's variables may take."""
    return frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}


def bad_words_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word as it starts a text and, where that is another
    token sequence of the same length, after a space (mid-text), so both are barred."""
    ids: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not alone:
            raise ApiError(400, f"bad_words: {word!r} is no token", param="bad_words", code="invalid_value")
        ids.append(alone)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            ids.append(spaced)
    if len(ids) > MAX_BAD_WORDS or sum(map(len, ids)) > MAX_BAD_WORD_TOKENS:
        raise ApiError(400, f"bad_words: at most {MAX_BAD_WORDS} token sequences of {MAX_BAD_WORD_TOKENS} "
                            f"tokens in all", param="bad_words", code="invalid_value")
    return ids


# ---------------------------------------------------------------------------------------
# The engine thread


class Engine:
    """Runs the decode loop on its own thread; handlers submit and cancel Jobs thread-safely."""

    def __init__(self, decoder, tokenizer, metrics: Metrics, speculative: bool, prefix_caching: bool = False,
                 chunked_prefill_size: int = 0):
        self.dec, self.metrics, self.speculative = decoder, metrics, speculative
        self.prefix_caching = prefix_caching  # the decoder's prefix cache: its counters
        # with it, a prompt longer than this joins after chunks of it written between rounds
        self.chunk = max(chunked_prefill_size, 0) if prefix_caching else 0
        self.tokenizer = tokenizer  # decodes outputs on the engine thread (its own instance)
        self.pending: collections.deque[Job] = collections.deque()
        self.cancels: list[Job] = []
        self.flushes: list[Callable[[bool], None]] = []  # /flush_cache's answers, told on this thread
        self.cond = threading.Condition()
        self.stopping = False
        self.running = 0
        self.thread = threading.Thread(target=self._loop, name="eagle-engine", daemon=True)

    # -- called from the event loop ----------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping

    def submit(self, *jobs: Job) -> None:
        """Queue jobs (a request's choices together: they join one prefill where rows are free)."""
        with self.cond:
            if self.stopping:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            for job in jobs:
                job.metrics = self.metrics
                self.pending.append(job)
            self.metrics.waiting.set(len(self.pending))
            self.cond.notify()

    def flush_prefix_cache(self, answer: Callable[[bool], None]) -> None:
        """Forget what free rows hold (SGLang's /flush_cache) at the engine's next turn, if no
        request runs or waits then; answer(whether it did) is called on the engine thread."""
        with self.cond:
            self.flushes.append(answer)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job before the next round."""
        with self.cond:
            if job.cancelled or job.finished:
                return
            job.cancelled = True
            if job in self.pending:
                self.pending.remove(job)
                self.metrics.waiting.set(len(self.pending))
            # the decoder drops it, running or not (a waiting prompt's chunks unpinned)
            self.cancels.append(job)
            self.cond.notify()
        self.metrics.finish(job, "abort", time.perf_counter())

    def queued(self) -> int:
        return len(self.pending)

    def stop(self, timeout: float = 10.0) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------------

    def _set_running(self) -> None:
        self.running = len(self.dec.seqs)
        self.metrics.running.set(self.running)

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.stopping or self.pending or self.cancels or self.dec.seqs or self.flushes):
                    self.cond.wait()
                if self.stopping:
                    break
                flushes, self.flushes = self.flushes, []
                idle = not (self.pending or self.cancels or self.dec.seqs)
                cancels, admit = self._take()
            if flushes:
                self._flush(flushes, idle)
            try:
                self._iteration(cancels, admit)
            except Exception:  # a bug here must not stop the server
                log.exception("engine iteration failed")
                self._fail_running("internal engine error")
                with self.cond:
                    lost = [job for job in admit if job not in self.pending]
                for job in lost:  # admitted but maybe never added (fail() skips finished jobs)
                    job.fail(engine_error("internal engine error"))
                time.sleep(0.05)
        self._shutdown()

    def _flush(self, answers: list[Callable[[bool], None]], idle: bool) -> None:
        """/flush_cache's turn: idle (no request runs or waits, so no partial prefill is pinned in
        a free row either), the free rows' contents and the acceptance length /get_server_info
        reports are forgotten (SGLang's); each answer told whether."""
        prefix = getattr(getattr(self.dec, "rows", None), "prefix", None)
        if idle:
            if prefix is not None:
                prefix.clear()
            self.metrics.forget_acceptance()
        for answer in answers:
            answer(idle)

    def _take(self) -> tuple[list[Job], list[Job]]:
        """Under the lock: the cancels to apply and the queued jobs to admit this iteration (as
        many as rows are free once the cancels have run)."""
        cancels, self.cancels = self.cancels, []
        admit = []
        while self.pending and len(admit) < self.dec.free_rows + len(cancels):
            admit.append(self.pending.popleft())
        self.metrics.waiting.set(len(self.pending))
        return cancels, admit

    def _iteration(self, cancels: list[Job], admit: list[Job]) -> None:
        for job in cancels:
            try:
                self.dec.cancel(job.seq)
            except Exception:
                log.exception("cancel failed")
                self._fail_running("internal engine error")
        self._set_running()
        # In queue order: short prompts join now; the first prompt long enough for chunked
        # prefill gets its next chunk written after their joins (it joins with its last one),
        # into a row they leave free; later long ones wait behind it (SGLang mixes short
        # prefills with a chunked one too). Chunks only while requests run or others join
        # beside it: a long prompt alone joins whole.
        long = [self._long(job) for job in admit]
        busy = bool(self.dec.seqs) or not all(long)
        joining, back, chunked = [], [], None
        for job, is_long in zip(admit, long):
            if len(joining) >= self.dec.free_rows - (chunked is not None):  # no row (a cancel freed none)
                back.append(job)
            elif not self._admissible(job):
                continue
            elif is_long and busy:
                back.append(job)
                chunked = chunked or job
            else:
                joining.append(job)
        if back:  # to the queue's front, in order
            with self.cond:
                self.pending.extendleft(reversed(back))
                self.metrics.waiting.set(len(self.pending))
        self._add(joining)
        if chunked is not None:
            self._prefill_chunk(chunked)
        self._set_running()
        if self.dec.seqs:
            self._step()
        self._set_running()

    def _long(self, job: Job) -> bool:
        """Whether the job's prompt, joining now, would prefill more than a chunk (chunked
        prefill, while requests run)."""
        seq = job.seq
        return bool(self.chunk and not job.cancelled
                    and seq.prompt_logprobs is None  # scored prompts prefill whole (every state)
                    and self.dec.rows.left_to_prefill(seq) > self.chunk)

    def _prefill_chunk(self, job: Job) -> None:
        """Chunked prefill: the next chunk of the job's prompt, between rounds, into a free row;
        the job waits in the queue to join with its last one. A failure fails the job alone."""
        try:
            done = self.dec.prefill_chunk(job.seq, self.chunk)
            log.debug("chunked prefill: %d of %d prompt tokens", done, len(job.seq.prompt))
        except Exception as e:
            log.exception("chunked prefill failed")
            with self.cond:
                if job in self.pending:
                    self.pending.remove(job)
                    self.metrics.waiting.set(len(self.pending))
            job.fail(engine_error(f"prefill failed: {type(e).__name__}: {e}"))

    def _admissible(self, job: Job) -> bool:
        if job.cancelled:
            return False
        try:
            self.dec.check(job.seq)
        except UserError as e:
            job.fail(ApiError(400, str(e), param="max_tokens", code="context_length_exceeded"))
            return False
        return True

    def _add(self, jobs: list[Job]) -> None:
        """Prefill the joining requests together; if that fails, each alone, so only the request
        that breaks prefill fails."""
        if not jobs:
            return
        try:
            self.dec.add_many([job.seq for job in jobs])
        except Exception as e:
            for job in jobs:
                if job.seq in self.dec.seqs:
                    self.dec.cancel(job.seq)
            if len(jobs) > 1:
                for job in jobs:
                    self._add([job])
                return
            log.exception("prefill failed")
            jobs[0].fail(engine_error(f"prefill failed: {type(e).__name__}: {e}"))
            return
        self._set_running()
        now = time.perf_counter()
        for job in jobs:
            self.metrics.prompt_tokens.inc(len(job.seq.prompt))
            if self.prefix_caching:
                self.metrics.prefix_cache_queries.inc(len(job.seq.prompt))
                self.metrics.prefix_cache_hits.inc(job.seq.prefix_hit)
            self.metrics.generation_tokens.inc(len(job.seq.output))
            job.first_token_at = job.last_token_at = now
            self.metrics.ttft.observe(now - job.arrival)
            job.update()

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            results = self.dec.step()
        except Exception as e:
            log.exception("decode round failed")
            self._fail_running(f"decode round failed: {type(e).__name__}: {e}")
            return
        # a large batch's round drafts nothing (SpecDecoder's disable_by_batch_size)
        drafted = self.speculative and not getattr(self.dec, "last_round_plain", False)
        accepted = [s.accepted[-1] for s, _ in results if s.accepted] if drafted else []
        now = time.perf_counter()
        self.metrics.round(accepted, sum(len(t) for _, t in results), now - t0)
        self._set_running()  # gauges and counters first: a client that sees its end may scrape next
        for seq, _ in results:
            job = seq.tag
            self.metrics.itl.observe(now - job.last_token_at)
            job.last_token_at = now
            job.update()

    def _fail_running(self, message: str) -> None:
        for seq in list(self.dec.seqs):
            try:
                self.dec.cancel(seq)
            except Exception:
                log.exception("cancel failed; dropping the batch")
                self.dec.seqs.clear()
            seq.tag.fail(engine_error(message))
        self._set_running()

    def _shutdown(self) -> None:
        with self.cond:
            pending, self.pending = list(self.pending), collections.deque()
        for job in pending + [s.tag for s in self.dec.seqs]:
            job.fail(ApiError(503, "the server is shutting down", code="shutting_down"))
        self.running = 0


# ---------------------------------------------------------------------------------------
# HTTP


@dataclass
class ServerConfig:
    model_names: list[str]  # the served name first; any of them is accepted in requests
    api_key: str | None
    context: int  # tokens (prompt + max_tokens) a request may use
    vocab_size: int | None = None  # the target's, for prompts given as token ids
    stream_interval: int = 1  # a streamed request's text every this many tokens (Job.update)
    tool_parser: str | None = None  # --tool-call-parser: the format of tool calls (tool_calls.PARSERS)
    auto_tools: bool = False  # --enable-auto-tool-choice: tool_choice "auto" answered
    chat_template: str | None = None  # --chat-template (None: the tokenizer's)
    reasoning_parser: str | None = None  # --reasoning-parser (reasoning.PARSERS)
    # --generation-config: a request's sampling fields where it leaves them out, and max_tokens
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    log_requests: bool = False  # --enable-log-requests: a line per request
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])  # CORS (vLLM's and SGLang's default)
    listed: int = 1  # the first model_names (--served-model-name's) /v1/models lists, as vLLM
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: alternatives a request may ask for per token
    response_role: str = "assistant"  # --response-role: a chat answer's role after a generation prompt
    # --chat-template-content-format: a message's content as templates get it (auto: detected per template)
    content_format: str = "auto"
    trust_request_template: bool = False  # --trust-request-chat-template: a request's chat_template used
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids: what requests that leave the field out get
    # --default-chat-template-kwargs: the template's variables where a request leaves them out
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools_only_when_chosen: bool = False  # --exclude-tools-when-tool-choice-none
    force_usage: bool = False  # --enable-force-include-usage: every stream ends with its usage
    request_id_headers: bool = False  # --enable-request-id-headers: X-Request-Id on every answer
    flags: dict[str, Any] = field(default_factory=dict)  # the command line's, for /get_server_info


def _is_type_tag(loc: int | str) -> bool:
    """Pydantic names the union member in an error's location ('str', 'list[int]', 'TextPart')."""
    if not isinstance(loc, str):
        return False
    return loc in ("str", "int", "float", "bool") or "[" in loc or loc[:1].isupper()


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class RequestCounter:
    """ASGI middleware: count /v1 responses by status for /metrics."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = [499]  # nothing sent: the client went away first

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            status[0] = 503  # what the catch-all handler answers
            raise
        finally:
            self.metrics.http_response(status[0])


def create_app(engine: Engine, tokenizer, eos: set[int], cfg: ServerConfig) -> FastAPI:
    """The FastAPI app. `tokenizer` encodes prompts on the event loop; the engine decodes with
    its own instance (a HF fast tokenizer must not be used from two threads at once)."""
    vocab = cfg.vocab_size or len(tokenizer)  # the token ids a request may name
    tool_parser = PARSERS[cfg.tool_parser] if cfg.tool_parser else None  # --tool-call-parser's format

    @asynccontextmanager
    async def lifespan(app):
        if not engine.thread.is_alive():
            engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="eagle-spec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(RequestCounter, metrics=engine.metrics)
    if cfg.request_id_headers:
        @app.middleware("http")
        async def request_id_header(request: Request, call_next: Callable[[Request], Any]) -> Response:
            answer = await call_next(request)
            answer.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            return answer

    # browsers' cross-origin calls, as vLLM and SGLang allow them (any origin by default)
    app.add_middleware(CORSMiddleware, allow_origins=cfg.allowed_origins, allow_credentials=False,
                       allow_methods=["*"], allow_headers=["*"])

    def error_response(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(ApiError(400, str(exc.errors()[:1]), code="invalid_value"))

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect):
        return Response(status_code=499)  # left while sending its body: nobody to answer

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error in a handler")
        return error_response(ApiError(503, f"internal error: {type(exc).__name__}", code="internal_error"))

    def check_auth(request: Request) -> None:
        if cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        # Anthropic's clients send theirs as x-api-key
        given = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), cfg.api_key.encode()):
            raise ApiError(401, "invalid API key: pass it as 'Authorization: Bearer <key>' (or "
                                "'x-api-key: <key>')", code="invalid_api_key")

    async def parse(request: Request, schema: type[Body]) -> Body:
        check_auth(request)
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="request_too_large")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="request_too_large")
        try:
            body = json.loads(raw, parse_constant=_reject_constant)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p)) or None
            code = "missing_field" if first["type"] == "missing" else "invalid_type"
            raise ApiError(400, f"{param}: {first['msg']}", param=param, code=code) from None
        if req.model is not None and req.model not in cfg.model_names:
            raise ApiError(404, f"model '{req.model}' does not exist; this server serves "
                                f"'{cfg.model_names[0]}'", param="model", code="model_not_found")
        return with_server_defaults(req)

    def with_server_defaults(req: Body) -> Body:
        """The server's defaults where the request has none: the model's sampling settings (its
        max_tokens is max_tokens_for's, where the request has none either) and the chat
        template's variables (a request's own win)."""
        unset = {}
        if isinstance(req, Generation):
            unset = {k: v for k, v in cfg.sampling_defaults.items()
                     if k in SAMPLING_DEFAULT_FIELDS and k not in req.model_fields_set}
        if isinstance(req, (ChatRequest, TokenizeRequest)) and cfg.template_kwargs:
            unset["chat_template_kwargs"] = cfg.template_kwargs | (req.chat_template_kwargs or {})
        return req.model_copy(update=unset) if unset else req

    def max_tokens_for(req: Generation, prompt: list[int], prompt_param: str, default_max: int | None) -> int:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param=prompt_param, code="invalid_value")
        if len(prompt) >= cfg.context:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; the context holds {cfg.context} "
                                f"(prompt + max_tokens)", param=prompt_param, code="context_length_exceeded")
        max_tokens = req.max_tokens
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        room = cfg.context - len(prompt)
        if max_tokens is None:  # the least of the room, the endpoint's default and the model's
            max_tokens = min(m for m in (room, default_max, cfg.sampling_defaults.get("max_tokens")) if m)
        if max_tokens <= 0:
            raise ApiError(400, f"max_tokens must be > 0, got {max_tokens}", param="max_tokens",
                           code="invalid_value")
        if max_tokens > room:
            raise ApiError(400, f"max_tokens={max_tokens} + {len(prompt)} prompt tokens exceeds the "
                                f"context of {cfg.context} tokens", param="max_tokens",
                           code="context_length_exceeded")
        if req.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens={req.min_tokens} is more than max_tokens={max_tokens}",
                           param="min_tokens", code="invalid_value")
        return max_tokens

    @functools.lru_cache(maxsize=32)
    def template_traits(template: str | None) -> tuple[str, bool]:
        """A chat template's (None: the tokenizer's) content format (--chat-template-content-
        format, auto detected as vLLM's) and whether it names the developer role (else such a
        turn is a system one, vLLM's rule)."""
        try:
            text = tokenizer.get_chat_template(template)
        except ValueError:  # no template: apply_chat_template says so
            return "string", True
        form = content_format_of(text) if cfg.content_format == "auto" else cfg.content_format
        return form, "'developer'" in text or '"developer"' in text

    @functools.cache
    def template_parameters() -> frozenset[str]:
        return template_parameters_of(tokenizer)

    @functools.cache
    def grammars():  # made at the first structured request: xgrammar reads the whole vocabulary
        from eagle_infer.grammar import Grammars

        return Grammars.for_tokenizer(tokenizer, vocab, eos)

    def compile_grammar(req: Generation, tool_grammar: tuple[str, Any] | None = None) -> Any:
        """The request's structured output compiled (None without one), or a forced tool call's
        grammar (ToolPlan.grammar); a bad one is a 400."""
        asked = req.structured() if tool_grammar is None else ("tools", *tool_grammar)
        if asked is None:
            return None
        field, kind, source = asked
        try:
            return grammars().compile(kind, source)
        except UserError as e:
            raise ApiError(400, str(e), param=field, code="invalid_value") from None

    def sampling_params(req: Generation, tool_grammar: tuple[str, Any] | None = None) -> SamplingParams:
        if req.temperature < 0:
            raise ApiError(400, f"temperature must be >= 0, got {req.temperature}", param="temperature",
                           code="invalid_value")
        bias = {}
        for token, value in (req.logit_bias or {}).items():
            if not (token.isascii() and token.isdigit()) or int(token) >= vocab:
                raise ApiError(400, f"logit_bias: {token!r} is not a token id of this model (0 to "
                                    f"{vocab - 1})", param="logit_bias", code="invalid_value")
            bias[int(token)] = value
        allowed = req.allowed_token_ids
        if allowed is not None and (not allowed or not all(0 <= t < vocab for t in allowed)):
            raise ApiError(400, f"allowed_token_ids must be a non-empty list of token ids of this model "
                                f"(0 to {vocab - 1})", param="allowed_token_ids", code="invalid_value")
        try:
            return SamplingParams(req.temperature, req.top_p, max(req.top_k, 0), req.seed, req.min_p,
                                  req.presence_penalty, req.frequency_penalty, req.repetition_penalty, bias,
                                  req.min_tokens, allowed, bad_words_ids(tokenizer, req.bad_words or []),
                                  compile_grammar(req, tool_grammar))
        except UserError as e:
            param = next((p for p in ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                                      "repetition_penalty", "logit_bias", "min_tokens", "bad_words")
                          if p in str(e)), None)
            raise ApiError(400, str(e), param=param, code="invalid_value") from None

    def make_jobs(req: Generation, prompts: list[list[int]], prompt_param: str, default_max: int | None,
                  tools: ToolPlan | None = None, tool_grammar: tuple[str, Any] | None = None,
                  gate: tuple[int, ...] = (), events: asyncio.Queue | None = None,
                  first_index: int = 0, budget: int | None = None) -> list[Job]:
        """A request's jobs: `n` choices for each prompt, choice index prompt x n + i (vLLM's),
        sampled alike but for the seed: choice i of a seeded request has seed + i, as vLLM's
        parallel sampling, so a choice is the answer of one request with that seed. tools: a chat
        request's ToolPlan (ChatRequest.tool_plan), tool_grammar its grammar (ToolPlan.grammar);
        gate: the tokens after which a grammar starts (Grammar.gate: the end of the reasoning);
        events, first_index: the queue and first choice index of jobs made for one request in
        parts (a /generate batch whose prompts have sampling params of their own); budget: at
        most that many tokens before the gate, then the gate forced (thinking_token_budget)."""
        if not 1 <= req.n <= MAX_CHOICES or req.n * len(prompts) > MAX_CHOICES:
            raise ApiError(400, f"n x prompts must be in [1, {MAX_CHOICES}], got {req.n} x {len(prompts)}",
                           param="n", code="invalid_value")
        max_tokens = [max_tokens_for(req, p, prompt_param, default_max) for p in prompts]
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stops) or len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop takes up to {MAX_STOPS} non-empty strings", param="stop",
                           code="invalid_value")
        if req.seed is not None and not -(2**63) <= req.seed <= 2**64 - req.n:
            raise ApiError(400, "seed (+ n - 1) must fit in 64 bits", param="seed", code="invalid_value")
        logprobs = req.top_logprobs_asked()
        field_name = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
        check_logprobs(logprobs, field_name, cfg.max_logprobs)
        check_logprobs(req.prompt_logprobs, "prompt_logprobs", cfg.max_logprobs)
        if req.prompt_logprobs is not None and req.stream:
            raise ApiError(400, "prompt_logprobs is not supported with stream", param="prompt_logprobs",
                           code="unsupported_parameter")
        field = req.unsupported_field()
        if field is not None:
            raise ApiError(400, f"{field} is not supported by this server", param=field,
                           code="unsupported_parameter")
        if any(not 0 <= t < vocab for t in req.stop_token_ids or []):
            raise ApiError(400, f"stop_token_ids must be token ids of this model (0 to {vocab - 1})",
                           param="stop_token_ids", code="invalid_value")
        params = sampling_params(req, tool_grammar)
        if gate and (params.grammar is not None or budget is not None):
            from eagle_infer.grammar import Grammar

            grammar = params.grammar if params.grammar is not None else Grammar(None)  # a budget alone
            params = replace(params, grammar=replace(grammar, gate=gate, budget=budget))
        ends = (set() if req.ignore_eos else eos) | set(req.stop_token_ids or [])
        stop_ids = ends - (set() if req.ignore_eos else eos)  # EOS reports no stop_reason (vLLM's)
        # tool calls keep special tokens in the text, for the parser (a <tool_call> may be one: vLLM's)
        skip_special = req.skip_special_tokens and tools is None
        events = asyncio.Queue() if events is None else events
        loop, jobs = asyncio.get_running_loop(), []
        as_ids = req.return_tokens_as_token_ids
        as_ids = cfg.tokens_as_ids if as_ids is None else as_ids
        for p, (prompt, most) in enumerate(zip(prompts, max_tokens)):
            for i in range(req.n):
                child = params if params.seed is None else replace(params, seed=params.seed + i)
                jobs.append(Job(prompt, child, most, stops, ends, engine.tokenizer, loop, logprobs,
                                as_ids, req.stream, cfg.stream_interval,
                                index=first_index + p * req.n + i, events=events,
                                echo=isinstance(req, CompletionRequest) and req.echo,
                                skip_special_tokens=skip_special,
                                include_stop=req.include_stop_str_in_output, stop_ids=stop_ids,
                                prompt_logprobs=req.prompt_logprobs))
        if cfg.log_requests:
            log.info("request: %d prompt(s) of %s tokens, n=%d, max_tokens %s, temperature %s, top_p %s, "
                     "top_k %s, min_p %s, seed %s, stream %s%s", len(prompts), [len(p) for p in prompts],
                     req.n, max_tokens, params.temperature, params.top_p, params.top_k, params.min_p,
                     params.seed, req.stream, ", a grammar" if params.grammar is not None else "")
        return jobs

    def cancel_all(jobs: list[Job]) -> None:
        for job in jobs:
            engine.cancel(job)

    async def next_event(events: asyncio.Queue, gone: asyncio.Future) -> dict[str, Any] | None:
        """The next event of a request's jobs, or None once the client has disconnected."""
        get = asyncio.ensure_future(events.get())
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            return None
        return get.result()

    async def awaited_events(jobs: list[Job], stream: bool,
                             next_of: Callable[[], Awaitable[dict[str, Any] | None]],
                             ) -> tuple[dict[str, Any] | None, dict[int, dict[str, Any]]]:
        """What a request's answer waits for (next_of gives its jobs' events): streaming, the first
        piece of any choice; else each choice's whole answer (Job.update), by index. Returns the
        last event and those answers; it ends early at an error event or None (the client gone)."""
        finals: dict[int, dict[str, Any]] = {}
        while True:
            ev = await next_of()
            if ev is None or "error" in ev or stream:
                return ev, finals
            finals[ev["index"]] = ev
            if len(finals) == len(jobs):
                return ev, finals

    async def run(request: Request, jobs: list[Job], req: Generation, kind: str,
                  tools: ToolPlan | None = None, reasoning: Thinking | None = None,
                  shape: ResponseShape | MessageShape | GenerateShape | None = None) -> Response:
        """Answer a request from its jobs (make_jobs): streamed as their events come, else whole;
        with tools, a chat answer's text becomes tool calls (ToolPlan); with reasoning (the
        server's --reasoning-parser, whether this answer thinks), its reasoning and content;
        with shape, the answer is another API's (a Responses API's response, an Anthropic
        message, SGLang's /generate answers) or its events, and an error takes that API's form."""
        stream = req.stream
        include_usage = cfg.force_usage or bool(req.stream_options and req.stream_options.include_usage)
        speaker = speaker_of(req)
        engine.submit(*jobs)
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            ev, finals = await awaited_events(jobs, stream, lambda: next_event(jobs[0].events, gone))
            if ev is None:
                cancel_all(jobs)
                return Response(status_code=499)
            if "error" in ev:
                cancel_all(jobs)
                err = ev["error"]
                return error_response(err) if shape is None else JSONResponse(shape.error_body(err),
                                                                                 status_code=err.status)
        except BaseException:  # this handler was cancelled (e.g. shutdown): so are the jobs
            cancel_all(jobs)
            raise
        finally:
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
        if stream:
            # sse-starlette frames the events, pings, and cancels the generator when the client
            # disconnects or the server shuts down (its finally cancels the jobs).
            # The jobs are cancelled when the response ends, however it ends (a no-op for finished
            # ones), whether or not the stream's generator ever ran: its finally only runs once
            # started (a backstop: with sse-starlette 3 the generator starts first, as seen).
            chunks = sse_stream(jobs, kind, ev, include_usage, req.n, tools, reasoning, speaker)
            return EventSourceResponse(chunks if shape is None else shape.events(chunks), sep="\n",
                                       headers={"Cache-Control": "no-cache"},
                                       background=BackgroundTask(cancel_all, jobs))
        answer = full_response(jobs, kind, finals, req.n, tools, reasoning, speaker)
        return JSONResponse(answer if shape is None else shape.whole(answer))

    def speaker_of(req: Generation) -> str:
        """The answer's role: --response-role after a generation prompt, else the last message's
        (vLLM's)."""
        if not isinstance(req, ChatRequest) or req.add_generation_prompt:
            return cfg.response_role
        return req.messages[-1].role

    def logprobs_obj(kind: str, entries: list[LogprobEntry], offsets: list[int]) -> dict[str, Any]:
        """offsets: where each token's text starts in the whole completion (detokenize), which is
        what a streamed chunk's text_offset reports too."""
        if kind == "chat":
            return chat_logprobs(entries)
        return completion_logprobs(entries, offsets)

    def full_response(jobs: list[Job], kind: str, finals: dict[int, dict[str, Any]],
                      n: int, tools: ToolPlan | None = None,
                      reasoning: Thinking | None = None, speaker: str = "assistant") -> dict[str, Any]:
        """The answer of a request that did not stream, from each choice's one event (Job.update)."""
        choices = []
        for job in jobs:
            last = finals[job.index]
            lp = None
            if job.seq.logprobs is not None:
                lp = logprobs_obj(kind, last["logprobs"], last["offsets"])
            if kind == "chat":
                text, finish = last["delta"], last["finish_reason"]
                message = {"role": speaker, "content": text}
                if reasoning is not None:  # vLLM's field: the text before </think>
                    thought, text = reasoning[0].split(text, reasoning[1])
                    message |= {"reasoning": thought, "content": text}
                if tools is not None:
                    fields, finish = tools.message(text or "", finish)
                    message |= fields
                choices.append({"index": job.index, "message": message, "logprobs": lp,
                                "finish_reason": finish, "stop_reason": last["stop_reason"]})
            else:
                choices.append({"index": job.index, "text": last["delta"], "logprobs": lp,
                                "finish_reason": last["finish_reason"], "stop_reason": last["stop_reason"]})
                if job.prompt_logprobs is not None:  # vLLM's: each completion choice its prompt's
                    choices[-1]["prompt_logprobs"] = job.prompt_logprobs_field()
        obj, prefix = ("chat.completion", "chatcmpl-") if kind == "chat" else ("text_completion", "cmpl-")
        answer = {"id": prefix + jobs[0].id, "object": obj, "created": jobs[0].created,
                  "model": cfg.model_names[0], "choices": choices,
                  "usage": merged_usage([finals[job.index]["usage"] for job in jobs], n)}
        if kind == "chat" and jobs[0].prompt_logprobs is not None:  # vLLM's: the one prompt's, beside
            answer["prompt_logprobs"] = jobs[0].prompt_logprobs_field()
        if reasoning is not None:
            texts = [finals[job.index]["delta"] for job in jobs]
            answer["usage"] = with_reasoning_tokens(answer["usage"], jobs, texts, reasoning)
        return answer

    async def sse_stream(jobs: list[Job], kind: str, first: dict[str, Any], include_usage: bool,
                         n: int, tools: ToolPlan | None = None, reasoning: Thinking | None = None,
                         speaker: str = "assistant") -> AsyncGenerator[str]:
        chat = kind == "chat"
        # with reasoning, each choice's text goes first through its ReasoningStream (reasoning deltas)
        thoughts = {job.index: reasoning[0].stream(reasoning[1]) for job in jobs} if reasoning else {}
        # with tools, each choice's text goes through its ToolStream (content / tool-call deltas)
        tool_streams: dict[int, ToolStream] = {job.index: tools.stream() for job in jobs} if tools else {}
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + jobs[0].id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": jobs[0].created, "model": cfg.model_names[0]}
        # OpenAI: with include_usage every chunk carries "usage": null, the extra last one the usage.
        tail = {"usage": None} if include_usage else {}
        with_logprobs = jobs[0].seq.logprobs is not None

        def chunk(index: int, ev: dict[str, Any] | None, finish: str | None = None,
                  role: bool = False, stop_reason: str | int | None = None) -> str | None:
            text = ev["delta"] if ev else None
            lp = None
            if ev and with_logprobs:
                lp = logprobs_obj(kind, ev["logprobs"], ev["offsets"])
            if chat:
                delta: dict[str, Any] = {"role": speaker, "content": ""} if role else {}
                if index in thoughts and (text is not None or finish is not None):
                    thought, text = thoughts[index].feed(text or "")
                    if finish is not None:  # the answer is whole: what the stream held back
                        last_thought, rest = thoughts[index].end()
                        thought, text = thought + last_thought, text + rest
                    delta |= {"reasoning": thought} if thought else {}
                    text = text or None
                if index in tool_streams:
                    fed = tool_streams[index].feed(text) if text else None
                    if finish is not None:
                        last, finish = tool_streams[index].end(finish)
                        fed = merge_deltas(fed, last)
                    delta |= fed or {}
                elif text is not None:
                    delta["content"] = text
                if not (delta or lp or finish):  # text a ToolStream holds back
                    return None
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
            if finish is not None:  # the last chunk of a choice (vLLM's)
                choice["stop_reason"] = stop_reason
            return _json(head | {"choices": [choice]} | tail)

        try:
            if chat:
                for job in jobs:
                    yield chunk(job.index, None, role=True)
            ev, usages = first, {}
            while True:
                if "error" in ev:
                    yield _json(ev["error"].body())
                    break
                if (ev["delta"] or ev["logprobs"]) and (piece := chunk(ev["index"], ev)) is not None:
                    yield piece
                if "finish_reason" in ev:
                    yield chunk(ev["index"], None, ev["finish_reason"], stop_reason=ev["stop_reason"])
                    usages[ev["index"]] = ev["usage"]
                    if len(usages) == len(jobs):
                        if include_usage:
                            usage = merged_usage([usages[job.index] for job in jobs], n)
                            if reasoning is not None:
                                texts = [thoughts[job.index].text for job in jobs]
                                usage = with_reasoning_tokens(usage, jobs, texts, reasoning)
                            yield _json(head | {"choices": [], "usage": usage})
                        break
                ev = await jobs[0].events.get()
            yield "[DONE]"
        finally:  # also when the client disconnects mid-stream (sse-starlette cancels us)
            cancel_all(jobs)

    def template_prompt(req: ChatRequest | TokenizeRequest,
                        tool_dicts: list[dict[str, Any]] | None) -> list[int]:
        """A chat request's prompt: its messages (and tools) through the chat template."""
        if not req.messages:
            raise ApiError(400, "messages must not be empty", param="messages", code="invalid_value")
        if req.add_generation_prompt and req.continue_final_message:
            raise ApiError(400, "continue_final_message needs add_generation_prompt: false",
                           param="continue_final_message", code="invalid_value")
        template = cfg.chat_template
        if req.chat_template is not None:
            if not cfg.trust_request_template:
                raise ApiError(400, "chat_template: a request's own chat template is refused unless the "
                                    "server runs with --trust-request-chat-template (vLLM's rule)",
                               param="chat_template", code="invalid_value")
            template = req.chat_template
        content_format, names_developer = template_traits(template)
        msgs = [m.for_template(parts=content_format == "openai") for m in req.messages]
        if any(m["role"] == "developer" for m in msgs) and not names_developer:
            msgs = developer_as_system(msgs)
        if tool_parser is not None and tool_parser.history_id is not None:
            msgs = history_ids(msgs, tool_parser.history_id)
        clash = template_parameters() & set(req.chat_template_kwargs or {})
        if clash:
            raise ApiError(400, f"chat_template_kwargs: {', '.join(sorted(clash))} is a parameter of "
                                "apply_chat_template, not a template variable",
                           param="chat_template_kwargs", code="invalid_value")
        try:
            return chat_prompt_ids(tokenizer, msgs, tool_dicts, template, req.add_generation_prompt,
                                   req.continue_final_message, **(req.chat_template_kwargs or {}))
        except Exception as e:
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages",
                           code="invalid_value") from None

    def shown_tools(req: ChatRequest) -> list[dict[str, Any]] | None:
        """The tools the chat template shows: a request's, but with tool_choice none none under
        --exclude-tools-when-tool-choice-none."""
        return None if cfg.tools_only_when_chosen and req.tool_choice == "none" else req.tool_dicts()

    def chat_jobs(req: ChatRequest) -> tuple[list[Job], ToolPlan | None, Thinking | None]:
        """A chat request's jobs, with how its answer becomes tool calls and reasoning (run's)."""
        tools = req.tool_plan(tool_parser, cfg.auto_tools)
        tool_dicts = shown_tools(req)
        try:
            parallel = req.parallel_tool_calls is not False
            # "auto" with a structured output: that output's grammar alone (vLLM's)
            auto_free = tools is None or (tools.mode == "auto" and req.structured() is not None)
            tool_grammar = None if auto_free else tools.grammar(tool_dicts or [], parallel)
        except ValueError as e:
            raise ApiError(400, str(e), param="tools", code="invalid_value") from None
        prompt = template_prompt(req, tool_dicts)
        reasoning, gate, budget = None, (), req.thinking_token_budget
        if budget is not None and (budget < 0 or cfg.reasoning_parser is None):
            raise ApiError(400, "thinking_token_budget: a number of tokens >= 0, on a server started with "
                           "--reasoning-parser (whose end of reasoning it forces)",
                           param="thinking_token_budget", code="invalid_value")
        if cfg.reasoning_parser is not None:
            parser = REASONING_PARSERS[cfg.reasoning_parser]
            reasoning = parser, parser.thinking(req.chat_template_kwargs)
            if reasoning[1]:  # a grammar (structured outputs, a forced call) starts after the reasoning
                gate = tuple(tokenizer.encode(parser.end, add_special_tokens=False))
        jobs = make_jobs(req, [prompt], "messages", None, tools, tool_grammar, gate, budget=budget)
        return jobs, tools, reasoning

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatRequest)
        assert isinstance(req, ChatRequest)
        jobs, tools, reasoning = chat_jobs(req)
        return await run(request, jobs, req, "chat", tools, reasoning)

    stored_responses = ResponseStore()
    # background responses still answering, by id: their task, jobs and shape
    in_background: dict[str, tuple[asyncio.Task, list[Job], ResponseShape]] = {}

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API (vLLM's and SGLang's route), answered as the chat request it
        stands for (responses_api)."""
        req = await parse(request, ResponsesRequest)
        assert isinstance(req, ResponsesRequest)
        history = []
        if req.previous_response_id is not None:
            history = stored_responses.conversation_of(req.previous_response_id)
        conversation = req.conversation(history)
        chat = with_server_defaults(req.chat_request(conversation))
        jobs, tools, reasoning = chat_jobs(chat)
        shape = ResponseShape(req, chat, conversation, cfg.model_names[0], stored_responses)
        if req.background:  # answered by a task of its own: the client polls GET /v1/responses/{id}
            events = EventLog() if req.stream else None
            task = asyncio.ensure_future(answer_in_background(jobs, chat, tools, reasoning, shape, events))
            in_background[shape.id] = (task, jobs, shape)
            queued = shape.pending("queued")
            if events is None:
                return JSONResponse(queued)
            # the stream follows the task's events; a client gone leaves the task answering
            stored_responses.put_log(shape.id, events)
            return EventSourceResponse(events.follow(), sep="\n", headers={"Cache-Control": "no-cache"})
        return await run(request, jobs, chat, "chat", tools, reasoning, shape)

    async def answer_in_background(jobs: list[Job], chat: ChatRequest, tools: ToolPlan | None,
                                   reasoning: Thinking | None, shape: ResponseShape,
                                   events: EventLog | None = None) -> None:
        """A background response's answer, stored as it goes: in progress once its jobs are
        submitted, then completed (or incomplete), or failed with the error that ended it; a
        cancel (cancel_background) cancels this task and its jobs. With `events` (a background
        stream) its events go there as they come, closed however the task ends."""
        shape.pending("in_progress")
        engine.submit(*jobs)
        try:
            ev, finals = await awaited_events(jobs, events is not None, jobs[0].events.get)
            assert ev is not None  # no client to leave
            if "error" in ev:
                cancel_all(jobs)
                err = ev["error"]
                error = {"code": err.code or err.type, "message": err.message}
                shape.pending("failed", error)
                if events is not None:  # the response (its id, to retrieve it by), then the error
                    events.append(stream_event("response.created", 0,
                                               response=shape.response([], None, None, "in_progress")))
                    events.append(stream_event("error", 1, **error, param=err.param))
            elif events is not None:  # the chunks follow from the first event
                chunks = sse_stream(jobs, "chat", ev, True, chat.n, tools, reasoning, speaker_of(chat))
                async for event in shape.events(chunks):  # the last stores the answer (finished)
                    events.append(event)
                last = json.loads(events.events[-1]["data"])
                if last["type"] == "error":  # an error event ended it: stored failed
                    shape.pending("failed", {"code": last["code"], "message": last["message"]})
            else:
                shape.whole(full_response(jobs, "chat", finals, chat.n, tools, reasoning, speaker_of(chat)))
        except asyncio.CancelledError:
            cancel_all(jobs)
            raise
        except Exception as e:  # not left in progress for ever: failed, and the server goes on
            log.exception("background response %s failed", shape.id)
            cancel_all(jobs)
            shape.pending("failed", {"code": "server_error", "message": f"{type(e).__name__}: {e}"})
        finally:
            in_background.pop(shape.id, None)
            if events is not None:
                events.close()

    def cancel_background(response_id: str) -> dict[str, Any] | None:
        """Cancel a background response still answering: its response, now cancelled (None if
        none was answering)."""
        running = in_background.pop(response_id, None)
        if running is None:
            return None
        task, jobs, shape = running
        task.cancel()
        cancel_all(jobs)
        return shape.pending("cancelled")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (vLLM's route), answered as the chat request it stands for
        (anthropic_api); errors in Anthropic's shape."""
        try:
            req = await parse(request, MessagesRequest)
            assert isinstance(req, MessagesRequest)
            chat = with_server_defaults(req.chat_request())
            jobs, tools, reasoning = chat_jobs(chat)
        except ApiError as e:
            return JSONResponse(anthropic_error(e), status_code=e.status)
        shape = MessageShape(cfg.model_names[0], len(jobs[0].seq.prompt))
        return await run(request, jobs, chat, "chat", tools, reasoning, shape)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Anthropic's token count of a Messages request: its prompt's tokens."""
        try:
            req = await parse(request, CountTokensRequest)
            assert isinstance(req, CountTokensRequest)
            chat = with_server_defaults(req.chat_request())
            return JSONResponse({"input_tokens": len(template_prompt(chat, shown_tools(chat)))})
        except ApiError as e:
            return JSONResponse(anthropic_error(e), status_code=e.status)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        """SGLang's native generation API (sglang_api), over the completions path."""
        try:
            req = await parse(request, GenerateRequest)
            assert isinstance(req, GenerateRequest)
            prompts, batch = req.prompts(lambda text: tokenizer(text)["input_ids"], vocab)
            completions = [with_server_defaults(c) for c in req.completion_requests(prompts)]
            if len(completions) == 1:
                jobs = make_jobs(completions[0], prompts, "text", None)
            else:  # each prompt its own sampling params: its jobs made apart, answering as one batch
                jobs, events = [], asyncio.Queue()
                for p, (prompt, completion) in enumerate(zip(prompts, completions)):
                    jobs += make_jobs(completion, [prompt], "text", None, events=events,
                                      first_index=p * completion.n)
        except ApiError as e:
            return JSONResponse(GenerateShape.error_body(e), status_code=e.status)
        shape = GenerateShape(req, jobs, batch, completions[0].n, tokenizer)
        return await run(request, jobs, completions[0], "completion", shape=shape)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        """SGLang's: forget the prefix cache's contents (so a benchmark's runs start alike), if no
        request runs or waits (else a 400, as SGLang's)."""
        check_auth(request)
        if not engine.alive():
            return Response("The engine has stopped.\n", status_code=503)
        loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
        engine.flush_prefix_cache(lambda ok: loop.call_soon_threadsafe(done.set_result, ok))
        if await done:
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: requests are running or waiting.\n", status_code=400)

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> dict[str, Any]:
        """SGLang's: the model served, and that it generates."""
        check_auth(request)
        return {"model_path": cfg.model_names[-1], "tokenizer_path": cfg.model_names[-1],
                "is_generation": True, "served_model_name": cfg.model_names[0]}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info(request: Request) -> dict[str, Any]:
        """SGLang's (both its names): the flags, and the acceptance length and throughput its
        benchmarks read (sglang_api.server_info)."""
        check_auth(request)
        return server_info(cfg.flags, cfg.context, engine.metrics)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """SGLang's: healthy once a one-token generation comes back (503 if it fails, or takes
        over HEALTH_GENERATE_S, or the engine has stopped)."""
        if not engine.alive():
            return Response(status_code=503)
        jobs = make_jobs(CompletionRequest(prompt=[0], max_tokens=1, temperature=0.0), [[0]], "prompt", None)
        engine.submit(*jobs)

        async def finished() -> bool:
            while True:
                ev = await jobs[0].events.get()
                if "error" in ev or "finish_reason" in ev:
                    return "error" not in ev

        try:
            ok = await asyncio.wait_for(finished(), HEALTH_GENERATE_S)
        except TimeoutError:
            cancel_all(jobs)
            ok = False
        return Response(status_code=200 if ok else 503)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(request: Request, response_id: str, stream: bool = False,
                              starting_after: int | None = None) -> Response:
        """A stored response; with stream, a background stream's events again, those after
        sequence number starting_after (all without), then the rest as they come (OpenAI's and
        vLLM's resumption of a stream the client lost)."""
        check_auth(request)
        if not stream:
            return JSONResponse(stored_responses.get(response_id).response)
        events = stored_responses.log_of(response_id)
        return EventSourceResponse(events.follow(-1 if starting_after is None else starting_after), sep="\n",
                                   headers={"Cache-Control": "no-cache"})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> dict[str, Any]:
        """OpenAI's: a background response stops answering and is stored as cancelled; one that
        has finished is returned as it is; any other response cannot be cancelled (a 400)."""
        check_auth(request)
        stored = stored_responses.get(response_id)
        if not stored.response.get("background"):
            raise ApiError(400, "only background responses can be cancelled", param="response_id",
                           code="invalid_value")
        cancelled = cancel_background(response_id)
        return stored_responses.get(response_id).response if cancelled is None else cancelled

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
        check_auth(request)
        stored_responses.get(response_id)  # a 404 when there is none
        cancel_background(response_id)  # one still answering stops first
        stored_responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(request: Request, response_id: str, limit: int = 20, order: str = "desc",
                                   after: str | None = None, before: str | None = None) -> dict[str, Any]:
        """OpenAI's list of a stored response's input items (responses_api.page_of)."""
        check_auth(request)
        return page_of(stored_responses.get(response_id).input_items, limit, order, after, before)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        assert isinstance(req, CompletionRequest)
        p = req.prompt
        # one prompt (text or token ids) or a batch of them (vLLM's and OpenAI's list forms)
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        prompts = []
        for one in batch:
            if isinstance(one, str):
                prompts.append(list(tokenizer(one)["input_ids"]))
                continue
            if any(not 0 <= t < vocab for t in one):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt",
                               code="invalid_value")
            prompts.append(list(one))
        jobs = make_jobs(req, prompts, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS)
        return await run(request, jobs, req, "completion")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await parse(request, TokenizeRequest)
        assert isinstance(req, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt", code="invalid_value")
        if req.prompt is not None:
            ids = list(tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        else:
            ids = template_prompt(req, req.tool_dicts())
        return {"count": len(ids), "max_model_len": cfg.context, "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await parse(request, DetokenizeRequest)
        assert isinstance(req, DetokenizeRequest)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens", code="invalid_value")
        return {"prompt": tokenizer.decode(req.tokens)}

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "eagle-spec",
                "max_model_len": cfg.context}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {"object": "list", "data": [model_card(name) for name in cfg.model_names[:cfg.listed]]}

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str) -> dict[str, Any]:
        check_auth(request)
        if name not in cfg.model_names:
            raise ApiError(404, f"model '{name}' does not exist", param="model", code="model_not_found")
        return model_card(cfg.model_names[0])

    @app.get("/health")
    async def health() -> Response:
        if engine.alive():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    return app


# ---------------------------------------------------------------------------------------
# Command line


def ngram_settings(args: argparse.Namespace) -> tuple[int, int, int]:
    """NGRAM's (chain length, shortest and longest match) from the flags: a chain of
    --speculative-num-draft-tokens - 1 (default ngram.DEFAULT_DRAFT_TOKENS), matches of 1-4
    tokens by default."""
    from eagle_infer.ngram import DEFAULT_DRAFT_TOKENS
    from eagle_infer.tree import NGRAM_MAX

    for flag in ("speculative_num_steps", "speculative_eagle_topk", "speculative_ngram_branch",
                 "speculative_batch_tree"):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag.replace('_', '-')} is for a draft head's tree, not "
                            f"--speculative-algorithm NGRAM (its chain: --speculative-num-draft-tokens)")
    n = args.speculative_num_draft_tokens
    n = DEFAULT_DRAFT_TOKENS + 1 if n is None else n
    if n < 2:
        raise UserError(f"--speculative-num-draft-tokens must be >= 2 with NGRAM (the root and a draft), "
                        f"got {n}")
    lo, hi = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    lo = 1 if lo is None else lo
    hi = max(lo, NGRAM_MAX) if hi is None else hi
    if not 1 <= lo <= hi:
        raise UserError(f"--speculative-ngram-min-match-window-size {lo} and --speculative-ngram-max-match-"
                        f"window-size {hi}: need 1 <= min <= max")
    if (args.speculative_ngram_capacity or 0) < 0:
        raise UserError(f"--speculative-ngram-capacity must be >= 0 (0: no corpus), got "
                        f"{args.speculative_ngram_capacity}")
    return n - 1, lo, hi


def resolve_draft(args: argparse.Namespace) -> tuple[str, Path | None]:
    """(algorithm, head folder): fall back to NONE only when nothing speculative was asked for
    explicitly and the reference head is missing."""
    algo, path = args.speculative_algorithm, args.speculative_draft_model_path
    if algo == "NONE":
        if path:
            log.warning("--speculative-draft-model-path is ignored with --speculative-algorithm NONE")
        return "NONE", None
    if algo == "NGRAM":
        if path:
            raise UserError("--speculative-algorithm NGRAM takes no draft model: leave "
                            "--speculative-draft-model-path out")
        return algo, None
    ngram_flags = [f for f in ("speculative_ngram_min_match_window_size",
                               "speculative_ngram_max_match_window_size", "speculative_ngram_capacity")
                   if getattr(args, f) is not None]
    if ngram_flags:
        raise UserError(f"--{ngram_flags[0].replace('_', '-')} is for --speculative-algorithm NGRAM")
    if path:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise UserError(f"draft head not found: {folder}")
        return algo or "EAGLE3", folder
    if DEFAULT_HEAD.is_dir():
        return algo or "EAGLE3", DEFAULT_HEAD
    if algo:
        raise UserError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path "
                        f"(the reference head {DEFAULT_HEAD} is missing)")
    log.warning("the reference EAGLE-3 head %s is missing: serving WITHOUT speculative decoding "
                "(--speculative-algorithm NONE); pass --speculative-draft-model-path to use a head",
                DEFAULT_HEAD)
    return "NONE", None


def build_engine(args: argparse.Namespace, warm: bool = False) -> tuple[Engine, Any, set[int], ServerConfig]:
    """Load the target (and head), build the decoder and the engine around it; warm: compile
    the compiled steps' graphs now (warm_up), not at the first requests."""
    import torch

    from eagle_infer.default_model import DEFAULT_MODEL_NAME, resolve_model_path
    from eagle_infer.engine import PlainDecoder
    from eagle_infer.heads import load_head_for
    from eagle_infer.loader import (
        default_device,
        dtype_name,
        eos_ids,
        load_model,
        load_tokenizer,
        resolve_dtype,
    )
    from eagle_infer.ngram import DEFAULT_CORPUS_TOKENS, NgramDecoder
    from eagle_infer.speculative import SpecDecoder

    apply_vllm_flags(args)  # first: their values go through the flags' checks
    if args.max_running_requests < 1:
        raise UserError("--max-running-requests must be >= 1")
    if args.stream_interval < 1:
        raise UserError("--stream-interval must be >= 1")
    for flag in ("cuda_graph_max_bs", "torch_compile_max_bs"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.speculative_disable_by_batch_size is not None and args.speculative_disable_by_batch_size < 0:
        raise UserError("--speculative-disable-by-batch-size must be >= 0")
    algo, head_path = resolve_draft(args)
    device = args.device or default_device()
    # Validate the flags before the slow loading.
    dtype = dtype_name(resolve_dtype(args.dtype, device))
    tree = None if algo in ("NONE", "NGRAM") else resolve_tree(args, torch.device(device).type, dtype)
    ngram = ngram_settings(args) if algo == "NGRAM" else None
    batch_tree = None if tree is None else resolve_batch_tree(args, torch.device(device).type, dtype)
    folder = resolve_model_path(args.model_path)
    tokenizer_folder = folder if args.tokenizer is None else Path(args.tokenizer).expanduser()
    if not tokenizer_folder.is_dir():
        raise UserError(f"--tokenizer {args.tokenizer}: no such folder")
    sampling_defaults = sampling_defaults_of(args.generation_config, folder, args.override_generation_config)
    chat_template = chat_template_of(args.chat_template)
    log.info("loading %s (%s, %s, %d CPU threads)", folder, dtype, device, torch.get_num_threads())
    target = load_model(folder, dtype, device, quantization=args.quantization)
    tokenizer = load_tokenizer(tokenizer_folder)
    clash = template_parameters_of(tokenizer) & set(args.default_chat_template_kwargs or {})
    if clash:
        raise UserError(f"--default-chat-template-kwargs: {', '.join(sorted(clash))} is a parameter of "
                        "apply_chat_template, not a template variable")
    try:
        template = tokenizer.get_chat_template(chat_template)
    except ValueError:  # no template: requests get the tokenizer's error, per request
        template = None
    end = REASONING_PARSERS[args.reasoning_parser].end if args.reasoning_parser else None
    if end is not None and end not in (template or "") and end not in tokenizer.get_vocab():
        log.warning("--reasoning-parser %s: neither the chat template nor the vocabulary knows %s, so "
                    "this model may never write it: every answer would be reasoning alone (content null) "
                    "and a forced tool call's grammar, which starts after it, would never start",
                    args.reasoning_parser, end)
    if args.chat_template_content_format == "auto":  # (the app detects it per template: said here)
        log.info("chat template content format: %s (detected from the template, as vLLM's auto; "
                 "--chat-template-content-format sets it)", content_format_of(template))
    ctx = args.context_length
    if ctx < 16 or ctx > target.config.max_position_embeddings:
        raise UserError(f"--context-length must be in [16, {target.config.max_position_embeddings}] "
                        f"for this model, got {ctx}")
    if ngram is not None:
        plain_above = resolve_disable_by_batch_size(args, torch.device(device).type)
        capacity = args.speculative_ngram_capacity
        decoder = NgramDecoder(target, *ngram, args.max_running_requests, ctx,
                               prefix_cache=args.prefix_caching, disable_by_batch_size=plain_above,
                               corpus_tokens=DEFAULT_CORPUS_TOKENS if capacity is None else capacity)
        usable = ctx - decoder.max_pending  # a chain's slots past a request's end
        if usable < 2:
            raise UserError(f"--context-length {ctx} leaves no room next to the n-gram chain")
        log.info("speculative decoding: n-gram prompt lookup, chains of %d, matches of %d-%d tokens, "
                 "a corpus of %d tokens of served requests%s", *ngram, decoder.corpus.capacity,
                 "" if plain_above is None else f", plain rounds above {plain_above} requests")
    elif tree is None:
        decoder = PlainDecoder(target, args.max_running_requests, ctx, prefix_cache=args.prefix_caching)
        usable = ctx
    else:
        head = load_head_for(head_path, target)
        kind = "eagle3" if head.eagle3 else "eagle2"
        if (algo == "EAGLE3") != head.eagle3:
            raise UserError(f"{head_path} is an {kind} head: use --speculative-algorithm "
                            f"{'EAGLE3' if head.eagle3 else 'EAGLE'}")
        if args.speculative_token_map:
            from eagle_train.tokenmap import load_token_map

            head.set_token_map(load_token_map(args.speculative_token_map, target.config.vocab_size))
        plain_above = resolve_disable_by_batch_size(args, torch.device(device).type, batch_tree)
        decoder = SpecDecoder(target, head, tree, args.max_running_requests, ctx,
                              disable_by_batch_size=plain_above, batch_tree=batch_tree,
                              prefix_cache=args.prefix_caching)
        usable = ctx - decoder.max_pending  # the largest tree's slots past a request's end
        if usable < 2:
            raise UserError(f"--context-length {ctx} leaves no room next to the draft tree")
        log.info("speculative decoding: %s head %s, %s%s%s", kind, head_path, tree,
                 "" if batch_tree is None else f", {batch_tree[1].label()} from {batch_tree[0]} requests",
                 "" if plain_above is None else f", rounds without drafts above {plain_above} requests")
    compiled = compile_settings(args, torch.device(device).type, batch_tree)
    if compiled is not None:
        mode, max_bs = compiled
        decoder.compile(mode, max_bs)
        kind = "CUDA graphs" if mode else "torch.compile"
        if warm:
            t0 = time.perf_counter()
            log.info("%s: compiling the decode steps for batches up to %d before serving "
                     "(--disable-%s to skip; minutes at a first start on a few CPU cores, seconds "
                     "later from torch's compile cache)", kind, decoder.max_bs,
                     "cuda-graph" if mode else "torch-compile")
            sizes = warm_up_beside_a_helper(args, decoder, mode, lambda n, sizes, s: log.info(
                "%s: batch size %d of %s compiled and run in %.1f s", kind, n, sizes, s))
            log.info("%s: batch sizes %s warmed up in %.1f s", kind, sizes, time.perf_counter() - t0)
        else:
            log.info("%s for batches up to %d: each batch bucket compiles at its first step",
                     kind, decoder.max_bs)
    own = DEFAULT_MODEL_NAME if str(args.model_path) == "default" else Path(folder).name
    served = list(dict.fromkeys(args.served_model_name or [own]))  # each once: /v1/models lists them
    name = served[0]
    names = list(dict.fromkeys([*served, str(args.model_path), Path(folder).name]))
    eos = eos_ids(target.config, tokenizer)  # the config's has generation_config.json's
    # Draft positions a round can accept: the tree's depth, at most its node count.
    depth = tree.max_depth if tree else ngram[0] if ngram else 0
    metrics = Metrics(depth, model_name=name)
    chunk = args.chunked_prefill_size
    if chunk is None:  # ~1 ms a prompt token on a 2-core CPU (the default target): a chunk ~ a round or two
        chunk = 256 if torch.device(device).type == "cpu" else 8192
    engine = Engine(decoder, load_tokenizer(tokenizer_folder), metrics, algo != "NONE", args.prefix_caching,
                    chunk)
    # /get_server_info's flags as they came out (SGLang shows its server args after their defaults)
    resolved = {"speculative_algorithm": algo, "speculative_draft_model_path": head_path, "dtype": dtype,
                "device": device}
    if tree is not None:
        resolved |= {"speculative_num_steps": tree.num_steps, "speculative_eagle_topk": tree.eagle_topk,
                     "speculative_num_draft_tokens": tree.num_draft_tokens,
                     "speculative_ngram_branch": tree.ngram_branch}
    if ngram is not None:
        resolved |= {"speculative_num_draft_tokens": ngram[0] + 1,
                     "speculative_ngram_min_match_window_size": ngram[1],
                     "speculative_ngram_max_match_window_size": ngram[2],
                     "speculative_ngram_capacity": decoder.corpus.capacity}
    cfg = ServerConfig(names, args.api_key, usable, target.config.vocab_size, args.stream_interval,
                       tool_parser=tool_parser_of(args), auto_tools=args.enable_auto_tool_choice,
                       chat_template=chat_template, reasoning_parser=args.reasoning_parser,
                       sampling_defaults=sampling_defaults, log_requests=args.log_requests,
                       allowed_origins=args.allowed_origins, listed=len(served),
                       max_logprobs=target.config.vocab_size if args.max_logprobs == -1
                       else args.max_logprobs,
                       response_role=args.response_role, content_format=args.chat_template_content_format,
                       trust_request_template=args.trust_request_chat_template,
                       tokens_as_ids=args.return_tokens_as_token_ids,
                       template_kwargs=args.default_chat_template_kwargs or {},
                       tools_only_when_chosen=args.exclude_tools_when_tool_choice_none,
                       force_usage=args.enable_force_include_usage,
                       request_id_headers=args.enable_request_id_headers,
                       flags=json.loads(json.dumps(vars(args) | resolved, default=str)))
    return engine, tokenizer, eos, cfg


def warm_up_beside_a_helper(args: argparse.Namespace, decoder: Any, mode: str | None,
                            progress: Callable[[int, list[int], float], None]) -> list[int]:
    """engine.warm_up, with a helper process that builds the same decoder from the same flags
    and compiles every other batch bucket's graphs meanwhile, into torch's on-disk compile
    cache; this process then compiles those buckets from the cache in seconds. Compiling is
    mostly one core's work (Dynamo's tracing, then one C++ compile a graph: Inductor's C++
    wrapper), so on a first start with two cores or more the two share it: the EAGLE-3
    server's batches 1-8 on a 2-core Zen 4, cold, took 300 s alone (batch sizes 1, 2, 3, 8:
    100, 98, 71, 31 s), 180 s with the helper. Once a start with the same flags has filled
    the cache (a marker file there says so: warmed_marker), the helper's start and its model's
    loading cost more than they save (19 s alone, 25 s with it), so later starts go alone.
    Inductor steps on a CPU only (a CUDA graph is the process's own), and only where the memory
    available holds a second copy of the decoder's weights and caches with room to spare (a
    larger target compiles alone); where the helper fails, this process compiles its buckets
    itself."""
    import multiprocessing
    import os

    import torch

    from eagle_infer import cpu_linears
    from eagle_infer.engine import warm_up, warm_up_sizes
    from eagle_infer.generate import batch_bucket

    sizes = warm_up_sizes(decoder)
    buckets = sorted({batch_bucket(n) for n in sizes})
    theirs = [n for n in sizes if buckets.index(batch_bucket(n)) % 2 == 1]
    on_cpu = decoder.target.cache.kv.device.type == "cpu"
    if mode is not None or not on_cpu or not theirs or len(os.sched_getaffinity(0)) < 2:
        return warm_up(decoder, progress)
    marker = warmed_marker(args)
    if marker.exists():
        return warm_up(decoder, progress)
    modules = [decoder.target] + ([decoder.head] if hasattr(decoder, "head") else [])
    needed = 2 * sum(t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()])
    available = cpu_linears.available_memory_bytes()
    if available is not None and available < needed:
        log.info("no compile helper: %.1f GB of memory available, a second decoder wants ~%.1f",
                 available / 1e9, needed / 1e9)
        return warm_up(decoder, progress)
    helper = multiprocessing.get_context("spawn").Process(
        target=warm_up_in_helper, args=(args, theirs, torch.get_num_threads()), daemon=True)
    helper.start()
    log.info("batch sizes %s compile in a helper process meanwhile", theirs)
    warm_up(decoder, progress, [n for n in sizes if n not in theirs])
    helper.join()
    if helper.exitcode != 0:
        log.warning("the compile helper exited with %s: batch sizes %s compile here", helper.exitcode, theirs)
    warm_up(decoder, progress, theirs)
    marker.touch()
    return sizes


def warmed_marker(args: argparse.Namespace) -> Path:
    """A file in torch's compile cache for the server's flags (those that cannot change its
    graphs left out), the $EAGLE_* settings (the kernels and layers a graph calls:
    EAGLE_FUSED_LAYERS=0 traces the Python layers, which no start with the op compiled) and
    torch's version: a start with them has compiled every bucket there."""
    import hashlib
    import os

    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    skip = ("host", "port", "api_key", "served_model_name", "log_level", "seed", "log_requests",
            "disable_log_stats", "enable_metrics", "response_role", "max_logprobs",
            "return_tokens_as_token_ids", "chat_template_content_format", "uvicorn_log_level",
            "trust_request_chat_template",
            "gpu_memory_utilization", "tokenizer_mode", "allowed_origins", "root_path", "ssl_keyfile",
            "ssl_certfile", "block_size", "swap_space", "default_chat_template_kwargs",
            "exclude_tools_when_tool_choice_none", "disable_uvicorn_access_log", "enable_request_id_headers",
            "enable_force_include_usage", "enable_prompt_tokens_details", "disable_fastapi_docs",
            "input_file", "output_file", "batch_concurrency")  # (run_batch's: the same server graphs)
    flags = json.dumps({k: v for k, v in sorted(vars(args).items()) if k not in skip}, default=str)
    settings = json.dumps(sorted((k, v) for k, v in os.environ.items() if k.startswith("EAGLE_")))
    key = hashlib.sha256(f"{torch.__version__} {flags} {settings}".encode()).hexdigest()[:16]
    return Path(cache_dir()) / f"eagle_infer_warmed_{key}"


def warm_up_in_helper(args: argparse.Namespace, sizes: list[int], threads: int) -> None:
    """warm_up_beside_a_helper's helper: the server's decoder, built from its flags, compiled
    at `sizes` (into torch's compile cache, which the server then reads) with the server's
    thread count (Inductor's C++ kernels are written for it: another misses the cache)."""
    import torch

    from eagle_infer.engine import warm_up

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    warm_up(build_engine(args)[0].dec, sizes=sizes)


def in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a thread that exits when it returns; its exception is re-raised here.

    The server loads its model this way, not in the main thread: libgomp keeps an OpenMP team
    for every thread that ran a parallel region, and with a second team alive beside the engine
    thread's on a 2-core CPU the engine's parallel regions slow down (decoding in the engine
    thread after loading in the main thread: 32 tok/s; after loading in a thread that had
    exited: 48; everything in one thread: 51; AMD EPYC AVX512-BF16, 2 threads, bf16, compiled
    plain decode). A thread's team goes when the thread exits."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            box["err"] = e

    t = threading.Thread(target=run, name="eagle-load")
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def configure_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def start_serving(args: argparse.Namespace) -> tuple[Engine, FastAPI]:
    """The server's start (main's, and run_batch's): the engine built from the flags in a thread
    of its own and warmed, its app, the start-up objects frozen out of garbage
    collection, and torch seeded with --seed after the warm-up's draws (a fresh start answers
    alike). The caller unfreezes them when done (else nanobind, triton's bindings, reports the
    frozen objects as leaked at exit)."""
    import torch

    engine, tokenizer, eos, cfg = in_own_thread(build_engine, args, True)
    # The loaded model, its compiled graphs and the libraries' objects (~550k) live as long as the
    # server, and a full collection walks every one of them: 390 ms on a 2-core Zen 4, a stall of
    # every stream whenever the collector runs one. Frozen, collections skip them (0.01 ms); vLLM
    # freezes its start-up objects the same way.
    gc.collect()
    gc.freeze()
    log.info("%d start-up objects frozen out of garbage collection", gc.get_freeze_count())
    app = create_app(engine, tokenizer, eos, cfg)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    return engine, app


@cli_errors
def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = build_parser().parse_args(argv)
    configure_logging(args)
    engine, app = start_serving(args)
    # uvicorn re-raises the signal it shut down on once it is done; a no-op handler of ours
    # then receives it, so SIGTERM ends the process with status 0 after the graceful shutdown.
    noop: Callable[[int, Any], None] = lambda signum, frame: None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, noop)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level or args.log_level,
                            root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile,
                            ssl_certfile=args.ssl_certfile, timeout_graceful_shutdown=30,
                            access_log=not args.disable_uvicorn_access_log)
    try:
        uvicorn.Server(config).run()
    finally:
        engine.stop()
        gc.unfreeze()  # (start_serving's freeze)
    log.info("server stopped")


if __name__ == "__main__":
    main()
