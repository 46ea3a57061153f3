"""Bounded soak test of the OpenAI-compatible server, on loopback only.

    python scripts/soak_server.py                      # 32 clients, 400 requests, EAGLE-3 head, fp32
    python scripts/soak_server.py --large              # 32 clients, 3000 requests (~15-30 min on 2 cores)
    python scripts/soak_server.py --algorithm NONE --requests 200 --json /tmp/soak.json

Starts the server (fp32, shipped EAGLE-3 head by default, an API key), then `--clients`
concurrent clients send a seeded random mix: chat and completions, streamed and not, clients that
disconnect mid-stream or give up before a non-streamed answer, and bad requests (bad JSON, wrong
types, unknown model, wrong key, too long). Every request is accounted for: a full answer (200
with a finish_reason; a stream ending in [DONE]), an intended disconnect, or the intended 4xx.
Anything else is an error: a 5xx, a wrong status, a truncated answer, a transport error or a
timeout (a lost request). A warm-up of 2 x clients requests comes first; the server's RSS is read
from /proc after it and at the end. Afterwards every row must be free again (/metrics).

Writes JSON (--json, default results/soak_server.json): counts per kind and outcome, latency
p50/p99 of full answers, RSS after warm-up / at the end / growth, errors with examples, the
server's metrics deltas. Bounded: it stops sending after --max-seconds whatever is left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle_infer.launch import ServerProcess  # noqa: E402
from eagle_infer.metrics import parse_metrics  # noqa: E402

API_KEY = "soak-key"
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Name three colors.", "What is the capital of France?", "Write a haiku about rain.",
           "Explain recursion in one sentence.", "List two prime numbers.", "Say hello in Spanish."]
COMPLETIONS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time", "import numpy as np\n"]
# kind -> weight in the mix
MIX = {"chat": 30, "chat_stream": 22, "completion": 10, "completion_stream": 10, "stream_disconnect": 10,
       "early_disconnect": 6, "bad": 12}
# Bad requests and the status each must get.
BAD = [
    ("chat", b"{not json", 400), ("chat", {"messages": "Hi"}, 400), ("chat", {"messages": []}, 400),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": "8"}, 400),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100_000}, 400),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 99}, 400),
    ("chat", {"messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 4}, 400),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "model": "gpt-4"}, 404),
    ("completion", {"prompt": [10**9]}, 400), ("completion", {"prompt": "Hi", "temperature": -1}, 400),
    ("completion", {"prompt": "Hi", "n": 0}, 400), ("auth", {"prompt": "Hi"}, 401),
]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------------------------------
# One request of each kind -> (outcome, latency or None, detail)


def body_for(kind: str, rng: random.Random, max_tokens: int) -> tuple[str, dict[str, Any]]:
    n = rng.randint(2, max_tokens)
    if kind.startswith("completion") or (kind.endswith("disconnect") and rng.random() < 0.3):
        return "/v1/completions", {"model": MODEL, "prompt": rng.choice(COMPLETIONS), "max_tokens": n,
                                   "temperature": rng.choice([0, 0, 0.8])}
    body = {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": n,
            "temperature": rng.choice([0, 0, 0.7]), "seed": rng.randrange(1000)}
    if rng.random() < 0.2:
        body |= {"logprobs": True, "top_logprobs": 2}
    return "/v1/chat/completions", body


async def send(http: httpx.AsyncClient, kind: str, rng: random.Random, max_tokens: int) -> tuple[str, str]:
    """Returns (outcome, detail): outcome 'ok', 'disconnect', 'expected_error' or 'error'."""
    if kind == "bad":
        where, body, status = rng.choice(BAD)
        path = "/v1/completions" if where in ("completion", "auth") else "/v1/chat/completions"
        headers = {"Authorization": "Bearer wrong"} if where == "auth" else {}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await http.post(path, content=content, headers=headers | {"Content-Type": "application/json"})
        is_json = r.headers.get("content-type", "").startswith("application/json")
        err = r.json().get("error", {}) if is_json else {}
        if r.status_code == status and set(err) == {"message", "type", "param", "code"}:
            return "expected_error", ""
        return "error", f"HTTP {r.status_code} for bad request {body!r:.60}: {r.text[:120]}"
    path, body = body_for(kind, rng, max_tokens)
    if kind == "early_disconnect":  # give up before the answer (or get it, if it is quicker)
        try:
            r = await http.post(path, json=body, timeout=rng.uniform(0.05, 0.6))
        except httpx.TimeoutException:
            return "disconnect", ""
        return check_full(r.status_code, r.text, stream=False)
    if kind.endswith("stream") or kind == "stream_disconnect":
        body |= {"stream": True, "stream_options": {"include_usage": rng.random() < 0.5}}
        leave_after = rng.randint(1, 3) if kind == "stream_disconnect" else None
        lines: list[str] = []
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return "error", f"HTTP {r.status_code} (stream): {(await r.aread())[:120]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if leave_after is not None and len(lines) >= leave_after:
                        return "disconnect", ""  # leaving the block closes the connection
        return check_full(200, "\n".join(lines), stream=True)
    r = await http.post(path, json=body)
    return check_full(r.status_code, r.text, stream=False)


def check_full(status: int, text: str, stream: bool) -> tuple[str, str]:
    """A complete answer: 200, a finish_reason, and (streamed) [DONE] after it."""
    if status != 200:
        return "error", f"HTTP {status}: {text[:160]}"
    try:
        if not stream:
            choice = json.loads(text)["choices"][0]
            ok = choice["finish_reason"] in ("stop", "length")
        else:
            data = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
            chunks = [json.loads(d) for d in data[:-1]]
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
            ok = data[-1] == "[DONE]" and finishes[-1] in ("stop", "length") and not any(
                "error" in c for c in chunks)
    except (ValueError, KeyError, IndexError) as e:
        return "error", f"malformed answer ({type(e).__name__}: {e}): {text[:160]}"
    return ("ok", "") if ok else ("error", f"incomplete answer: {text[-160:]}")


# ---------------------------------------------------------------------------------------
# The run


async def phase(url: str, n_requests: int, clients: int, rng: random.Random, max_tokens: int,
                deadline: float, record: dict[str, Any]) -> None:
    """`clients` workers send `n_requests` requests between them (fewer if the deadline comes)."""
    kinds, weights = list(MIX), list(MIX.values())
    plan = [(rng.choices(kinds, weights)[0], random.Random(rng.random())) for _ in range(n_requests)]
    next_i = 0
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal next_i
        while next_i < len(plan) and time.monotonic() < deadline:
            kind, r = plan[next_i]
            next_i += 1
            t0 = time.perf_counter()
            try:
                outcome, detail = await send(http, kind, r, max_tokens)
            except (httpx.HTTPError, OSError) as e:  # a transport error or a timeout: lost
                outcome, detail = "error", f"{kind}: {type(e).__name__}: {e}"
            dt = time.perf_counter() - t0
            record["sent"] += 1
            by = record["by_kind"].setdefault(kind, {})
            by[outcome] = by.get(outcome, 0) + 1
            record["outcomes"][outcome] = record["outcomes"].get(outcome, 0) + 1
            if outcome == "ok":
                record["latency_s"].append(dt)
            elif outcome == "error":
                record["errors"].append(detail)

    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as http:
        await asyncio.gather(*[worker(http) for _ in range(clients)])


def settle(url: str, timeout: float = 20) -> dict[str, float]:
    """The server's metrics once every row is free again (abandoned requests dropped, nothing
    waits), or after `timeout`."""
    t0 = time.monotonic()
    while True:
        m = parse_metrics(httpx.get(url + "/metrics").text)
        if m["eagle:num_requests_running"] == 0 and m["eagle:num_requests_waiting"] == 0:
            return m
        if time.monotonic() - t0 > timeout:
            return m
        time.sleep(0.2)


def new_record() -> dict[str, Any]:
    return {"sent": 0, "outcomes": {}, "by_kind": {}, "latency_s": [], "errors": []}


def run_soak(requests: int = 400, clients: int = 32, max_tokens: int = 8, algorithm: str = "EAGLE3",
             max_seconds: float = 150.0, seed: int = 0, log_dir: Path | None = None,
             server_args: list[str] | None = None) -> dict[str, Any]:
    """Start a server, soak it, stop it; returns the report (see the module's doc)."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="soak-"))
    flags = ["--dtype", "fp32", "--context-length", "512", "--max-running-requests", "8",
             "--api-key", API_KEY, "--speculative-algorithm", algorithm] + (server_args or [])
    srv = ServerProcess(flags, log_dir / "soak_server.log", env={"OMP_NUM_THREADS": "1"})
    t_start = time.monotonic()
    try:
        srv.wait_ready()
        rng = random.Random(seed)
        deadline = time.monotonic() + max_seconds
        warm = new_record()
        asyncio.run(phase(srv.url, 2 * clients, clients, rng, max_tokens, deadline, warm))
        m0 = settle(srv.url)
        rss_warm = rss_mb(srv.proc.pid)
        main = new_record()
        t0 = time.monotonic()
        asyncio.run(phase(srv.url, requests, clients, rng, max_tokens, deadline, main))
        wall = time.monotonic() - t0
        m1 = settle(srv.url)
        settled = m1["eagle:num_requests_running"] == 0 and m1["eagle:num_requests_waiting"] == 0
        rss_end = rss_mb(srv.proc.pid)
        healthy = httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop(30)
    log = srv.log.read_text() if srv.log.is_file() else ""
    lat = main["latency_s"]
    errors = warm["errors"] + main["errors"]
    deltas = {k: v - m0.get(k, 0) for k, v in m1.items()
              if ("total" in k or k.endswith("_count")) and v != m0.get(k, 0)}
    return {
        "config": {"requests": requests, "clients": clients, "max_tokens": max_tokens, "algorithm": algorithm,
                   "max_seconds": max_seconds, "seed": seed, "mix": MIX, "server_flags": flags},
        "sent": main["sent"], "planned": requests, "warmup_sent": warm["sent"],
        "outcomes": main["outcomes"], "by_kind": main["by_kind"],
        # errors = 5xx + wrong 4xx + lost (no full answer: a transport error, a timeout, a cut answer)
        "errors": len(errors), "5xx": sum(e.startswith("HTTP 5") for e in errors),
        "wrong_4xx": sum(e.startswith("HTTP 4") for e in errors),
        "lost": sum(not e.startswith("HTTP ") for e in errors), "error_examples": errors[:10],
        "latency_s": {"p50": round(percentile(lat, 50), 4), "p99": round(percentile(lat, 99), 4),
                      "max": round(max(lat, default=float("nan")), 4), "n": len(lat)},
        "requests_per_s": round(main["sent"] / wall, 2), "wall_s": round(wall, 1),
        "total_s": round(time.monotonic() - t_start, 1),
        "rss_mb": {"after_warmup": round(rss_warm, 1), "end": round(rss_end, 1),
                   "growth": round((rss_end - rss_warm) / rss_warm, 4)},
        "settled": settled, "healthy_at_end": healthy, "server_tracebacks": log.count("Traceback"),
        "server_log": str(srv.log),
        "metrics_delta": deltas,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="requests after the warm-up")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8, help="upper bound of each request's max_tokens")
    ap.add_argument("--algorithm", default="EAGLE3", choices=["EAGLE3", "EAGLE", "NONE"],
                    help="EAGLE3: the shipped reference head; NONE: plain decoding")
    ap.add_argument("--max-seconds", type=float, default=300, help="stop sending after this long")
    ap.add_argument("--large", action="store_true", help="a longer run: 3000 requests, up to an hour")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(REPO / "results/soak_server.json"))
    ap.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeat)")
    args = ap.parse_args()
    if args.large:
        args.requests, args.max_seconds = max(args.requests, 3000), max(args.max_seconds, 3600)
    report = run_soak(args.requests, args.clients, args.max_tokens, args.algorithm, args.max_seconds,
                      args.seed, server_args=args.server_arg)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    keys = ("sent", "outcomes", "errors", "5xx", "lost", "latency_s", "rss_mb", "settled",
            "server_tracebacks", "wall_s")
    print(json.dumps({k: report[k] for k in keys}, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)
    ok = report["errors"] == 0 and report["rss_mb"]["growth"] < 0.10 and report["settled"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
