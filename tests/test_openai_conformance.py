"""OpenAI conformance of the server with the SHIPPED heads, through the `openai` client.

Three servers in fp32 (started side by side, once for the module): plain decoding, the
reference EAGLE-3 head and the reference EAGLE-2 head, all on the CPU's default tree. Greedy
speculative output must equal plain output token for token through the API (also streamed),
stop strings that straddle the tokens of one speculative round must stop it right there, and
`logprobs` must be the raw target log-probabilities of the emitted tokens (a plain forward's
log_softmax) for speculative rounds too, greedy and sampled. Invalid requests answer 400 in
OpenAI's error shape; streamed chunks carry `"usage": null` with include_usage.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from eagle_infer.generate import chat_prompt_ids
from eagle_infer.launch import ServerProcess

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
# Eager steps (--disable-torch-compile): what these servers check is the API, and compiling at
# start-up would add minutes on one thread (the compiled path: test_static_shapes, test_server).
# Rounds draft at every batch size here (a CPU's default stops above 2 running requests).
COMMON = ["--dtype", "fp32", "--context-length", "512", "--max-running-requests", "4",
          "--disable-torch-compile", "--speculative-disable-by-batch-size", "4"]
FLAGS = {
    "plain": ["--speculative-algorithm", "NONE"],
    "eagle3": ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
               str(REPO / "heads/SmolLM2-135M-Instruct-eagle3")],
    "eagle2": ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
               str(REPO / "heads/SmolLM2-135M-Instruct-eagle2")],
}
CHATS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea."]
COMPLETION = "def fibonacci(n):"
MAX_TOKENS = 32
LOGPROB_TOL = 1e-4  # fp32: a tree-masked verify forward vs a plain causal one


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conformance")
    procs = {name: ServerProcess(COMMON + flags, tmp / f"{name}.log", env={"OMP_NUM_THREADS": "1"})
             for name, flags in FLAGS.items()}
    try:
        for srv in procs.values():
            try:
                srv.wait_ready()
            except RuntimeError as e:
                pytest.fail(str(e))
        yield procs
    finally:
        for srv in procs.values():
            srv.stop(20)
    for name, srv in procs.items():
        assert "Traceback" not in srv.log.read_text(), (name, srv.log_tail())


@pytest.fixture(scope="module")
def clients(servers) -> dict[str, openai.OpenAI]:
    return {name: openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
            for name, srv in servers.items()}


def chat(client: openai.OpenAI, content: str, stream: bool = False, **kw) -> dict:
    """One chat request -> {"text", "finish", "usage", "logprobs" (a list of content entries)}."""
    kw = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
          "temperature": 0} | kw
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        return {"text": c.message.content, "finish": c.finish_reason, "usage": r.usage,
                "logprobs": c.logprobs.content if c.logprobs else None}
    out = {"text": "", "finish": None, "usage": None, "logprobs": None}
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        out["usage"] = ch.usage or out["usage"]
        for c in ch.choices:
            out["text"] += c.delta.content or ""
            out["finish"] = c.finish_reason or out["finish"]
            if c.logprobs:
                out["logprobs"] = (out["logprobs"] or []) + c.logprobs.content
    return out


def complete(client: openai.OpenAI, prompt, stream: bool = False, **kw) -> dict:
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0} | kw
    if not stream:
        r = client.completions.create(**kw)
        c = r.choices[0]
        return {"text": c.text, "finish": c.finish_reason, "usage": r.usage, "logprobs": c.logprobs}
    out = {"text": "", "finish": None, "usage": None, "logprobs": None}
    for ch in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        out["usage"] = ch.usage or out["usage"]
        for c in ch.choices:
            out["text"] += c.text
            out["finish"] = c.finish_reason or out["finish"]
            if c.logprobs is not None:  # the chunks' lists, joined
                lp = out["logprobs"] = out["logprobs"] or {"tokens": [], "token_logprobs": [],
                                                           "text_offset": []}
                for k in lp:
                    lp[k] += getattr(c.logprobs, k)
    return out


def respond(client: openai.OpenAI, content: str, stream: bool = False) -> dict:
    """chat's, through the Responses API (/v1/responses; streamed: the client's stream helper)."""
    kw = {"model": MODEL, "input": content, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        with client.responses.stream(**kw) as events:
            for _ in events:
                pass
            r = events.get_final_response()
    else:
        r = client.responses.create(**kw)
    return {"text": r.output_text, "finish": "length" if r.status == "incomplete" else "stop",
            "usage": SimpleNamespace(completion_tokens=r.usage.output_tokens)}


def in_parallel(calls: dict) -> dict:
    """{key: zero-argument call} -> {key: result}, all in flight at once (servers batch them)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {k: pool.submit(f) for k, f in calls.items()}
        return {k: f.result() for k, f in futures.items()}


