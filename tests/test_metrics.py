"""/metrics: prometheus_client exposition under vLLM's names (prefix `eagle:`), parsed with
prometheus_client's own parser, counters that move exactly as requests complete.

In-process (no server start-up): the app around a real engine, the default target in fp32 and
the shipped EAGLE-3 head on the CPU's default tree, driven through httpx's ASGI transport.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eagle_infer.metrics import Metrics

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"


def scrape(text: str) -> dict[str, float]:
    """{'name{label="v"}': value}, the model_name label checked and left out."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_each_app_has_its_own_registry():
    a, b = Metrics(3, MODEL), Metrics(3, MODEL)  # the same names twice in one process
    a.round([2, 0], 4)
    sa, sb = scrape(a.render().decode()), scrape(b.render().decode())
    assert sa["eagle:spec_decode_num_drafts_total"] == 2 and sb["eagle:spec_decode_num_drafts_total"] == 0
    assert sa['eagle:spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == 1
    assert sa['eagle:spec_decode_num_accepted_tokens_per_pos_total{position="2"}'] == 0
    assert sa["eagle:spec_decode_num_draft_tokens_total"] == 6
    assert sa['eagle:spec_decode_acceptance_length_bucket{le="1.0"}'] == 1
    assert sa["eagle:spec_decode_acceptance_length_sum"] == 4


def test_sglangs_internal_state_acceptance_and_throughput_windows():
    """avg_spec_accept_length: tokens committed per sequence and round (accepted + 1), from the
    start or forget_acceptance; last_gen_throughput: the tokens of the last full window of
    DECODE_LOG_INTERVAL rounds over their own seconds (plain rounds count; idle time does not)."""
    from eagle_infer.metrics import DECODE_LOG_INTERVAL

    m = Metrics(3, MODEL)
    assert m.avg_spec_accept_length() is None and m.last_gen_throughput == 0.0
    m.round([2, 0], 4, 0.5)
    assert m.avg_spec_accept_length() == 2.0
    m.round([], 2, 0.5)  # a round without drafts: no acceptance counted
    assert m.avg_spec_accept_length() == 2.0 and m.last_gen_throughput == 0.0
    for _ in range(DECODE_LOG_INTERVAL - 2):
        m.round([3], 4, 0.25)
    want = (4 + 2 + 4 * (DECODE_LOG_INTERVAL - 2)) / (1.0 + 0.25 * (DECODE_LOG_INTERVAL - 2))
    assert m.last_gen_throughput == pytest.approx(want)
    committed = 3 + 1 + 4 * (DECODE_LOG_INTERVAL - 2)  # 2 + 1 and 0 + 1, then 3 + 1 a round
    assert m.avg_spec_accept_length() == pytest.approx(committed / (2 + DECODE_LOG_INTERVAL - 2))
    m.forget_acceptance()
    assert m.avg_spec_accept_length() is None and m.last_gen_throughput == pytest.approx(want)
    for _ in range(DECODE_LOG_INTERVAL):
        m.round([0], 1, 0.5)
    assert m.last_gen_throughput == 2.0 and m.avg_spec_accept_length() == 1.0


@pytest.fixture(scope="module")
def app(default_model_fp32, default_model_dir):
    from eagle_infer.heads import load_head_for
    from eagle_infer.loader import load_tokenizer
    from eagle_infer.server import Engine, ServerConfig, create_app
    from eagle_infer.speculative import SpecDecoder
    from eagle_infer.tree import TreeConfig

    tree = TreeConfig.default_for("cpu")
    head = load_head_for(REPO / "heads/SmolLM2-135M-Instruct-eagle3", default_model_fp32)
    decoder = SpecDecoder(default_model_fp32, head, tree, max_batch=4, max_seq_len=512)
    depth = tree.max_depth
    engine = Engine(decoder, load_tokenizer(default_model_dir), Metrics(depth, MODEL), speculative=True)
    tok = load_tokenizer(default_model_dir)
    eos = set(default_model_fp32.config.eos_token_ids) | {tok.eos_token_id}
    app = create_app(engine, tok, eos, ServerConfig([MODEL], None, 400, default_model_fp32.config.vocab_size))
    engine.start()
    try:
        yield app, depth
    finally:
        engine.stop()


REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colors."}],
                              "max_tokens": 12}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a haiku."}], "max_tokens": 16,
                              "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 10}),
    ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 16, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8,
                              "temperature": 0.8, "seed": 1}),
]


def usage_of(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    if r.headers["content-type"].startswith("text/event-stream"):
        data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        return json.loads(data[-2])["usage"]
    return r.json()["usage"]


def test_counters_move_as_requests_complete(app):
    app, depth = app

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as http:
            r = await http.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            before = scrape(r.text)
            responses = await asyncio.gather(*[http.post(url, json={"temperature": 0} | body)
                                               for url, body in REQUESTS])
            bad = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
            after = scrape((await http.get("/metrics")).text)
        return before, [usage_of(r) for r in responses], bad, after

    before, usages, bad, m = asyncio.run(go())
    assert bad.status_code == 400
    d = {k: v - before.get(k, 0) for k, v in m.items()}
    n = len(REQUESTS)
    assert d['eagle:http_requests_total{status="200"}'] == n
    assert d['eagle:http_requests_total{status="400"}'] == 1
    assert d['eagle:request_success_total{finished_reason="stop"}'] + d[
        'eagle:request_success_total{finished_reason="length"}'] == n
    assert d['eagle:request_success_total{finished_reason="abort"}'] == 0
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert d[f"eagle:{hist}_count"] == n and d[f"eagle:{hist}_sum"] > 0
    assert d["eagle:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert d["eagle:generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    # Speculative counters agree with the requests' own statistics.
    drafts = sum(u["speculative"]["rounds"] for u in usages)
    accepted = sum(u["speculative"]["accepted_tokens"] for u in usages)
    assert d["eagle:spec_decode_num_drafts_total"] == drafts > 0
    assert d["eagle:spec_decode_num_accepted_tokens_total"] == accepted > 0  # the shipped head accepts
    assert d["eagle:spec_decode_num_draft_tokens_total"] == depth * drafts >= accepted
    per_pos = [d[f'eagle:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}']
               for p in range(depth)]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted, per_pos
    assert d["eagle:spec_decode_acceptance_length_count"] == drafts
    assert d["eagle:spec_decode_acceptance_length_sum"] == drafts + accepted
    assert d["eagle:inter_token_latency_seconds_count"] == drafts  # one per request and round
    assert d["eagle:engine_steps_total"] <= drafts  # requests shared rounds
    assert m["eagle:num_requests_running"] == 0 and m["eagle:num_requests_waiting"] == 0
