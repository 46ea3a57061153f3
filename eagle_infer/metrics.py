"""The server's Prometheus metrics, through prometheus_client, named as vLLM names them under
our prefix `eagle:` (so vLLM dashboards work with s/vllm:/eagle:/), every one with a
`model_name` label.

Speculative decoding (counted per sequence and round, as vLLM counts per request and step):
    eagle:spec_decode_num_drafts_total             drafts verified
    eagle:spec_decode_num_draft_tokens_total       draft positions that could be accepted: the
                                                   tree's depth per draft (a chain's length)
    eagle:spec_decode_num_accepted_tokens_total    draft tokens accepted
    eagle:spec_decode_num_accepted_tokens_per_pos_total{position}   accepted at depth position+1
    eagle:spec_decode_acceptance_length            histogram of tokens committed per round (tau)
Requests: eagle:num_requests_running / _waiting (gauges), eagle:prompt_tokens_total,
eagle:generation_tokens_total, eagle:request_success_total{finished_reason},
eagle:time_to_first_token_seconds, eagle:inter_token_latency_seconds (per request and round, as
vLLM's V1 engine observes it per step), eagle:e2e_request_latency_seconds; ours:
eagle:engine_steps_total (rounds of the whole batch), eagle:http_requests_total{status}.

Beside them, what SGLang's /get_server_info reports as its internal state: the acceptance
length since the start or the last /flush_cache (`spec_accept_tokens / spec_verify_ct`), and
`last_gen_throughput`, tokens a second over the last DECODE_LOG_INTERVAL rounds (their own time).

Each Metrics has its own CollectorRegistry: several apps (tests) live in one process.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's buckets (vllm/v1/metrics/loggers.py), so the histograms compare bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED = ("stop", "length", "abort")
DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval: the rounds a last_gen_throughput covers


class Metrics:
    """What the engine thread and the handlers record; `render()` is the /metrics body.

    `depth` is the number of draft positions a round can accept (min(num_steps,
    num_draft_tokens - 1)); 0 for plain decoding.
    """

    def __init__(self, depth: int, model_name: str = "default"):
        self.depth, self.model_name = depth, model_name
        self.registry = r = CollectorRegistry(auto_describe=True)
        m = ["model_name"]
        self._running = Gauge("eagle:num_requests_running", "Requests in the decode batch.", m, registry=r)
        self._waiting = Gauge("eagle:num_requests_waiting", "Requests waiting for a free row.", m,
                              registry=r)
        self._prompt = Counter("eagle:prompt_tokens", "Prompt tokens prefilled.", m, registry=r)
        self._gen = Counter("eagle:generation_tokens", "Tokens generated.", m, registry=r)
        self._success = Counter("eagle:request_success", "Requests finished, by finish reason.",
                                m + ["finished_reason"], registry=r)
        self._ttft = Histogram("eagle:time_to_first_token_seconds", "Arrival to first token.", m,
                               buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram("eagle:inter_token_latency_seconds",
                              "Time between a request's rounds (a speculative round emits 1+ tokens).",
                              m, buckets=ITL_BUCKETS, registry=r)
        self._e2e = Histogram("eagle:e2e_request_latency_seconds", "Arrival to the last token.", m,
                              buckets=E2E_BUCKETS, registry=r)
        self._pc_queries = Counter("eagle:prefix_cache_queries",
                                   "Prompt tokens looked up in the prefix cache.", m, registry=r)
        self._pc_hits = Counter("eagle:prefix_cache_hits",
                                "Prompt tokens whose cache slots were taken over, not prefilled.", m,
                                registry=r)
        self._steps = Counter("eagle:engine_steps", "Decode rounds of the whole batch.", m, registry=r)
        self._http = Counter("eagle:http_requests", "API responses by HTTP status (499: client left first).",
                             m + ["status"], registry=r)
        self._drafts = Counter("eagle:spec_decode_num_drafts", "Drafts verified (per sequence and round).", m,
                               registry=r)
        self._draft_tokens = Counter("eagle:spec_decode_num_draft_tokens",
                                     "Draft positions that could be accepted (the tree's depth per draft).",
                                     m, registry=r)
        self._accepted = Counter("eagle:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m,
                                 registry=r)
        self._per_pos = Counter("eagle:spec_decode_num_accepted_tokens_per_pos",
                                "Drafts whose token at this position (0 = first) was accepted.",
                                m + ["position"], registry=r)
        self._tau = Histogram("eagle:spec_decode_acceptance_length",
                              "Tokens committed per speculative round and sequence (accepted drafts + 1).",
                              m, buckets=[k + 1 for k in range(depth + 1)] if depth else [1], registry=r)
        name = model_name
        self.running, self.waiting = self._running.labels(name), self._waiting.labels(name)
        self.prompt_tokens, self.generation_tokens = self._prompt.labels(name), self._gen.labels(name)
        self.ttft, self.itl = self._ttft.labels(name), self._itl.labels(name)
        self.e2e = self._e2e.labels(name)
        self.engine_steps = self._steps.labels(name)
        self.prefix_cache_queries = self._pc_queries.labels(name)
        self.prefix_cache_hits = self._pc_hits.labels(name)
        self.success = {reason: self._success.labels(name, reason) for reason in FINISHED}
        # Children made up front, so every series is there (at 0) from the first scrape.
        self.per_pos = [self._per_pos.labels(name, str(d)) for d in range(depth)]
        self.drafts, self.draft_tokens = self._drafts.labels(name), self._draft_tokens.labels(name)
        self.accepted, self.tau = self._accepted.labels(name), self._tau.labels(name)
        for status in ("200", "400"):
            self._http.labels(name, status)
        self._lock = threading.Lock()  # finish() is called from two threads and must count once
        # SGLang's internal state (the engine thread writes, /get_server_info reads)
        self.spec_accept_tokens = self.spec_verify_ct = 0  # since the start or the last flush
        self.last_gen_throughput = 0.0
        self._window = [0, 0, 0.0]  # rounds, tokens, seconds of the current window

    def http_response(self, status: int) -> None:
        self._http.labels(self.model_name, str(status)).inc()

    def round(self, accepted: list[int], tokens: int, seconds: float = 0.0) -> None:
        """One engine step: `accepted` drafts per sequence (empty for plain decoding), `tokens`
        emitted, in `seconds`."""
        self.engine_steps.inc()
        self.generation_tokens.inc(tokens)
        w = self._window
        w[0], w[1], w[2] = w[0] + 1, w[1] + tokens, w[2] + seconds
        if w[0] == DECODE_LOG_INTERVAL:
            self.last_gen_throughput = w[1] / w[2] if w[2] > 0 else 0.0
            self._window = [0, 0, 0.0]
        if not self.depth or not accepted:
            return
        self.spec_verify_ct += len(accepted)
        self.spec_accept_tokens += sum(accepted) + len(accepted)
        self.drafts.inc(len(accepted))
        self.draft_tokens.inc(self.depth * len(accepted))
        self.accepted.inc(sum(accepted))
        for k in accepted:
            k = min(k, self.depth)
            self.tau.observe(k + 1)
            for d in range(k):
                self.per_pos[d].inc()

    def avg_spec_accept_length(self) -> float | None:
        """Tokens a speculative round committed per sequence since the start or the last
        /flush_cache (SGLang's avg_spec_accept_length); None before any."""
        return self.spec_accept_tokens / self.spec_verify_ct if self.spec_verify_ct else None

    def forget_acceptance(self) -> None:
        """/flush_cache's: SGLang's acceptance counters start again (a benchmark's run reads its own)."""
        self.spec_accept_tokens = self.spec_verify_ct = 0

    def finish(self, job, reason: str, now: float) -> None:
        """A request ended (stop / length / abort): once per request, whichever thread is first."""
        with self._lock:
            if job.recorded:
                return
            job.recorded = True
        self.success[reason if reason in self.success else "abort"].inc()
        self.e2e.observe(now - job.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v"}': value}, the model_name label left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out