def test_speculative_output_equals_plain_output_through_the_api(clients):
    calls = {}
    for name in ("plain", "eagle3", "eagle2"):
        c = clients[name]
        for i, q in enumerate(CHATS):
            calls[name, "chat", i] = lambda c=c, q=q: chat(c, q)
        calls[name, "completion", 0] = lambda c=c: complete(c, COMPLETION)
    for i, q in enumerate(CHATS):  # streamed too
        calls["eagle3", "chat-stream", i] = lambda q=q: chat(clients["eagle3"], q, stream=True)
    calls["eagle3", "completion-stream", 0] = lambda: complete(clients["eagle3"], COMPLETION, stream=True)
    for i, q in enumerate(CHATS):  # the Responses API's answers are the chat answers
        calls["eagle3", "chat-responses", i] = lambda q=q: respond(clients["eagle3"], q)
        calls["eagle3", "chat-responses-stream", i] = lambda q=q: respond(clients["eagle3"], q, stream=True)
    got = in_parallel(calls)
    for (name, kind, i), r in got.items():
        ref = got["plain", kind.split("-")[0], i]
        assert (r["text"], r["finish"]) == (ref["text"], ref["finish"]), (name, kind, i)
        assert r["usage"].completion_tokens == ref["usage"].completion_tokens
        assert r["text"] and r["finish"] in ("stop", "length")
    # The shipped heads really speculate (a random head accepts ~nothing): tau > 1.25 here.
    for name in ("eagle3", "eagle2"):
        spec = [got[name, "chat", i]["usage"].model_extra["speculative"] for i in range(len(CHATS))]
        rounds, acc = sum(s["rounds"] for s in spec), sum(s["accepted_tokens"] for s in spec)
        assert acc / rounds > 0.25, (name, spec)


def test_stop_strings_straddling_a_round_stop_it_there(clients):
    # Tokens and their text come from the logprobs (plain decoding, greedy).
    ref = chat(clients["plain"], CHATS[1], logprobs=True)
    pieces = [e.token for e in ref["logprobs"]][: None if ref["finish"] == "length" else -1]  # no EOS
    assert "".join(pieces) == ref["text"]
    # Stop strings across a token boundary (the last character of token i + the first of i+1),
    # first occurring there: the output ends before it, after token i+1, on every server.
    cases = []
    for i in range(3, len(pieces) - 2):
        a, b = pieces[i].rstrip(), pieces[i + 1]
        start = len("".join(pieces[:i])) + len(a) - 1
        if not a or not b.strip() or a != pieces[i]:
            continue
        stop = a[-1] + b[0]
        if ref["text"].find(stop) == start:
            cases.append((stop, ref["text"][:start], i + 2))
        if len(cases) == 3:
            break
    assert cases, pieces
    calls = {}
    for name in ("plain", "eagle3"):
        for stop, _, _ in cases:
            calls[name, stop, False] = lambda c=clients[name], s=stop: chat(c, CHATS[1], stop=[s, "@@@"])
            calls[name, stop, True] = lambda c=clients[name], s=stop: chat(c, CHATS[1], stream=True, stop=s)
    got = in_parallel(calls)
    for stop, text, n_tokens in cases:
        for name in ("plain", "eagle3"):
            for stream in (False, True):
                r = got[name, stop, stream]
                assert (r["text"], r["finish"]) == (text, "stop"), (name, stop, stream, r["text"])
                # The sequence stopped at the token that completed the stop string, even inside
                # a speculative round that had accepted more.
                assert r["usage"].completion_tokens == n_tokens, (name, stop, stream)


@pytest.fixture(scope="module")
def reference_logprobs(hf_default_fp32):
    """(prompt ids, output ids) -> log_softmax of a plain forward at each output position [T, V]."""

    @torch.no_grad()
    def get(prompt: list[int], output: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + output])
        logits = hf_default_fp32(ids).logits[0].float()
        return torch.log_softmax(logits[len(prompt) - 1: -1], -1)

    return get


def test_logprobs_are_the_raw_target_log_probabilities(servers, clients, tokenizer, reference_logprobs):
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": CHATS[1]}])
    ids = {"return_tokens_as_token_ids": True}
    got = in_parallel({
        "greedy": lambda: chat(clients["eagle3"], CHATS[1], logprobs=True, top_logprobs=5, extra_body=ids),
        "stream": lambda: chat(clients["eagle3"], CHATS[1], stream=True, logprobs=True, top_logprobs=5),
        # Sampled (rejection sampling in the rounds): still the raw distribution, no temperature.
        "sampled": lambda: chat(clients["eagle3"], CHATS[1], logprobs=True, top_logprobs=2, temperature=0.9,
                                seed=3, extra_body=ids),
        "eagle2": lambda: chat(clients["eagle2"], CHATS[1], logprobs=True, top_logprobs=1, extra_body=ids),
        "plain": lambda: chat(clients["plain"], CHATS[1], logprobs=True, extra_body=ids),
        "completion": lambda: complete(clients["eagle3"], prompt, logprobs=3, extra_body=ids),
        "completion-text": lambda: complete(clients["eagle3"], COMPLETION, logprobs=2),
        "completion-stream": lambda: complete(clients["eagle3"], COMPLETION, stream=True, logprobs=2),
        # SGLang's /generate on the same prompt ids: its answers and log-probs are the completion's
        "generate": lambda: httpx.post(servers["eagle3"].url + "/generate", timeout=300, json={
            "input_ids": prompt, "return_logprob": True, "top_logprobs_num": 3,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS}}).json(),
    })
    for key in ("greedy", "sampled", "eagle2", "plain"):
        entries = got[key]["logprobs"]
        out = [int(e.token.removeprefix("token_id:")) for e in entries]
        assert len(out) == got[key]["usage"].completion_tokens
        assert tokenizer.decode(out, skip_special_tokens=True) == got[key]["text"]
        ref = reference_logprobs(prompt, out)
        lp = torch.tensor([e.logprob for e in entries])
        torch.testing.assert_close(lp, ref[torch.arange(len(out)), out], atol=LOGPROB_TOL, rtol=0)
        k = len(entries[0].top_logprobs)
        top = ref.topk(k, -1)
        torch.testing.assert_close(torch.tensor([[t.logprob for t in e.top_logprobs] for e in entries]),
                                   top.values, atol=LOGPROB_TOL, rtol=0)
        assert all(e.logprob <= e.top_logprobs[0].logprob + LOGPROB_TOL for e in entries if k)
        if key != "sampled":  # greedy: the emitted token is the most likely one
            assert [int(e.top_logprobs[0].token.removeprefix("token_id:")) for e in entries if k] == (
                out if k else [])
    assert got["greedy"]["text"] == got["plain"]["text"]
    # Same tokens; the numbers agree to float noise (the two requests may share a batch differently).
    assert [e.token for e in got["stream"]["logprobs"]] == [
        tokenizer.decode([int(e.token[9:])]) for e in got["greedy"]["logprobs"]]
    assert [e.logprob for e in got["stream"]["logprobs"]] == pytest.approx(
        [e.logprob for e in got["greedy"]["logprobs"]], abs=LOGPROB_TOL)
    first_alt = [int(e.top_logprobs[0].token[9:]) for e in got["greedy"]["logprobs"]]
    assert [e.top_logprobs[0].bytes for e in got["stream"]["logprobs"]] == [
        list(tokenizer.decode([t]).encode()) for t in first_alt]
    # SGLang's /generate: the same tokens and log-probs ([logprob, id, text]); verify passes counted
    gen, greedy_ids = got["generate"], [int(e.token[9:]) for e in got["greedy"]["logprobs"]]
    assert gen["output_ids"] == greedy_ids and gen["text"] == got["greedy"]["text"]
    meta = gen["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == greedy_ids
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(
        [e.logprob for e in got["greedy"]["logprobs"]], abs=LOGPROB_TOL)
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    assert 0 < meta["spec_verify_ct"] < meta["completion_tokens"] == len(greedy_ids)
    # Completions: the legacy shape (tokens, token_logprobs, top_logprobs as {token: lp}, text_offset).
    c = got["completion"]["logprobs"]
    assert c.token_logprobs == pytest.approx([e.logprob for e in got["greedy"]["logprobs"]], abs=LOGPROB_TOL)
    assert all(len(t) == 3 for t in c.top_logprobs)
    c = got["completion-text"]["logprobs"]
    tokens = c.tokens[: None if got["completion-text"]["finish"] == "length" else -1]  # no EOS
    assert "".join(tokens) == got["completion-text"]["text"]
    assert c.text_offset == [sum(len(t) for t in c.tokens[:i]) for i in range(len(c.tokens))]
    # Streamed, each chunk's text_offset counts from the start of the completion, not of the chunk.
    s = got["completion-stream"]["logprobs"]
    assert s["tokens"] == c.tokens and s["text_offset"] == c.text_offset
    assert s["token_logprobs"] == pytest.approx(c.token_logprobs, abs=LOGPROB_TOL)


def test_invalid_requests_answer_400_in_openai_shape_and_usage_null_in_chunks(servers, clients):
    client = clients["eagle3"]
    msgs = [{"role": "user", "content": "Hi"}]
    bad = [dict(logprobs=True, top_logprobs=21), dict(top_logprobs=2), dict(max_tokens="3"),
           dict(messages=[{"role": "user", "content": "word " * 600}]), dict(logprobs="yes"), dict(n=0)]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**({"model": MODEL, "messages": msgs, "max_tokens": 4} | kw))
        err = e.value.body
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error" and err["message"], err
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", logprobs=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=msgs)
    # Streamed with include_usage: every chunk has "usage": null but the last, which has the usage.
    body = {"model": MODEL, "messages": msgs, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(servers["eagle3"].url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
