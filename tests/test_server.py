"""The OpenAI-compatible server: API shape, continuous batching, bad input, disconnects, SIGTERM.

Most tests share one server subprocess: the default target in fp32 with a random-initialised
EAGLE-3 head (acceptance ~ 0, but the output must still be exact) and a small draft tree so the
loaded CI machine gets through the load test quickly. Engine faults are injected in-process
through a fake decoder; the plain decoder is checked against `generate` on a tiny model.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from script_module import load_script

from eagle_infer.generate import generate
from eagle_infer.launch import ServerProcess
from eagle_infer.metrics import parse_metrics
from eagle_infer.model import ModelConfig, Transformer
from eagle_infer.sampling import SamplingParams
from eagle_infer.server import bad_words_ids
from eagle_infer.speculative import Sequence_, SpecStats
from eagle_infer.tree import TreeConfig

API_KEY = "test-key"
TOOLS_TEMPLATE = Path(__file__).resolve().parents[1] / "conf" / "chat_templates" / "smollm2_tools.jinja"
MODEL = "SmolLM2-135M-Instruct"
# A small tree (still branching) keeps rounds cheap on a busy CPU; eager steps, since compiling
# them at start-up would add minutes on one thread (the compiled path: test_compile_flags_*,
# test_warm_up_*, test_static_shapes); rounds draft at every batch size (a CPU's default stops
# above 2 running requests: test_large_batches_run_plain_rounds_* in test_speculative).
SERVER_FLAGS = ["--dtype", "fp32", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "2",
                "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "3",
                "--context-length", "512", "--max-running-requests", "8", "--api-key", API_KEY,
                "--disable-torch-compile", "--speculative-disable-by-batch-size", "8",
                # tools: the shipped template is SmolLM2's own without them (test_tool_calls.py)
                "--chat-template", str(TOOLS_TEMPLATE), "--enable-auto-tool-choice",
                "--tool-call-parser", "hermes"]


# ---------------------------------------------------------------------------------------
# The shared server


def random_eagle3_head(model_dir: Path, out: Path) -> Path:
    from eagle_infer.heads import DraftHead, HeadConfig, save_head
    from eagle_infer.loader import read_hf_config
    from eagle_infer.model import ModelConfig

    target_cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    cfg = HeadConfig.for_target(target_cfg, "eagle3", draft_vocab_size=2048)
    head = DraftHead(cfg, torch.nn.Embedding(1, 1))  # the embedding is the target's, not saved
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        head.d2t.zero_()  # draft id i is target id i
        head.t2d.zero_()
        head.t2d[:2048] = True
    return save_head(head, out)


class Server(ServerProcess):
    """The shared server, one thread (the CI machine is busy), failures as test failures."""

    def __init__(self, args: list[str], log: Path):
        super().__init__(args, log, env={"OMP_NUM_THREADS": "1"})

    def wait_ready(self, timeout: float = 240) -> float:
        try:
            return super().wait_ready(timeout)
        except RuntimeError as e:
            pytest.fail(str(e))

    def stop(self, grace: float = 20) -> None:
        super().stop(grace)


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    head = random_eagle3_head(default_model_dir, tmp / "head")
    srv = Server(SERVER_FLAGS + ["--speculative-draft-model-path", str(head)], tmp / "server.log")
    srv.head = head
    try:
        launched = time.time()
        # the seconds from the process's launch to its first healthy answer (bench_server's startup_s)
        assert 0 < srv.wait_ready() <= time.time() - launched + 1
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)


def chat(client, content: str, max_tokens: int, stream: bool = False, system: str | None = None,
         **kw) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of one greedy chat request."""
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": content})
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens,
                                           temperature=0, **kw)
        assert r.object == "chat.completion"
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    text, finish, usage = "", None, None
    for c in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, **kw):
        assert c.object == "chat.completion.chunk"
        if c.usage:
            usage = c.usage
        for ch in c.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish, usage


def complete(client, prompt: str, max_tokens: int, stream: bool = False, **kw) -> tuple[str, str, object]:
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
        assert r.object == "text_completion"
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    text, finish, usage = "", None, None
    for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, **kw):
        if c.usage:
            usage = c.usage
        for ch in c.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    return text, finish, usage


# ---------------------------------------------------------------------------------------
# API shape


def test_chat_and_completions_plain_and_streaming(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    text, finish, usage = chat(client, "Name three colors.", 8)
    assert text and finish in ("stop", "length")
    assert usage.completion_tokens <= 8 and usage.prompt_tokens > 10
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculative"]  # per-request statistics, tolerated by the client
    assert spec["rounds"] >= 1 and spec["acceptance_length"] >= 1.0
    assert chat(client, "Name three colors.", 8, stream=True)[:2] == (text, finish)

    text, finish, usage = complete(client, "The capital of France is", 8)
    assert finish == "length" and usage.completion_tokens == 8
    assert complete(client, "The capital of France is", 8, stream=True)[:2] == (text, finish)

    # A stop string ends the output and is cut, streaming or not.
    words = text.split()
    assert len(words) >= 2, text
    stop = words[1]
    expected = text[: text.index(stop)]
    for stream in (False, True):
        t, f, _ = complete(client, "The capital of France is", 8, stream=stream, stop=[stop, "zzzz"])
        assert (t, f) == (expected, "stop")


# ---------------------------------------------------------------------------------------
# Bad input


def test_bad_requests_get_openai_errors_and_the_server_survives(server, client):
    url = server.url + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    msgs = [{"role": "user", "content": "Hi"}]
    cases = [
        (b"{not json", auth, 400, "invalid_json"),
        (b"[1, 2]", auth, 400, "invalid_json"),
        ({"model": MODEL}, auth, 400, "missing_field"),
        ({"messages": "Hi"}, auth, 400, "invalid_type"),
        ({"messages": msgs, "max_tokens": "8"}, auth, 400, "invalid_type"),
        ({"messages": [{"role": "user"}]}, auth, 400, "missing_field"),
        ({"messages": msgs, "model": "gpt-4"}, auth, 404, "model_not_found"),
        ({"messages": msgs, "max_tokens": 0}, auth, 400, "invalid_value"),
        ({"messages": msgs, "max_tokens": -3}, auth, 400, "invalid_value"),
        ({"messages": msgs, "max_tokens": 10_000}, auth, 400, "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 4}, auth, 400,
         "context_length_exceeded"),
        ({"messages": msgs, "temperature": -0.5}, auth, 400, "invalid_value"),
        ({"messages": msgs, "top_p": 1.5}, auth, 400, "invalid_value"),
        ({"messages": msgs, "stop": [""]}, auth, 400, "invalid_value"),
        ({"messages": msgs, "seed": 2**70}, auth, 400, "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', auth, 400, "invalid_json"),
        ({"messages": msgs, "stop": 5}, auth, 400, "invalid_type"),
        ({"messages": msgs, "frequency_penalty": 2.5}, auth, 400, "invalid_value"),
        ({"messages": msgs, "repetition_penalty": 0}, auth, 400, "invalid_value"),
        ({"messages": msgs, "logit_bias": {"x1": 5}}, auth, 400, "invalid_value"),
        ({"messages": msgs, "logit_bias": {"\u00b2": 5}}, auth, 400, "invalid_value"),  # int() refuses it
        ({"messages": msgs, "logit_bias": {"5": 150}}, auth, 400, "invalid_value"),
        ({"messages": msgs, "logit_bias": {"999999": 1}}, auth, 400, "invalid_value"),
        ({"messages": msgs, "min_p": 1.5}, auth, 400, "invalid_value"),
        ({"messages": msgs, "best_of": 3}, auth, 400, "unsupported_parameter"),
        ({"messages": msgs, "max_tokens": 4, "min_tokens": 5}, auth, 400, "invalid_value"),
        ({"messages": msgs, "stop_token_ids": [-1]}, auth, 400, "invalid_value"),
        ({"messages": msgs, "tools": [{"type": "function"}]}, auth, 400, "missing_field"),
        ({"messages": msgs, "tools": []}, auth, 400, "invalid_value"),  # OpenAI's and vLLM's rule
        ({"messages": msgs, "tool_choice": "sometimes"}, auth, 400, "invalid_type"),
        ({"messages": msgs, "chat_template_kwargs": {"tokenize": False}}, auth, 400, "invalid_value"),
        ({"messages": msgs, "continue_final_message": True}, auth, 400, "invalid_value"),  # and a new turn
        ({"messages": msgs, "n": 0}, auth, 400, "invalid_value"),
        ({"messages": msgs, "echo": True}, auth, 400, "unsupported_parameter"),  # chat's echo is another
        ({"messages": msgs, "prompt_logprobs": 21}, auth, 400, "invalid_value"),
        ({"messages": msgs, "prompt_logprobs": 1, "stream": True}, auth, 400, "unsupported_parameter"),
        ({"messages": msgs, "n": 129}, auth, 400, "invalid_value"),
        ({"messages": msgs, "n": 2, "seed": 2**64 - 1}, auth, 400, "invalid_value"),  # seed + 1 overflows
        ({"messages": msgs}, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
        ({"messages": msgs}, {}, 401, "invalid_api_key"),
    ]
    with httpx.Client(timeout=60) as http:
        for body, headers, status, code in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(url, content=content, headers=headers | {"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            assert err["code"] == code, (body, err)
        # fields this server does not implement: named, unless they ask for nothing (clients send those)
        functions = [{"name": "f"}]  # the legacy form of tools
        r = http.post(url, json={"messages": msgs, "max_tokens": 2, "functions": functions}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "functions", r.text
        noop = {"min_p": 0, "best_of": 1, "echo": False, "response_format": {"type": "text"}, "functions": []}
        r = http.post(url, json={"messages": msgs, "max_tokens": 2, **noop}, headers=auth)
        assert r.status_code == 200, r.text
        r = http.post(server.url + "/v1/completions", json={"prompt": "", "max_tokens": 4}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = http.post(server.url + "/v1/completions", json={"prompt": [10**9]}, headers=auth)
        assert r.status_code == 400
        # a batch of prompts: each is checked, and n x prompts has OpenAI's cap on n
        for prompt, n in ((["Hi", ""], 1), ([[5, 6], [10**9]], 1), (["Hi", "Ho"], 65)):
            r = http.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "n": n},
                          headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "n"), r.text
        assert http.get(server.url + "/v1/nowhere", headers=auth).status_code == 404
        assert http.get(url, headers=auth).status_code == 405
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=msgs, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=0, stream=True)
    # ... and a good request still succeeds.
    text, finish, _ = chat(client, "Hi", 3)
    assert finish in ("stop", "length")
    assert httpx.get(server.url + "/health").status_code == 200
    m = metrics(server)
    assert m['eagle:http_requests_total{status="401"}'] >= 3
    assert m['eagle:http_requests_total{status="400"}'] >= 16


def test_tokenize_and_detokenize_as_vllm(server, client, tokenizer):
    """vLLM's /tokenize (a prompt, or messages through the chat template: the tokens a chat request
    prompts with) and /detokenize; bad bodies get 400s, a bad key 401."""
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + path, json=body, headers=auth, timeout=60)

    text = "Speculative decoding, losslessly."
    out = post("/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    ids = list(tokenizer(text)["input_ids"])
    assert out["tokens"] == ids and out["count"] == len(ids)
    card = httpx.get(server.url + "/v1/models", headers=auth).json()["data"][0]
    assert out["max_model_len"] == card["max_model_len"]
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert post("/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    out = post("/tokenize", {"messages": msgs}).json()
    usage = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage
    assert out["count"] == usage.prompt_tokens and out["token_strs"] is None
    assert tokenizer.decode(out["tokens"]).rstrip().endswith("assistant")  # the generation prompt
    for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": "a", "messages": msgs}),
                       ("/tokenize", {"messages": []}), ("/detokenize", {"tokens": [-1]}),
                       ("/detokenize", {"tokens": "abc"})):
        r = post(path, body)
        assert r.status_code == 400 and r.json()["error"]["message"], (path, body)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "a"}, timeout=60).status_code == 401
    assert post("/tokenize", {"model": "nope", "prompt": "a"}).status_code == 404


def test_penalties_logit_bias_and_stop_tokens_answer_as_plain_decoding(server, client, default_model_fp32,
                                                                        tokenizer):
    """OpenAI's frequency and presence penalties, vLLM's repetition_penalty and logit_bias reach
    the decoder: the speculative server's greedy answer is plain greedy decoding's with the same
    settings (generate, in this process), not the answer without them; a +100 bias on one token
    makes it every token; stop_token_ids, min_tokens, bad_words and allowed_token_ids too."""
    prompt = "List the days of the week, then list them again:"
    ids = list(tokenizer(prompt)["input_ids"])
    text = complete(client, prompt, 24, frequency_penalty=1.0, presence_penalty=0.5,
                    extra_body={"repetition_penalty": 1.3})[0]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3)
    plain = generate(default_model_fp32, [ids], 24, params)[0]
    assert text == tokenizer.decode(plain, skip_special_tokens=True)
    assert text != complete(client, prompt, 24)[0]
    (token,) = tokenizer(" blue")["input_ids"]
    text, _, _ = chat(client, "Name a color.", 4, logit_bias={str(token): 100})
    assert text == tokenizer.decode([token] * 4)
    # stop_token_ids end the answer at that token (counted, its text left out, as vLLM 0.32 does);
    # min_tokens bars them until then
    free = generate(default_model_fp32, [ids], 24, SamplingParams())[0]
    stop = free[5]
    first = free.index(stop)
    text, finish, usage = complete(client, prompt, 24, extra_body={"stop_token_ids": [stop]})
    assert (text, finish, usage.completion_tokens) == (tokenizer.decode(free[:first]), "stop", first + 1)
    # vLLM's stop_reason: that token; in chat, a stop string (kept with include_stop_str_in_output)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].stop_reason == stop
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=24, temperature=0).choices[0].message.content
    word = answer.split()[3]
    for include in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=24, temperature=0, stop=[word],
                                           extra_body={"include_stop_str_in_output": include})
        choice = r.choices[0]
        cut = answer.index(word) + (len(word) if include else 0)
        assert (choice.message.content, choice.finish_reason) == (answer[:cut], "stop")
        assert choice.stop_reason == word
    ends, m = list(default_model_fp32.config.eos_token_ids) + [stop], first + 3
    later = generate(default_model_fp32, [ids], 24, SamplingParams(min_tokens=m), eos_token_ids=ends)[0]
    text, _, usage = complete(client, prompt, 24, extra_body={"stop_token_ids": [stop], "min_tokens": m})
    assert usage.completion_tokens == len(later) >= m
    assert text == tokenizer.decode(later[:-1] if later[-1] in ends else later)
    # vLLM's skip_special_tokens: false keeps a special token's text (here <|im_start|>, forced),
    # but never the EOS that ends the answer
    special, eos = tokenizer.convert_tokens_to_ids("<|im_start|>"), default_model_fp32.config.eos_token_ids[0]
    for skip, want in ((True, ""), (False, "<|im_start|>" * 3)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                      logit_bias={str(special): 100},
                                      extra_body={"skip_special_tokens": skip})
        assert r.choices[0].text == want, skip
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  logit_bias={str(eos): 100}, extra_body={"skip_special_tokens": False})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
    # vLLM's bad_words (a word of the free answer, barred as a text's start and mid-text) and
    # allowed_token_ids (the free answer's tokens but its first)
    word = tokenizer.decode(free[:3]).split()[-1]
    barred = bad_words_ids(tokenizer, [word])
    assert len(barred) == 2 and barred[1] == tokenizer(" " + word)["input_ids"]
    allowed = sorted(set(free) - {free[0]})
    for extra, params in (({"bad_words": [word]}, SamplingParams(bad_words=barred)),
                          ({"allowed_token_ids": allowed}, SamplingParams(allowed_token_ids=allowed))):
        plain = generate(default_model_fp32, [ids], 24, params)[0]
        text, _, _ = complete(client, prompt, 24, extra_body=extra)
        assert text == tokenizer.decode(plain, skip_special_tokens=True) != tokenizer.decode(free), extra


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(server, client, default_model_fp32, tokenizer):
    """Completions' echo (lm-eval's loglikelihood request: a batch of token-id prompts, echo,
    logprobs 1, max_tokens 1): each choice's text is the prompt's and then the answer's; its
    logprobs cover the prompt (the first token None) and the answer, the prompt's those of a
    plain forward of the target; where a prompt token is the target's greedy choice its log-prob
    equals the top alternative's exactly (lm-eval's is_greedy). Streamed, the prompt leads."""
    from eagle_infer.generate import prefill

    model = default_model_fp32
    head = list(tokenizer("The capital of France is")["input_ids"])
    prompts = [head + generate(model, [head], 3)[0], list(tokenizer("Once upon a")["input_ids"])]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0, logprobs=1,
                                  echo=True)
    model.setup_cache(1, 64)
    for p, c in zip(prompts, sorted(r.choices, key=lambda c: c.index)):
        answer = client.completions.create(model=MODEL, prompt=p, max_tokens=1, temperature=0).choices[0].text
        assert c.text == tokenizer.decode(p) + answer
        lp = c.logprobs
        assert lp.tokens == [tokenizer.decode([t]) for t in p] + [answer]
        assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(p) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset[len(p)] == len(tokenizer.decode(p)) and lp.text_offset == sorted(lp.text_offset)
        _, (states,) = prefill(model, [p], [len(model.layers)])
        ref = torch.log_softmax(model.lm_head(states[0]).float(), -1)
        want = [float(ref[t, p[t + 1]]) for t in range(len(p) - 1)]
        assert lp.token_logprobs[1:len(p)] == pytest.approx(want, abs=1e-4)
    greedy = r.choices[0].logprobs  # the first prompt ends with three greedy tokens
    assert all(greedy.token_logprobs[i] == max(greedy.top_logprobs[i].values()) for i in (-4, -3, -2))
    assert greedy.token_logprobs[1] < max(greedy.top_logprobs[1].values())
    # vLLM's prompt_logprobs: per prompt token after the first, its log-prob and rank and its k
    # likeliest alternatives' (completions: in each choice; chat: beside the choices), as above
    p = prompts[0]
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    _, (states,) = prefill(model, [p], [len(model.layers)])
    ref = torch.log_softmax(model.lm_head(states[0]).float(), -1)
    got = r.choices[0].prompt_logprobs
    assert got[0] is None and len(got) == len(p) and r.choices[0].logprobs is None
    for t in range(len(p) - 1):
        entry, token = got[t + 1], p[t + 1]
        top = ref[t].topk(2).indices.tolist()
        assert set(entry) == {str(i) for i in [token, *top]}, (t, entry)
        assert entry[str(token)]["logprob"] == pytest.approx(float(ref[t, token]), abs=1e-4)
        assert entry[str(token)]["rank"] == 1 + int((ref[t] > ref[t, token]).sum())
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        for j, i in enumerate(top):  # the alternatives ranked in order
            assert entry[str(i)]["rank"] == j + 1
            assert entry[str(i)]["logprob"] == pytest.approx(float(ref[t, i]), abs=1e-4)
    # SGLang's /generate scores the prompt from logprob_start_len: [logprob, id, text] per token
    # (the first token's None) and its k alternatives, the same numbers
    auth = {"Authorization": f"Bearer {API_KEY}"}
    meta = httpx.post(server.url + "/generate", timeout=60, headers=auth, json={
        "input_ids": p, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
        "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == p and meta["input_top_logprobs"][0] is None
    first, second = meta["input_token_logprobs"][:2]
    assert first[0] is None and second[2] == tokenizer.decode(p[1:2])
    assert [lp for lp, _, _ in meta["input_token_logprobs"][1:]] == pytest.approx(
        [float(ref[t, p[t + 1]]) for t in range(len(p) - 1)], abs=1e-4)
    assert [[i for _, i, _ in top] for top in meta["input_top_logprobs"][1:]] == [
        ref[t].topk(2).indices.tolist() for t in range(len(p) - 1)]
    late = httpx.post(server.url + "/generate", timeout=60, headers=auth, json={
        "input_ids": p, "return_logprob": True, "logprob_start_len": 3,
        "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert late["input_token_logprobs"] == [[lp, t, None] for lp, t, _ in meta["input_token_logprobs"][3:]]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=1, extra_body={"prompt_logprobs": 0})
    whole = r.model_extra["prompt_logprobs"]
    assert whole[0] is None and all(len(e) == 1 for e in whole[1:]) and len(whole) == r.usage.prompt_tokens
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True, stream=True))
    assert text == "The capital of France is" + complete(client, "The capital of France is", 4)[0]


def plain_answer(model, tokenizer, prompt: list[int], grammar, max_tokens: int) -> tuple[str, str]:
    """(text, finish_reason) of the plain decoder's greedy answer under a grammar, in this process."""
    from eagle_infer.engine import PlainDecoder

    seq = Sequence_(prompt, SamplingParams(grammar=grammar), max_tokens, set(model.config.eos_token_ids))
    dec = PlainDecoder(model, max_batch=1, max_seq_len=512)
    dec.add(seq)
    while dec.seqs:
        dec.step()
    return tokenizer.decode(seq.output, skip_special_tokens=True), seq.finish_reason


# a small JSON schema the structured-output tests ask for (a name, an age)
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}


def test_structured_outputs_answer_as_plain_decoding_with_the_grammar(server, client, default_model_fp32,
                                                                       tokenizer):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs /
    guided_regex: the speculative server's greedy answer keeps the grammar and is the plain
    decoder's with the same grammar (in this process), token for token."""
    from eagle_infer.generate import chat_prompt_ids
    from eagle_infer.grammar import Grammars

    model = default_model_fp32
    eos = set(model.config.eos_token_ids)
    grammars = Grammars.for_tokenizer(tokenizer, model.config.vocab_size, eos)
    schema = PERSON_SCHEMA
    phone, choices = "[0-9]{3}-[0-9]{4}", ["yes", "no"]
    person_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    cases = [("Describe a person as JSON with name and age.", ("json_schema", schema),
              {"response_format": person_format}),
             ("Give a JSON object describing a cat.", ("json", None),
              {"response_format": {"type": "json_object"}}),
             ("Is the sky blue?", ("choice", choices),
              {"extra_body": {"structured_outputs": {"choice": choices}}}),
             ("Give a phone number.", ("regex", phone), {"extra_body": {"guided_regex": phone}})]
    texts = []
    for question, (kind, source), kw in cases:
        text, finish, _ = chat(client, question, 40, **kw)
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
        want = plain_answer(model, tokenizer, prompt, grammars.compile(kind, source), 40)
        assert (text, finish) == want, kind
        texts.append(text)
    person = json.loads(texts[0])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert texts[1].startswith("{") and texts[2] in choices and re.fullmatch(phone, texts[3])
    msgs = [{"role": "user", "content": "Hi"}]
    for body, param in (({"guided_regex": "("}, "guided_regex"),
                        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}},
                         "guided_choice"),
                        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
                        ({"response_format": {"type": "json_schema"}}, "response_format")):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, **body},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}}}]


def tool_answer(client, msgs: list[dict], stream: bool, max_tokens: int = 60, **kw) -> tuple:
    """(content, [(name, arguments)], finish_reason) of one greedy chat request with WEATHER_TOOLS,
    streamed deltas put together (each call's id and name in its first delta only)."""
    args = dict(model=MODEL, messages=msgs, tools=WEATHER_TOOLS, max_tokens=max_tokens, temperature=0) | kw
    if not stream:
        r = client.chat.completions.create(**args)
        m = r.choices[0].message
        assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in m.tool_calls or [])
        return m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []], \
            r.choices[0].finish_reason
    content, calls, finish = None, {}, None
    for c in client.chat.completions.create(stream=True, **args):
        for ch in c.choices:
            if ch.delta.content is not None:
                content = (content or "") + ch.delta.content
            for call in ch.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id.startswith("chatcmpl-tool-") and call.function.name
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments or ""
            finish = ch.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def test_tool_calls_forced_and_parsed_answer_as_plain_decoding(server, client, default_model_fp32, tokenizer):
    """tools with tool_choice a named function and "required" (one call, and parallel): the
    speculative server's calls are the plain decoder's greedy answer under their grammar (in this
    process; the hermes envelope around each tool's schema), streamed or not; "auto" parses hermes
    calls out of the answer (here forced by a regex) and leaves other answers as content; a
    history with calls and their results renders through the template; a malformed call in the
    history is a 400."""
    from eagle_infer.generate import chat_prompt_ids
    from eagle_infer.grammar import Grammars
    from eagle_infer.tool_calls import PARSERS, ToolPlan

    model = default_model_fp32
    grammars = Grammars.for_tokenizer(tokenizer, model.config.vocab_size, set(model.config.eos_token_ids))
    template = TOOLS_TEMPLATE.read_text()
    msgs = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    prompt = chat_prompt_ids(tokenizer, msgs, WEATHER_TOOLS, template)
    named = {"type": "function", "function": {"name": "get_weather"}}
    hermes = PARSERS["hermes"]
    cases = [(named, ToolPlan("named", "get_weather", hermes), True, {}),
             ("required", ToolPlan("required", parser=hermes), False, {"parallel_tool_calls": False}),
             ("required", ToolPlan("required", parser=hermes), True, {})]
    for choice, plan, parallel, kw in cases:
        got = tool_answer(client, msgs, False, 90, tool_choice=choice, **kw)
        grammar = grammars.compile(*plan.grammar(WEATHER_TOOLS, parallel))
        text, finish = plain_answer(model, tokenizer, prompt, grammar, 90)
        content, calls = plan.parse(text)
        want = ("", calls, "tool_calls" if plan.mode == "required" and finish == "stop" else finish)
        assert got == want, (choice, text)
        assert got[1] and all(n in ("get_weather", "get_time") and json.loads(a) for n, a in got[1])
        if parallel:  # streamed: named, and "required"'s several calls
            assert tool_answer(client, msgs, True, 90, tool_choice=choice, **kw)[1:] == got[1:], choice
        else:
            assert len(got[1]) == 1
    assert got[2] == "tool_calls"  # "required" answers that ended
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    regex = "Checking\\. " + call.replace("{", "\\{").replace("}", "\\}")
    for stream in (False, True):
        forced = tool_answer(client, msgs, stream, 60, extra_body={"structured_outputs": {"regex": regex}})
        assert forced == ("Checking. ", [("get_time", '{"zone": "CET"}')], "tool_calls"), stream
        free = tool_answer(client, msgs, stream, 24)  # "auto" by default; this model writes text
        assert free[0] and not free[1] and free[2] == "length"
    # a strict tool: "auto" answers under a grammar (free text; calls, once begun, in the envelope)
    strict = [{"type": "function", "function": WEATHER_TOOLS[0]["function"] | {"strict": True}}]
    got = tool_answer(client, msgs, False, 24, tools=strict)
    grammar = grammars.compile(*ToolPlan("auto", parser=hermes).grammar(strict, True))
    assert got == (plain_answer(model, tokenizer, chat_prompt_ids(tokenizer, msgs, strict, template), grammar,
                                24)[0], [], "length")
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "21 C and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=WEATHER_TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    with_results = chat_prompt_ids(tokenizer, [msgs[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        history[2]], WEATHER_TOOLS, template)
    assert r.usage.prompt_tokens == len(with_results) and r.choices[0].message.tool_calls is None
    # vLLM's template fields: a variable the template ignores, and continuing the last message
    partial = msgs + [{"role": "assistant", "content": "The weather in Paris is"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True,
              "chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=4, temperature=0,
                                       extra_body=fields)
    assert r.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, partial, None, template, False, True))
    bad = history[:1] + [{"role": "assistant", "tool_calls": [{"type": "code", "code": "x"}]}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": bad, "max_tokens": 4},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert chat(client, "Hi", 4)[0]


# ---------------------------------------------------------------------------------------
# Continuous batching


def test_n_choices_and_prompt_batches_answer_as_single_requests(server, client):
    """`n` choices of a seeded sampled request are the single requests with seeds seed + i (vLLM's
    parallel sampling), streamed or not; a completions batch answers each prompt as a request of
    its own, choice index prompt x n + i; usage counts each prompt once and every choice's tokens."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8,
              temperature=0.9)
    single = [client.chat.completions.create(seed=5 + i, **kw) for i in range(3)]
    r = client.chat.completions.create(seed=5, n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in single]
    assert len({c.message.content for c in r.choices}) > 1  # other seeds, other samples
    assert r.usage.prompt_tokens == single[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in single)
    texts: dict[int, str] = {}
    finishes, roles, usage = {}, [], None
    for c in client.chat.completions.create(seed=5, n=3, stream=True, stream_options={"include_usage": True},
                                            **kw):
        usage = c.usage or usage
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            roles += [ch.index] if ch.delta.role else []
            finishes[ch.index] = ch.finish_reason or finishes.get(ch.index)
    assert roles == [0, 1, 2]  # a role chunk for each choice first
    assert texts == {c.index: c.message.content for c in r.choices}
    assert finishes == {c.index: c.finish_reason for c in r.choices}
    assert usage.completion_tokens == r.usage.completion_tokens

    prompts = ["The sky is", "def add(a, b):"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    texts = {}
    for c in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2,
                                       stream=True, stream_options={"include_usage": True}):
        usage = c.usage or usage
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {2 * p + i: alone[p].choices[0].text for p in range(2) for i in range(2)}
    assert usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)


def test_a_prompt_that_extends_an_earlier_one_takes_over_its_slots(server, client, default_model_fp32,
                                                                    tokenizer):
    """Prefix caching: a prompt made of an earlier request's prompt and answer (a chat's next
    turn) takes over the slots the earlier request's row still holds (usage's
    prompt_tokens_details.cached_tokens, the prefix_cache_* counters) and answers as plain
    decoding of the whole prompt does."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    first = ids("<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n")
    out, finish = plain_answer(default_model_fp32, tokenizer, first, None, 12)
    r = client.completions.create(model=MODEL, prompt=first, max_tokens=12, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (out, finish) == (out, "length")
    before = metrics(server)
    turn = first + ids(out + "<|im_end|>\n<|im_start|>user\nShorter.<|im_end|>\n<|im_start|>assistant\n")
    r = client.completions.create(model=MODEL, prompt=turn, max_tokens=10, temperature=0)
    assert r.choices[0].text == plain_answer(default_model_fp32, tokenizer, turn, None, 10)[0]
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < len(turn) and cached >= len(first)
    after = metrics(server)
    assert after["eagle:prefix_cache_hits_total"] - before["eagle:prefix_cache_hits_total"] == cached
    assert after["eagle:prefix_cache_queries_total"] - before["eagle:prefix_cache_queries_total"] == len(turn)


def test_flush_cache_forgets_the_prefix_cache_when_idle(server, client, tokenizer):
    """SGLang's /flush_cache: while a request runs, refused (400, nothing flushed); idle, the free
    rows' contents are forgotten, so a prompt the cache served before prefills whole again."""
    prompt = tokenizer.encode("<|im_start|>user\nName three colors of the sea, please.<|im_end|>\n"
                              "<|im_start|>assistant\n", add_special_tokens=False)
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def cached() -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        details = r.usage.prompt_tokens_details
        return details.cached_tokens if details else 0

    story = [{"role": "user", "content": "Tell a story."}]
    stream = client.chat.completions.create(model=MODEL, messages=story, max_tokens=400, temperature=0,
                                            stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    busy = httpx.post(server.url + "/flush_cache", headers=headers, timeout=30)
    stream.close()
    assert busy.status_code == 400 and "not flushed" in busy.text
    t0 = time.time()
    while metrics(server)["eagle:num_requests_running"] != 0:
        assert time.time() - t0 < 15
        time.sleep(0.2)
    cached()
    assert cached() > 0  # the first request's row still holds the prompt
    flushed = httpx.get(server.url + "/flush_cache", headers=headers, timeout=30)
    assert flushed.status_code == 200 and flushed.text == "Cache flushed.\n"
    assert cached() == 0


def test_a_long_prompt_joining_running_requests_answers_as_plain_decoding(server, client, default_model_fp32,
                                                                           tokenizer):
    """Chunked prefill: a prompt longer than --chunked-prefill-size (256) arriving while another
    request decodes is written a chunk between rounds before it joins; both answer as plain
    decoding does, and the long one's own chunks are not counted as prefix-cache hits."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    story = " ".join(f"Step {i}: the river rose by {i} inches." for i in range(26))
    long = ids(f"<|im_start|>user\n{story} How far did it rise?<|im_end|>\n<|im_start|>assistant\n")
    short = ids("<|im_start|>user\nCount to fifty.<|im_end|>\n<|im_start|>assistant\n")
    assert 300 < len(long) < 400
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(client.completions.create, model=MODEL, prompt=short, max_tokens=120,
                              temperature=0, extra_body={"ignore_eos": True})
        time.sleep(1.0)  # decoding by now
        r = client.completions.create(model=MODEL, prompt=long, max_tokens=12, temperature=0)
        first = running.result()
    assert r.choices[0].text == plain_answer(default_model_fp32, tokenizer, long, None, 12)[0]
    assert r.usage.prompt_tokens_details is None or r.usage.prompt_tokens_details.cached_tokens < 256
    assert first.choices[0].text == plain_answer(default_model_fp32, tokenizer, short, None, 120)[0]
    # its next turn, as long, takes the first turn over (RowTable.left_to_prefill: nothing to chunk)
    turn = long + ids(r.choices[0].text + "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n")
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(client.completions.create, model=MODEL, prompt=short, max_tokens=120,
                              temperature=0, extra_body={"ignore_eos": True})
        time.sleep(1.0)
        r = client.completions.create(model=MODEL, prompt=turn, max_tokens=6, temperature=0)
        running.result()
    assert r.usage.prompt_tokens_details.cached_tokens >= len(long) - 1


LOAD_REQUESTS = [("chat", "Name three colors.", 8), ("chat", "What is the capital of France?", 10),
                 ("completion", "The quick brown fox", 8), ("completion", "def fibonacci(n):", 12)]


def run_one(client, kind: str, prompt: str, max_tokens: int, stream: bool) -> tuple[str, str]:
    if kind == "chat":  # a short system prompt: prefill is most of the work on a CPU
        text, finish, _ = chat(client, prompt, max_tokens, stream=stream, system="Be brief.")
    else:
        text, finish, _ = complete(client, prompt, max_tokens, stream=stream)
    return text, finish


def test_32_concurrent_clients_decode_together_and_match_single_requests(server, client):
    single = {r: run_one(client, *r, stream=False) for r in LOAD_REQUESTS}
    before = metrics(server)
    results: dict[int, tuple[str, str] | BaseException] = {}

    def worker(i: int) -> None:
        try:
            results[i] = run_one(client, *LOAD_REQUESTS[i % 4], stream=(i // 4) % 2 == 0)
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    saw_queue = False
    while any(t.is_alive() for t in threads):
        m = metrics(server)
        saw_queue |= m["eagle:num_requests_waiting"] > 0
        assert m["eagle:num_requests_running"] <= 8
        time.sleep(0.5)
    for i in range(32):
        assert not isinstance(results[i], BaseException), results[i]
        assert results[i] == single[LOAD_REQUESTS[i % 4]], (i, results[i])
    after = metrics(server)
    ok = 'eagle:http_requests_total{status="200"}'
    assert after[ok] - before[ok] >= 32
    assert saw_queue  # 32 clients, 8 rows: the rest waited
    # Requests shared rounds: far fewer engine steps than per-sequence rounds.
    steps = after["eagle:engine_steps_total"] - before["eagle:engine_steps_total"]
    rounds = after["eagle:spec_decode_num_drafts_total"] - before["eagle:spec_decode_num_drafts_total"]
    assert rounds >= 3 * steps, (rounds, steps)
    assert after["eagle:num_requests_running"] == 0 and after["eagle:num_requests_waiting"] == 0


class SseLines:
    """A streamed POST's lines through httpx, iterated and closed as the openai client's streams."""

    def __init__(self, url: str, headers: dict, body: dict):
        self.request = httpx.stream("POST", url, json=body, headers=headers, timeout=30)
        self.response = self.request.__enter__()

    def __iter__(self):
        return self.response.iter_lines()

    def close(self) -> None:
        self.request.__exit__(None, None, None)


def test_a_background_stream_answers_on_after_its_client_leaves(server):
    """A background response that streams keeps answering when its client drops the stream (a
    foreground stream's row is freed: below), and the client picks the events up again after the
    last sequence number it read, up to the stored answer."""
    # a client of its own: the module's keeps the 32 clients' test's connections, which the server
    # may close as one is reused (a reset, seen once in a full run)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    stream = client.responses.create(model=MODEL, input="Tell a story.", max_output_tokens=100,
                                     temperature=0, stream=True, background=True)
    first = []
    for event in stream:
        first.append(event)
        if len(first) == 5:
            break
    stream.close()
    rid = first[0].response.id
    time.sleep(0.2)
    running = metrics(server)["eagle:num_requests_running"]
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=first[-1].sequence_number))
    done = client.responses.retrieve(rid)
    assert running == 1  # still answering without its client
    seen = first + rest
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert rest[-1].type == "response.completed" and done.status in ("completed", "incomplete")
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text == done.output_text and done.usage.output_tokens > 20


def test_disconnected_stream_frees_its_slot(server, client):
    def made() -> float:
        return metrics(server)["eagle:generation_tokens_total"]

    msgs = [{"role": "user", "content": "Tell a story."}]
    # ignore_eos (a chat extension the other two APIs pass on): each answer runs its 400 tokens
    # unless cancelled; a greedy story that ended at EOS on another CPU's numerics would leave
    # nothing running to drop (CI once read 0 running after the first events)
    long = {"ignore_eos": True}
    streams = {  # a chat stream, the Responses API's and Anthropic's (their events wrap a chat stream),
        # each dropped after a few events (Responses' first ones are the response's and its item's)
        "chat": (2, lambda: client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=400,
                                                           temperature=0, stream=True, extra_body=long)),
        "responses": (4, lambda: client.responses.create(model=MODEL, input="Tell a story.",
                                                         max_output_tokens=400, temperature=0, stream=True,
                                                         extra_body=long)),
        "messages": (4, lambda: SseLines(server.url + "/v1/messages", {"x-api-key": API_KEY}, {
            "model": MODEL, "max_tokens": 400, "stream": True, "temperature": 0, "messages": msgs} | long))}
    tokens = {}  # each dropped stream's tokens made
    for kind, (reads, start) in streams.items():
        at = made()
        stream = start()
        read = []
        for event in stream:
            read.append(event)
            if len(read) > reads:
                break
        running = metrics(server)["eagle:num_requests_running"]
        if running != 1:  # say what the stream and the server said (an error event, an early end)
            failed = [ln for ln in server.log.read_text().splitlines() if "failed" in ln or "rror" in ln]
            pytest.fail(f"{kind}: {running} requests running after the events {read}; the server's "
                        f"errors: {failed[-5:]}")
        stream.close()
        t0 = time.time()
        while metrics(server)["eagle:num_requests_running"] != 0:
            assert time.time() - t0 < 15, f"the cancelled {kind} request still holds its row"
            time.sleep(0.2)
        tokens[kind] = made() - at
    # A non-streaming client that gives up is cancelled too.
    at = made()
    try:
        # ignore_eos: all 400 tokens (a full run once saw this answer end at EOS within 3 s)
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=3)
        pytest.fail(f"400 tokens came back within 3 s: {r.status_code} {r.text[-300:]}")  # say what came
    except httpx.ReadTimeout:
        pass
    t0 = time.time()
    while metrics(server)["eagle:num_requests_running"] != 0:
        assert time.time() - t0 < 15, "the abandoned request still holds its row"
        time.sleep(0.2)
    # the chat stream and the abandoned request, as this test bounded them before the other APIs'
    # streams joined it; those each on their own
    assert tokens["chat"] + made() - at < 200
    assert tokens["responses"] < 200 and tokens["messages"] < 200


def test_start_up_objects_are_frozen_out_of_garbage_collection(server):
    # A full collection walks everything the collector tracks: the loaded model's and compiled
    # graphs' objects too (~390 ms) unless frozen at start-up; serving must not pay that stall.
    import re

    found = re.search(r"(\d+) start-up objects frozen", server.log.read_text())
    assert found, "the server did not freeze its start-up objects"
    assert int(found.group(1)) > 50_000  # torch, transformers and the model, not a handful


def test_bench_server_direct_decodes_each_request_beside_the_server(server, request):
    """scripts/bench_server.py --direct: this process builds the decoder the server built from the
    same flags and decodes each request on it too, taking turns with the server; prompts and
    texts agree, greedy and seeded (the script stops where they do not), and the row gives both speeds.
    --stream: the streamed chunks' text is the answer, the row has TTFT, TPOT and ITL."""
    from eagle_infer.kernels import avx2_attention

    bs = load_script("bench_server")
    args = bs.build_parser().parse_args(["--direct", "--draft", str(server.head),
                                         *(f"--server-arg={f}" for f in SERVER_FLAGS)])
    # the kernels a fresh process runs, as the server's does: a model an earlier test loaded in
    # this process may have left the attention kernel on (after test_quantize.py the two sides'
    # bits differed and a seeded draw came out apart)
    was = avx2_attention.enabled()
    avx2_attention.enable(False)
    request.addfinalizer(lambda: avx2_attention.enable(was))
    direct = bs.direct_decoding("spec", args, 8)
    prompts, headers = bs.mtbench_prompts()[:3], {"Authorization": f"Bearer {API_KEY}"}
    row = bs.run_level(server.url, headers, prompts, 1, 3, 6, True, 300, direct)
    assert row["errors"] == 0 and row["output_tokens"] == 18, row
    assert row["direct_tok_per_s"] > 0
    assert row["server_vs_direct"] == round(row["output_tok_per_s"] / row["direct_tok_per_s"], 3)
    assert "median_ttft_ms" not in row
    # --temperature: request i sampled with seed i, on the server and directly alike (the texts agree)
    row = bs.run_level(server.url, headers, prompts[:2], 1, 2, 6, True, 300, direct, temperature=0.9)
    assert row["errors"] == 0 and row["output_tokens"] == 12, row
    assert bs.chat_body(MODEL, "hi", 6, True, sampling=bs.sampling_fields(0.9, 0.8, 3))["seed"] == 3
    assert bs.sampling_fields(0.0, 1.0, 3) is None
    # streamed (--stream): the chunks' text is the whole answer, and vLLM's TTFT / TPOT / ITL
    row = bs.run_level(server.url, headers, prompts[:2], 1, 2, 6, True, 300, direct, stream=True)
    assert row["errors"] == 0 and row["output_tokens"] == 12, row
    assert 0 < row["median_ttft_ms"] <= row["p99_ttft_ms"] < 1000 * row["latency_p90_s"], row
    assert 0 < row["median_tpot_ms"] and 0 < row["median_itl_ms"] <= row["p99_itl_ms"], row
    one = {"latency": 1.0, "ttft": 0.2, "tokens": 5, "itl": [0.1, 0.3, 0.4]}  # 3 chunks after the first
    assert bs.latency_stats([one]) == {"mean_ttft_ms": 200.0, "median_ttft_ms": 200.0, "p99_ttft_ms": 200.0,
                                       "mean_tpot_ms": 200.0, "median_tpot_ms": 200.0, "p99_tpot_ms": 200.0,
                                       "mean_itl_ms": 266.67, "median_itl_ms": 300.0, "p99_itl_ms": 398.0}
    def garbled(body: dict) -> tuple[int, str, int]:  # the direct side's text, one character off
        n_prompt, text, n = direct(body)
        return n_prompt, text + "!", n

    with httpx.Client(headers=headers, timeout=300) as http:
        with pytest.raises(SystemExit, match="the same decoding only"):
            bs.alternate(http, server.url, [bs.chat_body(MODEL, prompts[0], 6, True)], garbled)


def test_bench_server_multi_turn_sends_each_answer_back_with_the_next_turn(server):
    """scripts/bench_server.py --multi-turn: each request a conversation of MT-bench's two turns,
    the second with the first's answer in its history, which the prefix cache serves (its cached
    tokens, per turn in the row); -nocache modes start the same server without the cache."""
    bs = load_script("bench_server")
    prompts, headers = bs.mtbench_prompts()[:2], {"Authorization": f"Bearer {API_KEY}"}
    second = bs.mtbench_prompts(turn=1)[:2]
    row = bs.run_level(server.url, headers, prompts, 1, 2, 6, True, 300, stream=True, second_turns=second)
    assert row["errors"] == 0 and row["output_tokens"] == 24, row  # 2 conversations x 2 turns x 6
    assert row["turn2_prompt_tokens_mean"] > row["turn1_prompt_tokens_mean"] + 6
    assert row["turn2_cached_tokens_mean"] >= row["turn1_prompt_tokens_mean"], row  # the whole first turn
    assert 0 < row["turn2_median_ttft_ms"] and row["turn1_latency_mean_s"] > 0
    assert 0 < row["cached_tokens_mean"] < row["prompt_tokens_mean"]  # over both turns
    args = bs.build_parser().parse_args(["--multi-turn", "--modes", "spec-nocache"])
    assert bs.server_command("spec-nocache", args, 4)[1] == bs.server_command("spec", args, 4)[1] + [
        "--disable-radix-cache"]


def test_bench_server_request_rate_and_ttft_by_prompt_length(server):
    """scripts/bench_server.py --request-rate: requests arrive at seeded Poisson times (the first
    at once, exponential gaps averaging 1 / rate; inf: all at once), so the level lasts at least
    until the last arrival; streamed rows of prompts both under and over 256 tokens report
    their TTFT apart."""
    import math
    import statistics

    bs = load_script("bench_server")
    offsets = bs.arrival_offsets(2000, 4.0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets == bs.arrival_offsets(2000, 4.0)
    assert abs(statistics.mean(b - a for a, b in zip(offsets, offsets[1:])) - 0.25) < 0.02
    assert bs.arrival_offsets(3, math.inf) == [0.0] * 3 and bs.arrival_offsets(3, 4.0, seed=1) != offsets[:3]
    long = "Tell me about the river. " + " ".join(f"On day {i} the river rose by {i} inches."
                                                  for i in range(30))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    row = bs.run_level(server.url, headers, [long, "Name a color."], 2, 4, 4, True, 300, stream=True,
                       request_rate=4.0)
    assert row["errors"] == 0 and row["wall_s"] >= bs.arrival_offsets(4, 4.0)[-1], row
    assert row["short_prompt_median_ttft_ms"] > 0 and row["long_prompt_median_ttft_ms"] > 0, row
    with pytest.raises(SystemExit, match="request-rate"):
        bs.main(["--request-rate", "2", "--multi-turn"])


def test_sigterm_exits_cleanly(server):
    # Runs last: it stops the shared server.
    t0 = time.time()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(15) == 0
    assert time.time() - t0 < 10
    assert "Traceback" not in server.log.read_text()


# ---------------------------------------------------------------------------------------
# In-process: engine faults, stop strings, start-up choices, the plain decoder


class FakeTokenizer:
    """Token id t <-> letter chr(97 + t % 26); prompts are token id lists."""

    def __len__(self) -> int:
        return 1000

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) - 97 for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in ids)


class FakeDecoder:
    """Emits prompt[-1] + 1, + 2, ...; a prompt starting with 7 fails at prefill, 13 in a round."""

    def __init__(self, max_batch: int = 2):
        self.max_batch, self.seqs, self.stats = max_batch, [], SpecStats()
        self.joined: list[int] = []  # sizes of the prefill batches
        self.cancelled: list[Sequence_] = []

    @property
    def free_rows(self) -> int:
        return self.max_batch - len(self.seqs)

    def check(self, seq: Sequence_) -> None:
        pass

    def add_many(self, seqs: list[Sequence_]) -> None:
        if any(s.prompt[0] == 7 for s in seqs):  # the whole joining batch fails
            raise RuntimeError("prefill exploded")
        self.joined.append(len(seqs))
        for seq in seqs:
            self.seqs.append(seq)
            seq.emit([seq.prompt[-1] + 1])
            if seq.done:
                self.seqs.remove(seq)

    def step(self):
        if any(s.prompt[0] == 13 for s in self.seqs):
            raise RuntimeError("round exploded")
        out = [(s, s.emit([s.output[-1] + 1])) for s in self.seqs]
        for s in self.seqs:
            s.accepted.append(0)
        self.seqs = [s for s in self.seqs if not s.done]
        return out

    def cancel(self, seq: Sequence_) -> None:
        self.cancelled.append(seq)
        if seq in self.seqs:
            self.seqs.remove(seq)
        seq.done = True


async def job_text(job) -> str:
    """A Job's answer from its events up to its last: the text, or "error" if it failed."""
    text = ""
    while True:
        event = await asyncio.wait_for(job.events.get(), 10)
        if "error" in event:
            return "error"
        text += event["delta"]
        if "finish_reason" in event:
            return text


def fake_app():
    from eagle_infer.server import Engine, Metrics, ServerConfig, create_app

    engine = Engine(FakeDecoder(), FakeTokenizer(), Metrics(1), speculative=True)
    app = create_app(engine, FakeTokenizer(), {999}, ServerConfig(["fake"], None, 100))
    return engine, app


def sse_events(text: str) -> list:
    lines = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


class ScriptedDecoder(FakeDecoder):
    """Answers every request with the tokens of `script`, `per_round` of them a round (so a
    marker's tokens may straddle rounds and streamed chunks)."""

    def __init__(self, script: list[int], per_round: int = 3):
        super().__init__(max_batch=4)
        self.script, self.per_round = script, per_round
        self.added: list[Sequence_] = []

    def add_many(self, seqs: list[Sequence_]) -> None:
        for seq in seqs:
            self.seqs.append(seq)
            self.added.append(seq)
            seq.matcher = seq.params.new_matcher()  # as prefill_rows: emit() feeds it the answer
            seq.emit(self.script[:1])

    def step(self):
        out = [(s, s.emit(self.script[len(s.output):len(s.output) + self.per_round])) for s in self.seqs]
        for s in self.seqs:
            s.accepted.append(0)
        self.seqs = [s for s in self.seqs if not s.done]
        return out


def scripted_app(tokenizer, answer: str, cfg):
    """An in-process server under ServerConfig cfg whose every answer is `answer` (then EOS), with
    the real tokenizer and chat template: (its engine, not started; the app)."""
    from eagle_infer.server import Engine, Metrics, create_app

    eos = tokenizer.eos_token_id
    script = list(tokenizer(answer, add_special_tokens=False)["input_ids"]) + [eos]
    engine = Engine(ScriptedDecoder(script), tokenizer, Metrics(1), speculative=True)
    return engine, create_app(engine, tokenizer, {eos}, cfg)


def in_process(engine, app, requests: list[tuple[str, str, dict | None]],
               headers: dict | None = None) -> list[httpx.Response]:
    """Each (method, path, JSON body) sent in turn to an in-process app, its engine started for
    them and stopped after: the responses."""
    async def send() -> list[httpx.Response]:
        engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
                return [await http.request(method, path, json=body, headers=headers or {})
                        for method, path, body in requests]
        finally:
            engine.stop()

    return asyncio.run(send())


def reasoning_app(tokenizer, answer: str, parser: str | None):
    """scripted_app with --reasoning-parser `parser` and the hermes tool parser (auto)."""
    from eagle_infer.server import ServerConfig

    cfg = ServerConfig(["fake"], None, 2048, len(tokenizer), tool_parser="hermes", auto_tools=True,
                       reasoning_parser=parser)
    return scripted_app(tokenizer, answer, cfg)


def test_generation_config_sets_the_sampling_requests_leave_out(tokenizer, tmp_path):
    """--generation-config auto (vLLM's default): the model's generation_config.json sampling
    fields (those away from transformers' defaults) fill what a request leaves out, its
    max_new_tokens the default max_tokens (capped by the room); what a request sets stays; vllm:
    OpenAI's neutral defaults; a folder: its file, a folder without one refused by name;
    --override-generation-config over either."""
    from transformers import GenerationConfig

    from eagle_infer.errors import UserError
    from eagle_infer.server import ServerConfig, sampling_defaults_of

    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05,
                     max_new_tokens=40, bos_token_id=1, eos_token_id=2).save_pretrained(tmp_path / "m")
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(tmp_path / "plain")
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 40}
    assert sampling_defaults_of("auto", tmp_path / "m") == want
    assert sampling_defaults_of(str(tmp_path / "m"), tmp_path / "plain") == want
    assert sampling_defaults_of("vllm", tmp_path / "m") == {}
    assert sampling_defaults_of("auto", tmp_path / "plain") == sampling_defaults_of("auto", tmp_path) == {}
    with pytest.raises(UserError, match="no generation_config.json in"):
        sampling_defaults_of(str(tmp_path), tmp_path / "m")
    # --override-generation-config: over the file's (or over none, with vllm); only sampling numbers
    assert sampling_defaults_of("auto", tmp_path / "m", {"temperature": 0.3, "max_new_tokens": 8}) == (
        want | {"temperature": 0.3, "max_tokens": 8})
    assert sampling_defaults_of("vllm", tmp_path / "m", {"top_k": 5}) == {"top_k": 5}
    for bad, error in (({"temprature": 0.3}, "temprature not a sampling field"),
                       ({"temperature": "hot"}, "temperature must be a number")):
        with pytest.raises(UserError, match=error):
            sampling_defaults_of("auto", tmp_path / "m", bad)

    engine, app = scripted_app(tokenizer, "Hi.", ServerConfig(["fake"], None, 2048, len(tokenizer),
                                                              sampling_defaults=want))

    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    answers = in_process(engine, app, [
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/chat/completions", chat | {"temperature": 0, "top_k": -1, "max_tokens": 100}),
        ("POST", "/v1/completions", {"prompt": "Hi", "top_p": 1.0})])
    assert [r.status_code for r in answers] == [200] * 3
    got = [(s.params.temperature, s.params.top_p, s.params.top_k, s.params.repetition_penalty,
            s.max_new_tokens) for s in engine.dec.added]
    assert got == [(0.6, 0.9, 20, 1.05, 40), (0.0, 0.9, 0, 1.05, 100), (0.6, 1.0, 20, 1.05, 16)]


def tokenize_in_process(tokenizer, cfg, messages: list[dict]) -> httpx.Response:
    """/tokenize of `messages` (no generation prompt) on an in-process server with config cfg:
    the prompt a chat request would get there, through its chat template."""
    engine, app = scripted_app(tokenizer, "", cfg)
    body = {"messages": messages, "add_generation_prompt": False}
    return in_process(engine, app, [("POST", "/tokenize", body)])[0]


# Mistral's templates' rule on call ids (their raise_exception), and the ids written into the prompt
MISTRAL_ID_TEMPLATE = (
    "{%- for m in messages %}{%- for c in m.tool_calls or [] %}"
    "{%- if c.id is not string or c.id|length != 9 %}{{ raise_exception('Tool call IDs should be "
    "alphanumeric strings with length 9!') }}{%- endif %}[CALL {{ c.id }}]{%- endfor %}"
    "{%- if m.role == 'tool' %}{%- if m.tool_call_id|length != 9 %}{{ raise_exception('Tool call IDs "
    "should be alphanumeric strings with length 9!') }}{%- endif %}[RESULT {{ m.tool_call_id }}]"
    "{%- endif %}{{ m.content or '' }}{%- endfor %}")


def test_mistral_parser_cuts_a_historys_long_call_ids_to_nine(tokenizer):
    """--tool-call-parser mistral: call ids of more than 9 characters in a request's history
    (another server's) are cut to their last 9, the calls and the tool turns answering them alike,
    as vLLM does for Mistral models, so the template's 9-character rule takes them; with another
    parser the ids go through as sent (the template refuses them: a 400 naming its message)."""
    from eagle_infer.server import ServerConfig

    call = {"id": "call_98660886abc", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_98660886abc", "content": "5"}]

    def tokenize(parser: str) -> httpx.Response:
        cfg = ServerConfig(["fake"], None, 2048, len(tokenizer), tool_parser=parser,
                           chat_template=MISTRAL_ID_TEMPLATE)
        return tokenize_in_process(tokenizer, cfg, msgs)

    ok = tokenize("mistral")
    assert ok.status_code == 200, ok.text
    assert tokenizer.decode(ok.json()["tokens"]) == "Hi[CALL 660886abc][RESULT 660886abc]5"
    refused = tokenize("hermes")
    assert refused.status_code == 400 and "length 9" in refused.json()["error"]["message"]


def test_return_tokens_as_token_ids_flag_is_what_requests_leaving_it_out_get(monkeypatch, tokenizer):
    """--return-tokens-as-token-ids (vLLM's): logprobs name tokens as token_id:{id} for requests
    that leave the field out; a request's own true / false wins."""
    from eagle_infer import server
    from eagle_infer.server import ServerConfig

    seen = []

    class Recording(server.Job):
        def __init__(self, *args, **kwargs):
            seen.append(args[8])  # tokens_as_ids
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(server, "Job", Recording)
    assert server.build_parser().parse_args(["--return-tokens-as-token-ids"]).return_tokens_as_token_ids

    for flag, field in ((True, None), (True, False), (False, None), (False, True)):
        engine, app = scripted_app(tokenizer, "", ServerConfig(["m"], None, 2048, len(tokenizer),
                                                               tokens_as_ids=flag))
        body = {"prompt": "Hi", "max_tokens": 1}
        if field is not None:
            body["return_tokens_as_token_ids"] = field
        assert in_process(engine, app, [("POST", "/v1/completions", body)])[0].status_code == 200
    assert seen == [True, False, False, True]


def test_content_format_openai_gives_templates_lists_of_parts(tokenizer):
    """--chat-template-content-format openai (vLLM's): each message's text reaches the template as
    [{"type": "text", "text": ...}] (a request's parts each one part), for templates that loop
    over parts; string: the text itself (parts joined by newlines, as vLLM's)."""
    from eagle_infer.server import ServerConfig

    parts = "{%- for m in messages %}[{%- for p in m.content %}{{ p.text }}|{%- endfor %}]{%- endfor %}"
    text = "{%- for m in messages %}[{{ m.content }}]{%- endfor %}"

    def prompt(template: str, content_format: str) -> str:
        cfg = ServerConfig(["m"], None, 2048, len(tokenizer), chat_template=template,
                           content_format=content_format)
        got = tokenize_in_process(tokenizer, cfg, [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Y"}, {"type": "text", "text": "o"}]}])
        assert got.status_code == 200, got.text
        return tokenizer.decode(got.json()["tokens"])

    assert prompt(parts, "openai") == "[Hi|][Y|o|]"
    assert prompt(text, "string") == "[Hi][Y\no]"  # parts on lines of their own, as vLLM joins them


def test_developer_turns_are_system_turns_for_templates_without_the_role(tokenizer):
    """OpenAI's "developer" role (newer clients send it for instructions): a template that does
    not name it gets a system turn (vLLM's rule), system turns merged into the first, so
    SmolLM2's template shows the instruction in place of its default system prompt; a template
    that names the role gets it as sent."""
    from eagle_infer.server import ServerConfig

    def prompt(messages: list[dict], template: str | None = None) -> str:
        got = tokenize_in_process(tokenizer, ServerConfig(["m"], None, 2048, len(tokenizer),
                                                          chat_template=template), messages)
        assert got.status_code == 200, got.text
        return tokenizer.decode(got.json()["tokens"])

    user = {"role": "user", "content": "Hi"}
    assert prompt([{"role": "developer", "content": "Be terse."}, user]) == \
        prompt([{"role": "system", "content": "Be terse."}, user])
    later = {"role": "developer", "content": "No."}
    assert prompt([{"role": "system", "content": "Be terse."}, user, later]) == \
        prompt([{"role": "system", "content": "Be terse.\n\nNo."}, user])
    assert "developer" not in prompt([{"role": "developer", "content": "Be terse."}, user])
    named = "{%- for m in messages %}{%- if m.role in ['developer', 'system'] %}[{{ m.role }}]{%- endif %}" \
            "{{ m.content }}{%- endfor %}"
    assert prompt([{"role": "developer", "content": "Be terse."}, user], named) == "[developer]Be terse.Hi"


def test_server_wide_chat_settings_as_vllm_flags_set_them(tokenizer, default_model_dir):
    """--default-chat-template-kwargs (a request's own variables win), --exclude-tools-when-tool-
    choice-none (tool_choice none: the template sees no tools), --enable-force-include-usage
    (streams end with their usage unasked), --enable-request-id-headers (X-Request-Id: the
    request's, else a new one); a default kwarg named as apply_chat_template's parameter is
    refused at start."""
    from eagle_infer import server
    from eagle_infer.errors import UserError
    from eagle_infer.server import ServerConfig

    template = ("{%- if tools %}[tools]{%- endif %}{%- for m in messages %}{{ m.content }}{%- endfor %}"
                "({{ mood | default('none') }})")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    def ask(cfg: ServerConfig, body: dict, headers: dict | None = None) -> tuple[httpx.Response, str]:
        engine, app = scripted_app(tokenizer, "Hi.", cfg)
        got = in_process(engine, app, [("POST", "/v1/chat/completions", body)], headers)[0]
        return got, tokenizer.decode(engine.dec.added[-1].prompt)

    def cfg(**kw) -> ServerConfig:
        return ServerConfig(["m"], None, 2048, len(tokenizer), chat_template=template, **kw)

    msgs = [{"role": "user", "content": "Yo"}]
    moody = cfg(template_kwargs={"mood": "calm"})
    assert ask(moody, {"messages": msgs})[1] == "Yo(calm)"
    assert ask(moody, {"messages": msgs, "chat_template_kwargs": {"mood": "glad"}})[1] == "Yo(glad)"
    none = {"messages": msgs, "tools": tools, "tool_choice": "none"}
    assert ask(cfg(), none)[1] == "[tools]Yo(none)"  # vLLM's default: shown
    assert ask(cfg(tools_only_when_chosen=True), none)[1] == "Yo(none)"
    stream = {"messages": msgs, "stream": True}
    for forced, usage in ((False, False), (True, True)):
        got, _ = ask(cfg(force_usage=forced), stream)
        last = sse_events(got.text)[-1]
        assert (last["choices"] == [] and last["usage"]["completion_tokens"] > 0) == usage
    got, _ = ask(cfg(request_id_headers=True), {"messages": msgs}, {"X-Request-Id": "abc-1"})
    assert got.headers["x-request-id"] == "abc-1"
    assert len(ask(cfg(request_id_headers=True), {"messages": msgs})[0].headers["x-request-id"]) == 32
    assert "x-request-id" not in ask(cfg(), {"messages": msgs})[0].headers
    args = server.build_parser().parse_args(["--model-path", str(default_model_dir), "--device", "cpu",
                                             "--dtype", "float32", "--speculative-algorithm", "NONE",
                                             "--disable-torch-compile",
                                             "--default-chat-template-kwargs", '{"tools": []}'])
    with pytest.raises(UserError, match="--default-chat-template-kwargs: tools is a parameter of"):
        server.build_engine(args)


def test_a_requests_chat_template_needs_the_servers_trust(tokenizer):
    """A request's chat_template (vLLM's field) is refused unless the server trusts them
    (--trust-request-chat-template, vLLM's rule); trusted, it renders the prompt, its content format
    detected for it (auto): a template that loops over parts gets parts."""
    from eagle_infer.server import ServerConfig

    parts = "{%- for m in messages %}[{%- for p in m.content %}{{ p.text }}|{%- endfor %}]{%- endfor %}"
    body = {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False,
            "chat_template": parts}

    def tokenize(trust: bool) -> httpx.Response:
        engine, app = scripted_app(tokenizer, "", ServerConfig(["m"], None, 2048, len(tokenizer),
                                                                trust_request_template=trust))
        return in_process(engine, app, [("POST", "/tokenize", body)])[0]

    refused = tokenize(False)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    trusted = tokenize(True)
    assert trusted.status_code == 200, trusted.text
    assert tokenizer.decode(trusted.json()["tokens"]) == "[Hi|]"


def test_content_format_auto_detects_templates_that_loop_over_parts(tokenizer):
    """--chat-template-content-format auto (the default, as vLLM's): openai where the template
    loops over a message's content, however the message and its content are reached; string
    where it only prints or tests it (text models' templates: SmolLM2's, Qwen3's pattern)."""
    from eagle_infer.server_flags import build_parser, content_format_of

    def loop(over: str, setup: str = "", each: str = "message") -> str:
        return (f"{setup}{{%- for {each} in messages %}}{{%- for p in {over} %}}{{{{ p.text }}}}"
                "{%- endfor %}{%- endfor %}")

    openai = [
        loop("message['content']"), loop("message.content"),
        loop("message['content'] | selectattr('type', 'equalto', 'text')"),  # Llama 3.2 Vision's
        # Qwen2-VL's: a string printed, else its parts
        "{%- for message in messages %}{%- if message['content'] is string %}{{ message['content'] }}"
        "{%- else %}{%- for c in message['content'] %}{{ c['text'] }}{%- endfor %}{%- endif %}{%- endfor %}",
        # messages through a name set from them, content through a name set from it
        "{%- set loop_messages = messages[1:] %}{%- for m in loop_messages %}{%- set c = m.content %}"
        "{%- for part in c %}{{ part.text }}{%- endfor %}{%- endfor %}",
        "{%- set first = messages[0] %}{%- for p in first.content %}{{ p.text }}{%- endfor %}",
        # a macro's parameter given a content, by position or by name
        "{%- macro show(x) %}{%- for p in x %}{{ p.text }}{%- endfor %}{%- endmacro %}"
        "{%- for m in messages %}{{ show(m['content']) }}{%- endfor %}",
        "{%- macro show(sep, x='') %}{%- for p in x %}{{ p.text }}{%- endfor %}{%- endmacro %}"
        "{%- for m in messages %}{{ show('|', x=m.content) }}{%- endfor %}",
        loop("message.content").replace("{{ p.text }}", "{% generation %}{{ p.text }}"
                                                         "{% endgeneration %}"),  # transformers' tag
    ]
    string = [
        tokenizer.chat_template,  # SmolLM2's
        "{%- for message in messages %}{%- if message.content is string %}"
        "{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}"
        "{{ content }}{%- endfor %}",  # Qwen3's pattern
        "{%- macro show(x) %}{%- for p in x %}{{ p }}{%- endfor %}{%- endmacro %}"
        # a loop, not over content
        "{%- for m in messages %}{{ show(['a', 'b']) }}{{ m.content }}{%- endfor %}",
        loop("message.tool_calls"),
        "{%- for message in messages %}{%- for p in message.content %}",  # does not parse
        None,
    ]
    assert [content_format_of(t) for t in openai] == ["openai"] * len(openai)
    assert [content_format_of(t) for t in string] == ["string"] * len(string)
    assert build_parser().parse_args([]).chat_template_content_format == "auto"


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning_parser_splits_the_answer_into_reasoning_and_content(tokenizer, parser):
    """--reasoning-parser (vLLM's flag): a chat answer's text before </think> is message.reasoning
    (a leading <think> dropped), the rest its content, whole and streamed alike (the stream holds
    back text that may grow into a marker: <think> and </think> are several tokens here, split
    across rounds); qwen3 with enable_thinking false answers content alone; a structured output
    starts after the reasoning (its matcher takes the content alone, as vLLM's gate); without the
    flag the markers stay in the content."""
    from eagle_infer.reasoning import PARSERS

    answer = "<think>\nTwo and two make four.</think>\n\nFour."
    want = ("\nTwo and two make four.", "\n\nFour.")
    assert PARSERS[parser].split(answer) == want
    msgs = {"model": "fake", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 64}

    async def ask(app, body: dict) -> tuple[int, dict | list]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            r = await http.post("/v1/chat/completions", json=body)
            return r.status_code, sse_events(r.text) if body.get("stream") else r.json()

    def answered(app, extra: dict) -> tuple:
        status, whole = asyncio.run(ask(app, msgs | extra))
        assert status == 200, whole
        message = whole["choices"][0]["message"]
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        _, events = asyncio.run(ask(app, msgs | extra | usage))
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        streamed = tuple("".join(d.get(k) or "" for d in deltas) or None for k in ("reasoning", "content"))
        assert streamed == (message.get("reasoning") or None, message["content"] or None)
        assert all(k in ("role", "content", "reasoning") for d in deltas for k in d)
        # usage.completion_tokens_details.reasoning_tokens (OpenAI's, vLLM's), whole and streamed
        count = whole["usage"].get("completion_tokens_details", {}).get("reasoning_tokens")
        assert events[-1]["usage"].get("completion_tokens_details", {}).get("reasoning_tokens") == count
        reasoning_tokens.append(count)  # None without --reasoning-parser (vLLM's)
        return message.get("reasoning"), message["content"]

    def inside(text: str, lo: int, hi: int) -> int:
        """The answer's tokens whose text starts in text[lo:hi]."""
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return sum(lo <= len(tokenizer.decode(ids[:i])) < hi for i in range(len(ids)))

    reasoning_tokens: list[int] = []

    engine, app = reasoning_app(tokenizer, answer, parser)
    engine.start()
    try:
        assert answered(app, {}) == want
        assert reasoning_tokens[-1] == inside(answer, len("<think>"), len("<think>") + len(want[0])) > 3
        thinking_off = {"chat_template_kwargs": {"enable_thinking": False}}
        assert answered(app, thinking_off) == (want if parser == "deepseek_r1" else (None, answer))
        assert reasoning_tokens[-1] == (reasoning_tokens[0] if parser == "deepseek_r1" else 0)
    finally:
        engine.stop()
    json_answer = '<think>\nTwo and two.</think>{"sum": 4}'
    engine, app = reasoning_app(tokenizer, json_answer, parser)
    engine.start()
    try:
        status, body = asyncio.run(ask(app, msgs | {"response_format": {"type": "json_object"}}))
        assert status == 200 and body["choices"][0]["message"]["content"] == '{"sum": 4}', body
        seq = engine.dec.added[-1]
        content = tokenizer('{"sum": 4}', add_special_tokens=False)["input_ids"]
        assert seq.matcher.gate == tuple(tokenizer("</think>", add_special_tokens=False)["input_ids"])
        # the grammar took the content and EOS, every one of them (a refused token is not taken)
        assert seq.matcher.started and seq.matcher.taken.count(True) == len(content) + 1
    finally:
        engine.stop()
    # tools ("auto", hermes): the calls are parsed from the content, the reasoning kept apart
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    engine, app = reasoning_app(tokenizer, "<think>\nThe weather tool.</think>\n" + call, parser)
    engine.start()
    try:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        status, body = asyncio.run(ask(app, msgs | {"tools": tools}))
        choice = body["choices"][0]
        assert status == 200 and choice["finish_reason"] == "tool_calls", body
        assert choice["message"]["reasoning"] == "\nThe weather tool."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in choice["message"]["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    finally:
        engine.stop()
    engine, app = reasoning_app(tokenizer, "</think>", parser)  # only an end: empty reasoning
    engine.start()
    try:
        assert answered(app, {}) == ("", None)
    finally:
        engine.stop()
    engine, app = reasoning_app(tokenizer, answer, None)
    engine.start()
    try:
        assert answered(app, {}) == (None, answer) and reasoning_tokens[-1] is None
    finally:
        engine.stop()


def test_thinking_token_budget_reaches_the_sequences_grammar(tokenizer):
    """thinking_token_budget (vLLM's) and Anthropic's thinking.budget_tokens: the sequence's grammar
    forces the reasoning parser's end after that many tokens (Grammar.budget, its gate the end
    marker's tokens), with a structured output after it too; without --reasoning-parser, or
    below 0, a 400 naming the field."""
    end = tuple(tokenizer("</think>", add_special_tokens=False)["input_ids"])
    chat = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    engine, app = reasoning_app(tokenizer, "<think>\nHmm.</think>Hello.", "deepseek_r1")
    got = in_process(engine, app, [
        ("POST", "/v1/chat/completions", chat | {"thinking_token_budget": 3}),
        ("POST", "/v1/messages", {"model": "fake", "max_tokens": 8, "messages": chat["messages"],
                                  "thinking": {"type": "enabled", "budget_tokens": 5}}),
        ("POST", "/v1/chat/completions", chat | {"thinking_token_budget": 2,
                                                 "response_format": {"type": "json_object"}}),
        ("POST", "/v1/chat/completions", chat | {"thinking_token_budget": -1})])
    assert [r.status_code for r in got] == [200, 200, 200, 400]
    grammars = [seq.params.grammar for seq in engine.dec.added]
    assert [(g.budget, g.gate, g.compiled is None) for g in grammars] == [(3, end, True), (5, end, True),
                                                                          (2, end, False)]
    assert got[3].json()["error"]["param"] == "thinking_token_budget"
    engine, app = reasoning_app(tokenizer, "Hello.", None)
    budgeted = chat | {"thinking_token_budget": 3}
    (refused,) = in_process(engine, app, [("POST", "/v1/chat/completions", budgeted)])
    assert refused.status_code == 400 and "--reasoning-parser" in refused.json()["error"]["message"]


def test_engine_faults_fail_only_that_request_and_stop_strings_cut():
    engine, app = fake_app()
    engine.start()

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            url = "/v1/completions"
            r = await http.post(url, json={"prompt": [7, 1], "max_tokens": 4})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
            r = await http.post(url, json={"prompt": [13, 1], "max_tokens": 4})
            assert r.status_code == 503 and "round exploded" in r.json()["error"]["message"]
            r = await http.post(url, json={"prompt": [13, 1], "max_tokens": 4, "stream": True})
            assert r.status_code == 200  # the first token came before the fault: an error event
            assert sse_events(r.text)[-1]["error"]["code"] == "engine_error"
            oks = await asyncio.gather(*[http.post(url, json={"prompt": [1, 2], "max_tokens": 3})
                                         for _ in range(5)])
            assert [r.json()["choices"][0]["text"] for r in oks] == ["def"] * 5
            # Stop strings: "defghi..." stops at "fg" -> "de", also when streamed.
            body = {"prompt": [1, 2], "max_tokens": 10, "stop": ["fg", "xyz"]}
            # vLLM's stop_reason names the string; include_stop_str_in_output keeps it in the text
            for extra, text in (({}, "de"), ({"include_stop_str_in_output": True}, "defg")):
                r = await http.post(url, json=body | extra)
                choice = r.json()["choices"][0]
                assert (choice["text"], choice["finish_reason"]) == (text, "stop")
                assert choice["stop_reason"] == "fg"
                events = sse_events((await http.post(url, json=body | extra | {"stream": True})).text)
                assert "".join(e["choices"][0]["text"] for e in events) == text
                assert events[-1]["choices"][0]["finish_reason"] == "stop"
                assert events[-1]["choices"][0]["stop_reason"] == "fg"
            # EOS (id 999) ends a request with "stop" and no stop_reason; ignore_eos decodes through
            # it; a stop_token_ids token is the stop_reason
            r = await http.post(url, json={"prompt": [997], "max_tokens": 4})
            choice = r.json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
            assert r.json()["usage"]["completion_tokens"] == 2
            r = await http.post(url, json={"prompt": [997], "max_tokens": 4, "ignore_eos": True})
            assert r.json()["usage"]["completion_tokens"] == 4
            assert r.json()["choices"][0]["stop_reason"] is None  # the length ended it
            r = await http.post(url, json={"prompt": [1, 2], "max_tokens": 8, "stop_token_ids": [5]})
            choice = r.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("de", "stop", 5)
            m = parse_metrics((await http.get("/metrics")).text)
            assert m['eagle:http_requests_total{status="503"}'] == 2
            assert m["eagle:num_requests_running"] == 0

    try:
        asyncio.run(go())
        assert engine.thread.is_alive()
    finally:
        engine.stop()
    assert not engine.thread.is_alive()


def test_joining_requests_share_one_prefill_and_a_failing_one_fails_alone():
    from eagle_infer.server import Engine, Job, Metrics

    async def serve(prompts: list[list[int]]) -> tuple[list[int], list[str]]:
        dec = FakeDecoder(max_batch=4)
        engine = Engine(dec, FakeTokenizer(), Metrics(1), speculative=True)
        loop = asyncio.get_running_loop()
        jobs = [Job(p, SamplingParams(), 3, [], {999}, FakeTokenizer(), loop) for p in prompts]
        for job in jobs:  # all queued before the engine starts: they join in its first iteration
            engine.submit(job)
        engine.start()
        try:
            outcomes = [await job_text(job) for job in jobs]
        finally:
            engine.stop()
        return dec.joined, outcomes

    joined, outcomes = asyncio.run(serve([[1, 2], [3, 4], [5, 6]]))
    assert joined[0] == 3 and outcomes == ["def", "fgh", "hij"]
    # The batch with a prefill fault is retried one request at a time: only that one fails.
    joined, outcomes = asyncio.run(serve([[1, 2], [7, 1], [3, 4]]))
    assert joined[:2] == [1, 1] and outcomes == ["def", "error", "fgh"]


class FakeChunkingDecoder(FakeDecoder):
    """FakeDecoder with chunked prefill: a prompt's chunks counted per sequence; `log` records
    the chunks and joins in order."""

    def __init__(self, max_batch: int = 3):
        super().__init__(max_batch)
        self.rows, self.written, self.log = self, {}, []

    def left_to_prefill(self, seq: Sequence_) -> int:
        return len(seq.prompt) - self.written.get(id(seq), 0)

    def prefill_chunk(self, seq: Sequence_, size: int) -> int:
        self.written[id(seq)] = self.written.get(id(seq), 0) + size
        self.log.append(("chunk", seq.prompt[0]))
        return self.written[id(seq)]

    def add_many(self, seqs: list[Sequence_]) -> None:
        self.log += [("join", s.prompt[0]) for s in seqs]
        super().add_many(seqs)

    def step(self):
        time.sleep(0.001)  # a round takes time: the running request outlasts the others' arrival
        return super().step()


def test_short_prompts_join_past_a_prompt_prefilled_in_chunks():
    """Chunked prefill: while a long prompt is written a chunk between rounds, a short prompt
    queued behind it joins at once (before the iteration's chunk; it need not wait for every
    chunk), a second long one waits for the first's join, and the chunked prompt's row is left
    free for it (joins stop a row short). Every request answers."""
    from eagle_infer.server import Engine, Job, Metrics

    async def serve() -> tuple[FakeChunkingDecoder, list[str]]:
        dec = FakeChunkingDecoder(max_batch=3)
        engine = Engine(dec, FakeTokenizer(), Metrics(1), speculative=True, prefix_caching=True,
                        chunked_prefill_size=4)
        loop = asyncio.get_running_loop()

        def job(prompt: list[int], n: int) -> Job:
            return Job(prompt, SamplingParams(), n, [], {999}, FakeTokenizer(), loop)

        running = job([1, 2], 100_000)  # cancelled at the end
        engine.submit(running)
        engine.start()
        await asyncio.wait_for(running.events.get(), 10)  # decoding
        jobs = [job([20] + [5] * 12, 3), job([30, 3], 3), job([40] + [5] * 12, 3), job([50, 3], 3)]
        for j in jobs:
            engine.submit(j)
        try:
            texts = [await job_text(j) for j in jobs]
            assert not running.finished
            engine.cancel(running)
        finally:
            engine.stop()
        return dec, texts

    dec, texts = asyncio.run(serve())
    log = dec.log
    assert all(texts) and "error" not in texts, texts
    # the short 30 joins before the long 20's chunks are done (a FIFO queue held it behind 20's
    # join); the long 40 is chunked only after 20's last chunk and joins after it; the short 50
    # joins before 40 does
    last_chunk_20 = len(log) - 1 - log[::-1].index(("chunk", 20))
    assert log.index(("join", 30)) < last_chunk_20 < log.index(("join", 20)), log
    assert last_chunk_20 < log.index(("chunk", 40)) < log.index(("join", 40)), log
    assert log.index(("join", 20)) < log.index(("join", 40)) and log.count(("chunk", 40)) == 3, log
    assert log.count(("chunk", 20)) == 3 and log.index(("join", 50)) < log.index(("join", 40)), log


def test_a_long_prompt_arriving_with_short_ones_is_chunked_while_they_decode():
    """With nothing running, a long prompt and short ones arriving together: the short ones join
    at once and the long one is written in chunks while they decode (it joined whole with them
    before, their first tokens waiting for its prefill); a long prompt alone joins whole."""
    from eagle_infer.server import Engine, Job, Metrics

    async def serve(prompts: list[list[int]]) -> list[tuple[str, int]]:
        dec = FakeChunkingDecoder(max_batch=3)
        engine = Engine(dec, FakeTokenizer(), Metrics(1), speculative=True, prefix_caching=True,
                        chunked_prefill_size=4)
        loop = asyncio.get_running_loop()
        jobs = [Job(p, SamplingParams(), 3, [], {999}, FakeTokenizer(), loop) for p in prompts]
        for job in jobs:  # queued before the engine starts: admitted together
            engine.submit(job)
        engine.start()
        try:
            assert "error" not in [await job_text(job) for job in jobs]
        finally:
            engine.stop()
        return dec.log

    log = asyncio.run(serve([[60] + [5] * 12, [70, 3]]))
    assert log[0] == ("join", 70) and log.count(("chunk", 60)) >= 1, log
    assert log.index(("chunk", 60)) < log.index(("join", 60)), log
    assert asyncio.run(serve([[60] + [5] * 12])) == [("join", 60)]


def test_a_waiting_request_cancelled_reaches_the_decoder_and_never_joins():
    """A request cancelled while it waits is dropped from the queue and handed to the decoder's
    cancel too (a prompt prefilled in chunks holds a pinned row until its request goes); the
    running one answers in full."""
    from eagle_infer.server import Engine, Job, Metrics

    async def serve() -> tuple[FakeDecoder, str, Job]:
        dec = FakeDecoder(max_batch=1)
        engine = Engine(dec, FakeTokenizer(), Metrics(1), speculative=True)
        loop = asyncio.get_running_loop()
        running, waiting = (Job(p, SamplingParams(), 4, [], {999}, FakeTokenizer(), loop)
                            for p in ([1, 2], [3, 4]))
        engine.submit(running)
        engine.submit(waiting)
        engine.cancel(waiting)
        engine.start()
        try:
            text = await job_text(running)
        finally:
            engine.stop()
        return dec, text, waiting

    dec, text, waiting = asyncio.run(serve())
    assert text == "defg" and dec.cancelled == [waiting.seq] and dec.joined == [1]
    assert waiting.cancelled and waiting.events.empty()


def test_a_job_that_does_not_stream_pushes_its_answer_once():
    """Without streaming the engine thread pushes one event, the whole answer (each push wakes the
    event loop mid-round); streaming, a piece per token, the same text; with --stream-interval N
    the first token's piece at once, then a piece every N tokens, and the rest at the end."""
    from eagle_infer.server import Engine, Job, Metrics

    async def serve(stream: bool, interval: int = 1) -> list[dict]:
        engine = Engine(FakeDecoder(max_batch=2), FakeTokenizer(), Metrics(1), speculative=True)
        job = Job([1, 2], SamplingParams(), 8, [], {999}, FakeTokenizer(), asyncio.get_running_loop(),
                  stream=stream, stream_interval=interval)
        engine.submit(job)
        engine.start()
        try:
            events = [await asyncio.wait_for(job.events.get(), 10)]
            while "finish_reason" not in events[-1]:
                events.append(await asyncio.wait_for(job.events.get(), 10))
        finally:
            engine.stop()
        return events

    streamed, whole = asyncio.run(serve(True)), asyncio.run(serve(False))
    assert [e["delta"] for e in streamed] == list("defghijk") and len(whole) == 1, (streamed, whole)
    assert whole[0]["delta"] == "defghijk" and whole[0]["usage"]["completion_tokens"] == 8
    every3 = asyncio.run(serve(True, 3))
    assert [e["delta"] for e in every3] == ["d", "efg", "hij", "k"], every3
    assert every3[-1]["usage"]["completion_tokens"] == 8


def test_stop_prefix_len():
    from eagle_infer.server import stop_prefix_len

    assert stop_prefix_len("hello wor", ["world"]) == 3
    assert stop_prefix_len("hello", ["xyz"]) == 0
    assert stop_prefix_len("ab", ["abc", "bx"]) == 2


def test_vllm_flag_names_map_onto_ours(monkeypatch, tmp_path, capsys):
    """A vLLM command line's flags: --model, --max-model-len and --max-num-seqs name ours;
    --speculative-config's method, model and disable_by_batch_size set their flags and
    num_speculative_tokens K a chain of K drafts; --enforce-eager turns the compiled steps off;
    what they cannot mean here is refused by name."""
    from eagle_infer import server, server_flags
    from eagle_infer.errors import UserError

    monkeypatch.setenv("EAGLE_BF16_DOT", "fma")
    args = server.build_parser().parse_args(["--model", "/m", "--max-model-len", "4096",
                                             "--max-num-seqs", "4"])
    assert (args.model_path, args.context_length, args.max_running_requests) == ("/m", 4096, 4)
    head = tmp_path / "head"
    head.mkdir()

    def applied(conf: str, *flags: str):
        args = server.build_parser().parse_args(["--speculative-config", conf, *flags])
        server_flags.apply_speculative_config(args)
        return args

    args = applied(json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": 3,
                               "disable_by_batch_size": 2, "draft_tensor_parallel_size": 1}))
    assert server.resolve_draft(args) == ("EAGLE", head)
    assert server.resolve_tree(args, "cpu") == TreeConfig(3, 1, 4, ngram_branch=4)
    assert server.resolve_disable_by_batch_size(args, "cpu") == 2
    args = applied(json.dumps({"method": "EAGLE3", "model": str(head)}))  # no K: the default tree
    assert server.resolve_draft(args) == ("EAGLE3", head)
    assert server.resolve_tree(args, "cpu") == TreeConfig(2, 4, 4, ngram_branch=4)
    for conf, flags, error in (
            ({"method": "medusa", "num_speculative_tokens": 3}, (), "method 'medusa' is not served here"),
            ({"method": "eagle3", "top_k": 4}, (), "top_k not supported here"),
            ({"num_speculative_tokens": 0}, (), "num_speculative_tokens must be a positive integer"),
            ({"draft_tensor_parallel_size": 2}, (), "draft_tensor_parallel_size must be 1"),
            ({"num_speculative_tokens": 3}, ("--speculative-num-steps", "2"),
             "--speculative-config and --speculative-num-steps both given")):
        with pytest.raises(UserError, match=re.escape(error)):
            applied(json.dumps(conf), *flags)
    with pytest.raises(UserError, match="is for --speculative-algorithm NGRAM"):  # (test_ngram.py: ngram's)
        server.resolve_draft(applied(json.dumps({"method": "eagle3", "prompt_lookup_max": 4})))
    # vLLM 0.32's shorthand: --spec-method / --spec-model / --spec-tokens, and -sc
    short = server.build_parser().parse_args(["--spec-method", "eagle", "--spec-model", str(head),
                                              "--spec-tokens", "3"])
    server_flags.apply_speculative_config(short)
    assert server.resolve_draft(short) == ("EAGLE", head)
    assert server.resolve_tree(short, "cpu") == TreeConfig(3, 1, 4, ngram_branch=4)
    args = server.build_parser().parse_args(["-sc", json.dumps({"method": "eagle3", "model": str(head)})])
    server_flags.apply_speculative_config(args)
    assert server.resolve_draft(args) == ("EAGLE3", head)
    with pytest.raises(UserError, match="--speculative-config and --spec-method / --spec-model"):
        server_flags.apply_speculative_config(server.build_parser().parse_args(
            ["-sc", json.dumps({"method": "eagle3"}), "--spec-tokens", "2"]))
    for bad in ("{method: eagle3}", "[1]"):
        with pytest.raises(SystemExit):
            server.build_parser().parse_args(["--speculative-config", bad])
        assert "--speculative-config/-sc: not " in capsys.readouterr().err
    # --enforce-eager (or -O0): no compiled steps on either device; -tp above 1 refused; the rest accepted
    for flag in ("--enforce-eager", "-O0"):
        eager = server.build_parser().parse_args([flag, "--trust-remote-code", "--enable-prefix-caching",
                                                  "-tp", "1"])
        server.apply_vllm_flags(eager)
        assert server.compile_settings(eager, "cpu") is None
        assert server.compile_settings(eager, "cuda") is None
    optimized = server.build_parser().parse_args(["-O3"])
    server.apply_vllm_flags(optimized)
    assert server.compile_settings(optimized, "cpu") is not None
    assert eager.prefix_caching and server.compile_settings(server.build_parser().parse_args([]), "cpu")
    for flags, error in ((["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: one process"),
                         (["--enforce-eager", "--enable-torch-compile"], "--enforce-eager and --enable")):
        with pytest.raises(UserError, match=re.escape(error)):
            server.apply_vllm_flags(server.build_parser().parse_args(flags))


def test_more_vllm_and_sglang_flags_set_what_they_name(default_model_dir, tokenizer, caplog, capsys):
    """Flags a vLLM or SGLang command line brings: SGLang's parser names (qwen25, qwen, llama3,
    deepseek-r1) and --tp-size, --dtype in their spellings, several
    --served-model-name (the first answers), --tokenizer, --max-num-batched-tokens as the prefill
    chunk and --no-enable-chunked-prefill as none, --enable-log-requests a line per request,
    --gpu-memory-utilization accepted (said unused), --max-logprobs the alternatives a request may
    ask for (-1: the vocabulary), --response-role the role after a generation prompt (else the
    last message's, as vLLM), CORS for any origin as theirs; what does not
    fit is refused by name."""
    from eagle_infer import server
    from eagle_infer.errors import UserError
    from eagle_infer.server import ServerConfig

    def parse(*flags: str):
        return server.build_parser().parse_args(list(flags))

    sglang = parse("--tool-call-parser", "qwen25", "--reasoning-parser", "deepseek-r1", "--tp-size", "1",
                   "--enable-metrics")
    assert (sglang.tool_call_parser, sglang.reasoning_parser, sglang.tensor_parallel_size) == (
        "qwen25", "deepseek-r1", 1)
    from eagle_infer.reasoning import PARSERS as REASONING
    from eagle_infer.tool_calls import PARSERS as TOOLS

    assert TOOLS["qwen25"] is TOOLS["qwen"] is TOOLS["hermes"] and TOOLS["llama3"] is TOOLS["llama3_json"]
    assert REASONING["deepseek-r1"] is REASONING["deepseek_r1"]
    for given, ours in (("bfloat16", "bf16"), ("BF16", "bf16"), ("half", "fp16"), ("float16", "fp16"),
                        ("float", "fp32"), ("float32", "fp32"), ("auto", "auto")):
        assert parse("--dtype", given).dtype == ours
    with pytest.raises(SystemExit):
        parse("--dtype", "float8")
    assert "'float8' is not a dtype" in capsys.readouterr().err
    for flags, chunk in ((["--max-num-batched-tokens", "64"], 64), (["--no-enable-chunked-prefill"], 0),
                         (["--enable-chunked-prefill"], None), ([], None)):
        args = parse(*flags)
        server.apply_vllm_flags(args)
        assert args.chunked_prefill_size == chunk, flags
    for flags, error in ((["--max-num-batched-tokens", "64", "--chunked-prefill-size", "32"], "both given"),
                         (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
                         (["--mem-fraction-static", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
                         (["--block-size", "0"], "--block-size must be > 0")):
        with pytest.raises(UserError, match=re.escape(error)):
            server.apply_vllm_flags(parse(*flags))

    caplog.set_level("INFO", logger="eagle_infer.server")
    args = parse("--model-path", str(default_model_dir), "--dtype", "float32", "--device", "cpu",
                 "--speculative-algorithm", "NONE", "--disable-torch-compile", "--context-length", "256",
                 "--served-model-name", "smol", "smol-alias", "--tokenizer", str(default_model_dir),
                 "--max-num-batched-tokens", "64", "--gpu-memory-utilization", "0.9", "--enable-log-requests",
                 "--max-logprobs", "-1", "--page-size", "16", "--swap-space", "4",
                 "--reasoning-parser", "deepseek_r1",
                 "--chat-template", "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}"
                 "{% endfor %}")
    engine, _, _, cfg = server.build_engine(args)
    assert "chat template content format: openai" in caplog.text  # auto: the template loops over parts
    # SmolLM2 never thinks: neither its template nor its vocabulary has </think>
    assert "deepseek_r1: neither the chat template nor the vocabulary knows </think>" in caplog.text
    assert cfg.flags["reasoning_parser"] == "deepseek_r1"
    assert cfg.flags["model_path"] == str(default_model_dir)  # /get_server_info's flags, resolved
    assert cfg.flags["speculative_algorithm"] == "NONE" and cfg.flags["device"] == "cpu"
    assert cfg.model_names[:2] == ["smol", "smol-alias"] and engine.metrics.model_name == "smol"
    assert cfg.listed == 2  # /v1/models lists both, as vLLM (below)
    assert cfg.max_logprobs == engine.dec.target.config.vocab_size  # -1: the vocabulary
    assert engine.chunk == 64 and cfg.log_requests and cfg.allowed_origins == ["*"]
    assert "--gpu-memory-utilization: not used here" in caplog.text
    assert "--block-size: not used here" in caplog.text and "--swap-space: not used here" in caplog.text
    del engine
    with pytest.raises(UserError, match="--tokenizer /nowhere: no such folder"):
        server.build_engine(parse("--tokenizer", "/nowhere", "--device", "cpu"))

    engine, app = scripted_app(tokenizer, "Hi.", ServerConfig(
        ["smol", "smol-alias", "/m"], None, 2048, len(tokenizer), log_requests=True, listed=2, max_logprobs=2,
        response_role="bot"))

    async def ask() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            web = {"Origin": "https://ui.example"}
            preflight = await http.options("/v1/chat/completions", headers=web | {
                "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
            chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 5,
                    "seed": 3}
            answer = await http.post("/v1/chat/completions", headers=web, json=chat | {"model": "/m"})
            too_many = await http.post("/v1/chat/completions",
                                       json=chat | {"logprobs": True, "top_logprobs": 3})
            assert too_many.status_code == 400 and "top_logprobs must be in [0, 2]" in too_many.text
            streamed = await http.post("/v1/chat/completions", json=chat | {"stream": True})
            first = json.loads(streamed.text.split("data: ", 2)[1].split("\n")[0])
            assert first["choices"][0]["delta"]["role"] == "bot"  # --response-role, streamed too
            go_on = {"messages": chat["messages"] + [{"role": "assistant", "content": "Hel"}],
                     "max_tokens": 3, "add_generation_prompt": False, "continue_final_message": True}
            continued = (await http.post("/v1/chat/completions", json=go_on)).json()
            assert continued["choices"][0]["message"]["role"] == "assistant"  # the last message's
            return preflight, answer, await http.get("/v1/models")

    engine.start()
    try:
        preflight, answer, models = asyncio.run(ask())
    finally:
        engine.stop()
    assert preflight.status_code == 200 and answer.status_code == 200, (preflight.text, answer.text)
    assert answer.headers["access-control-allow-origin"] == "*" and answer.json()["model"] == "smol"
    assert answer.json()["choices"][0]["message"]["role"] == "bot"
    assert [m["id"] for m in models.json()["data"]] == ["smol", "smol-alias"]
    logged = r"request: 1 prompt\(s\) of \[\d+\] tokens, n=1, max_tokens \[5\], temperature 0.0.*seed 3"
    assert re.search(logged, caplog.text)


def test_missing_default_head_falls_back_to_plain_explicit_paths_must_exist(monkeypatch, tmp_path, caplog):
    from eagle_infer import server
    from eagle_infer.errors import UserError

    monkeypatch.setattr(server, "DEFAULT_HEAD", tmp_path / "missing-head")
    args = server.build_parser().parse_args([])
    assert (args.host, args.port, args.context_length, args.max_running_requests) == (
        "127.0.0.1", 30000, 2048, 8)
    assert args.dtype == "auto"
    # No tree flag: the device's tree; a flag given overrides only its own field.
    assert server.resolve_tree(args, "cuda") == TreeConfig(5, 4, 16)
    assert server.resolve_tree(args, "cpu") == TreeConfig(2, 4, 4, ngram_branch=4)  # fp32
    from eagle_infer.kernels import bf16_linear

    monkeypatch.setattr(bf16_linear, "avx512_bf16_supported", lambda: False)  # AVX2: a verify's rows dearer
    monkeypatch.setattr(bf16_linear, "fma_halves", lambda: False)
    assert server.resolve_tree(args, "cpu", "bf16") == TreeConfig(1, 4, 4, ngram_branch=4)
    monkeypatch.setattr(bf16_linear, "fma_halves", lambda: True)  # Zen 1: dearer still
    assert server.resolve_tree(args, "cpu", "bf16") == TreeConfig(1, 4, 2, ngram_branch=4)
    assert server.resolve_tree(args, "cpu", "fp32") == TreeConfig(2, 4, 4, ngram_branch=4)
    int8_args = server.build_parser().parse_args(["--quantization", "int8"])
    assert server.resolve_tree(int8_args, "cpu", "bf16") == TreeConfig(1, 4, 2, ngram_branch=4)
    assert server.resolve_tree(int8_args, "cpu", "fp32") == TreeConfig(1, 4, 3, ngram_branch=4)
    monkeypatch.setattr(bf16_linear, "avx512_bf16_supported", lambda: True)
    int8 = server.build_parser().parse_args(["--quantization", "int8"])
    monkeypatch.setenv("EAGLE_BF16_DOT", "vdpbf16ps")  # the tree follows the multiply
    assert server.resolve_tree(args, "cpu", "bf16") == TreeConfig(2, 4, 6, ngram_branch=4)
    assert server.resolve_tree(int8, "cpu", "bf16") == TreeConfig(1, 4, 3, ngram_branch=4)
    monkeypatch.setenv("EAGLE_BF16_DOT", "amx")  # a verify's rows cheap on the tiles (two panels in bf16)
    assert server.resolve_tree(args, "cpu", "bf16") == TreeConfig(2, 4, 8, ngram_branch=6)
    assert server.resolve_tree(int8, "cpu", "bf16") == TreeConfig(2, 4, 6, ngram_branch=4)
    assert server.resolve_tree(int8, "cpu", "fp32") == TreeConfig(1, 4, 3, ngram_branch=4)  # not ours
    # --help names every default (TreeConfig.cpu_defaults_text, from the same table)
    help_text = " ".join(server.build_parser().format_help().split())
    assert "2/4/6+g4 (2/4/8+g6 on AMX, 1/4/4+g4 on AVX2 only, 1/4/2+g4 on AMD Zen 1)" in help_text
    for kernel in ("fma", "vdpbf16ps", "amx", "avx2", "avx2_128"):
        for dtype, quantization in (("bf16", "none"), ("fp32", "none"), ("bf16", "int8")):
            assert TreeConfig.cpu_default(dtype, quantization, kernel).label() in help_text
    monkeypatch.setenv("EAGLE_BF16_DOT", "fma")
    one = server.build_parser().parse_args(["--speculative-num-draft-tokens", "8"])
    assert server.resolve_tree(one, "cpu") == TreeConfig(2, 4, 8, ngram_branch=4)
    off = server.build_parser().parse_args(["--speculative-ngram-branch", "0"])
    assert server.resolve_tree(off, "cpu", "bf16") == TreeConfig(2, 4, 6)
    gpu = server.build_parser().parse_args(["--speculative-ngram-branch", "6"])
    assert server.resolve_tree(gpu, "cuda") == TreeConfig(5, 4, 16, ngram_branch=6)
    # Rounds without drafts above 2 running requests on a CPU (1 with int8 weights), never on a GPU
    assert server.resolve_disable_by_batch_size(args, "cpu") == 2
    assert server.resolve_disable_by_batch_size(args, "cuda") is None
    int8 = server.build_parser().parse_args(["--quantization", "int8"])
    assert server.resolve_disable_by_batch_size(int8, "cpu") == 1
    assert server.resolve_tree(int8, "cpu") == TreeConfig(1, 4, 3, ngram_branch=4)  # int8: one step
    assert server.resolve_tree(int8, "cuda") == TreeConfig(5, 4, 16)
    given = server.build_parser().parse_args(["--speculative-disable-by-batch-size", "8"])
    assert server.resolve_disable_by_batch_size(given, "cpu") == 8
    assert server.resolve_disable_by_batch_size(given, "cuda") == 8
    # A tree that shrinks as the batch grows: by default in bf16 where the kernel multiplies on AMX
    # tiles (int8 weights too) or on vdpbf16ps (bf16 weights), speculating then up to 4 requests;
    # "none" turns it off, a flag gives another
    small = (3, TreeConfig(1, 4, 3, ngram_branch=4))
    dot = (3, TreeConfig(1, 4, 2, ngram_branch=4))
    for multiply, bf16_tree, int8_tree in (("amx", small, (2, small[1])), ("fma", None, None),
                                           ("vdpbf16ps", dot, None)):
        monkeypatch.setenv("EAGLE_BF16_DOT", multiply)
        assert server.resolve_batch_tree(args, "cpu", "bf16") == bf16_tree
        assert server.resolve_batch_tree(int8, "cpu", "bf16") == int8_tree
        assert server.resolve_batch_tree(args, "cpu", "fp32") is None
        assert server.resolve_batch_tree(int8, "cpu", "fp32") is None  # torch's int8 kernel
        assert server.resolve_batch_tree(args, "cuda", "bf16") is None
    assert server.resolve_disable_by_batch_size(args, "cpu", small) == 4
    assert server.resolve_disable_by_batch_size(given, "cpu", small) == 8
    off = server.build_parser().parse_args(["--speculative-batch-tree", "none"])
    assert server.resolve_batch_tree(off, "cpu", "bf16") is None
    other = server.build_parser().parse_args(["--speculative-batch-tree", "5:1/2/2"])
    assert server.resolve_batch_tree(other, "cuda", "fp32") == (5, TreeConfig(1, 2, 2))
    assert server.resolve_disable_by_batch_size(args, "cpu", (5, TreeConfig(1, 2, 2))) == 5
    with pytest.raises(UserError, match="num_steps >= 1"):
        server.resolve_tree(server.build_parser().parse_args(["--speculative-num-steps", "0"]), "cpu")
    with caplog.at_level("WARNING"):
        assert server.resolve_draft(args) == ("NONE", None)
    assert "missing" in caplog.text
    with pytest.raises(UserError, match="not found"):
        server.resolve_draft(server.build_parser().parse_args(
            ["--speculative-draft-model-path", str(tmp_path / "nope")]))
    with pytest.raises(UserError, match="needs --speculative-draft-model-path"):
        server.resolve_draft(server.build_parser().parse_args(["--speculative-algorithm", "EAGLE3"]))
    (tmp_path / "missing-head").mkdir()
    assert server.resolve_draft(server.build_parser().parse_args([]))[0] == "EAGLE3"


# test_first_start_compiles_every_other_batch_bucket_in_a_helper's server side, in a fresh
# process as a server starts (until the fused layers' stack id became a graph input, a worker that
# had loaded other tests' targets baked another id into its graphs and missed the helper's cache).
FIRST_START = """
import json, logging, sys
from torch._dynamo.utils import counters
from eagle_infer import cpu_linears, server
from eagle_infer.sampling import SamplingParams
from eagle_infer.speculative import Sequence_

lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("eagle_infer.server").addHandler(handler)
logging.getLogger("eagle_infer.server").setLevel(logging.INFO)

def decode(dec):  # two prompts at once: batch 2
    seqs = [Sequence_([1, 2, 3, 4, 5 + i], SamplingParams(), 8, set()) for i in range(2)]
    dec.add_many(seqs)
    while dec.seqs:
        dec.step()
    return [s.output for s in seqs]

def helper_lines():
    return [line for line in lines if "helper" in line]

flags = sys.argv[1:]
args = server.build_parser().parse_args(flags + ["--torch-compile-max-bs", "2"])
out = {"marker_before": server.warmed_marker(args).exists()}
dec = server.build_engine(args, warm=True)[0].dec
out |= {"first": helper_lines(), "inductor": dict(counters["inductor"]),
        "marker_after": server.warmed_marker(args).exists(), "compiled": decode(dec)}
lines.clear()
server.warm_up_beside_a_helper(args, dec, None, lambda *_: None)  # a later start
out["later"] = helper_lines()
lines.clear()
server.warmed_marker(args).unlink()  # a first start again, without the memory for a second decoder
available, cpu_linears.available_memory_bytes = cpu_linears.available_memory_bytes, lambda: 0
server.warm_up_beside_a_helper(args, dec, None, lambda *_: None)
out["no_memory"] = helper_lines()
cpu_linears.available_memory_bytes = available  # it also picks the Linears of the model loaded next
eager = server.build_engine(server.build_parser().parse_args(flags + ["--disable-torch-compile"]))[0].dec
print(json.dumps(out | {"eager": decode(eager)}))
"""


def test_first_start_compiles_every_other_batch_bucket_in_a_helper(default_model_dir, tmp_path):
    """A first start (an empty compile cache) compiles batch bucket 2 in a helper process while
    it compiles bucket 1, then takes bucket 2's graphs from the cache the helper filled, and
    leaves a marker: a later start with the same flags warms up alone, and so does a start
    without the memory for the helper's decoder. The compiled steps decode as the eager ones."""
    import os
    import subprocess
    import sys

    from eagle_infer.launch import REPO

    flags = ["--model-path", str(default_model_dir), "--dtype", "bf16", "--device", "cpu",
             "--speculative-algorithm", "NONE", "--max-running-requests", "2", "--context-length", "256"]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))  # cold; the helper inherits it
    run = subprocess.run([sys.executable, "-c", FIRST_START, *flags], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert not out["marker_before"] and out["marker_after"]
    assert out["first"] == ["batch sizes [2] compile in a helper process meanwhile"], out
    # bucket 1's two graphs (greedy, sampled) compiled here, bucket 2's read from the helper's
    assert (out["inductor"]["fxgraph_cache_miss"], out["inductor"]["fxgraph_cache_hit"]) == (2, 2), out
    assert out["later"] == []
    (line,) = out["no_memory"]
    assert line.startswith("no compile helper: 0.0 GB of memory available, a second decoder wants"), line
    assert out["compiled"] == out["eager"]


def test_compile_flags_reach_the_decoder(default_model_dir):
    """SGLang's flags: CUDA graphs unless --disable-cuda-graph (up to --cuda-graph-max-bs), and
    torch.compile on a CPU unless --disable-torch-compile, elsewhere where --enable-torch-compile
    asks (up to --torch-compile-max-bs: on a CPU 1 by default); the decoder the server builds is
    the compiled one, its cache sized for the padded bucket."""
    from eagle_infer import server
    from eagle_infer.errors import UserError

    def parse(*flags: str):
        return server.build_parser().parse_args(list(flags))

    assert server.compile_settings(parse(), "cpu") == (None, 1)
    assert server.compile_settings(parse("--disable-torch-compile"), "cpu") is None
    assert server.compile_settings(parse(), "cuda") == ("reduce-overhead", None)
    assert server.compile_settings(parse("--cuda-graph-max-bs", "4"), "cuda") == ("reduce-overhead", 4)
    assert server.compile_settings(parse("--disable-cuda-graph"), "cuda") is None
    compiled = parse("--disable-cuda-graph", "--enable-torch-compile")
    assert server.compile_settings(compiled, "cuda") == (None, None)
    capped = parse("--enable-torch-compile", "--torch-compile-max-bs", "2")
    assert server.compile_settings(capped, "cpu") == (None, 2)
    shrinking = (3, TreeConfig(1, 4, 3, ngram_branch=4))  # a batch tree: compiled up to 8
    assert server.compile_settings(parse(), "cpu", shrinking) == (None, 8)
    assert server.compile_settings(capped, "cpu", shrinking) == (None, 2)
    assert server.compile_settings(parse(), "cuda", shrinking) == ("reduce-overhead", None)
    base = ["--model-path", str(default_model_dir), "--dtype", "fp32", "--device", "cpu",
            "--max-running-requests", "3", "--context-length", "256"]
    def decoder(algo: str, *flags: str):
        gc.collect()  # the last one's model (in reference cycles): 1.6 GB each, 16 built here
        return server.build_engine(parse(*base, "--speculative-algorithm", algo, *flags))[0].dec

    for algo in ("NONE", "EAGLE3"):
        assert not decoder(algo, "--disable-torch-compile").compiled
        for flag in ("--disable-radix-cache", "--no-enable-prefix-caching"):  # SGLang's, vLLM's
            assert decoder(algo, "--disable-torch-compile", flag).rows.prefix is None
        eager = [*base, "--speculative-algorithm", algo, "--disable-torch-compile"]
        assert server.build_engine(parse(*eager))[0].chunk == 256  # a CPU's default chunk
        assert server.build_engine(parse(*eager, "--chunked-prefill-size", "-1"))[0].chunk == 0
        default = decoder(algo)
        assert default.rows.prefix is not None and default.rows.prefix.lookahead == (algo == "EAGLE3")
        assert default.compiled and default.max_bs == 1 and default.target.cache.kv.shape[2] == 3
        assert getattr(default, "disable_by_batch_size", None) == (2 if algo == "EAGLE3" else None)
        del default  # one server's model at a time (decoder collects the last)
        dec = decoder(algo, "--torch-compile-max-bs", "4")
        assert dec.compiled and dec.max_bs == 4 and dec.target.cache.kv.shape[2] == 4
        del dec
        capped = decoder(algo, "--enable-torch-compile", "--torch-compile-max-bs", "2")
        assert capped.max_bs == 2 and capped.target.cache.kv.shape[2] == 3
        del capped
    shrinking = decoder("EAGLE3", "--disable-torch-compile", "--speculative-batch-tree", "2:1/4/3+g4")
    assert shrinking.batch_tree == (2, TreeConfig(1, 4, 3, ngram_branch=4))
    assert shrinking.tree_for(1) is shrinking.tree and shrinking.max_pending == shrinking.tree.slots_past_end
    with pytest.raises(UserError, match="a batch tree is MIN_BATCH:TREE"):
        decoder("EAGLE3", "--disable-torch-compile", "--speculative-batch-tree", "1/4/3")
    with pytest.raises(UserError, match="--torch-compile-max-bs must be >= 1"):
        decoder("NONE", "--enable-torch-compile", "--torch-compile-max-bs", "0")
    with pytest.raises(UserError, match="--speculative-disable-by-batch-size must be >= 0"):
        decoder("EAGLE3", "--speculative-disable-by-batch-size", "-1")


@pytest.fixture
def one_thread():
    """Tiny models: threads only add latency (and thrash on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_target() -> Transformer:
    cfg = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128, eos_token_ids=[])
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.eval().requires_grad_(False)


def test_plain_decoder_joins_and_leaves_and_matches_generate(one_thread):
    from eagle_infer.engine import PlainDecoder

    model = tiny_target()
    jobs = [([5, 6, 7], 6, SamplingParams()), ([9] * 10, 12, SamplingParams()),
            ([3, 4], 3, SamplingParams(0.8, seed=3)), (list(range(20, 40)), 9, SamplingParams()),
            ([11], 1, SamplingParams())]
    ref = [generate(model, [p], n, params, eos_token_ids=[])[0] for p, n, params in jobs]
    dec = PlainDecoder(model, max_batch=2, max_seq_len=64)
    seqs = [Sequence_(p, params, n, set()) for p, n, params in jobs]
    waiting = list(seqs)
    while waiting or dec.seqs:
        while waiting and dec.free_rows:
            dec.add(waiting.pop(0))
        dec.step()
    assert [s.output for s in seqs] == ref
    assert all(s.finish_reason == "length" for s in seqs)
    # Sequences joining together (prompts of different lengths) share one prefill: same outputs.
    together = PlainDecoder(model, max_batch=4, max_seq_len=64)
    seqs = [Sequence_(p, params, n, set()) for p, n, params in jobs[:4]]
    together.add_many(seqs)
    while together.seqs:
        together.step()
    assert [s.output for s in seqs] == ref[:4]
    # Cancel frees the row at once and leaves the other sequence untouched.
    a, b = (Sequence_(p, SamplingParams(), 6, set()) for p in ([5, 6, 7], [9] * 10))
    dec.add(a)
    dec.add(b)
    dec.step()
    dec.cancel(a)
    assert dec.free_rows == 1 and a.finish_reason == "abort"
    while dec.seqs:
        dec.step()
    assert b.output == ref[1][:6]


def test_incremental_detokenizer_equals_a_full_decode_at_bounded_cost(tokenizer):
    import random

    from eagle_infer.detokenize import IncrementalDetokenizer

    # Multi-byte characters split over tokens, special tokens, random ids (invalid UTF-8 too).
    base = tokenizer("Hello , world . 你好 🦅 don't <|im_end|> été ok\n\n  x")["input_ids"]
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.choice(base) if rng.random() < 0.7 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(1, 40))]
        d = IncrementalDetokenizer(tokenizer)
        streamed = "".join(d.add(t) for t in ids) + d.flush()
        assert streamed == d.text == tokenizer.decode(ids, skip_special_tokens=True)
        assert d.offsets == sorted(d.offsets) and len(d.offsets) == len(ids)

    class Counting:  # counts the token ids decoded: linear in the output, not quadratic
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.decoded += len(ids)
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    d = IncrementalDetokenizer(Counting())
    long = base * 100  # ~2,000 tokens
    for t in long:
        d.add(t)
    d.flush()
    assert d.text == tokenizer.decode(long, skip_special_tokens=True)
    assert Counting.decoded < 10 * len(long), Counting.decoded


def test_seed_seeds_unseeded_sampling_when_serving_starts(monkeypatch, tokenizer):
    """--seed (vLLM's; SGLang's --random-seed): the generator that requests without a seed sample
    from is seeded when serving starts, after the warm-up's draws, so two fresh servers answer an
    unseeded sampled request alike; uvicorn gets --uvicorn-log-level and --root-path."""
    import uvicorn

    from eagle_infer import server
    from eagle_infer.server import Engine, Metrics, ServerConfig

    eos = tokenizer.eos_token_id

    def build(args, warm):
        torch.rand(3)  # the warm-up's sampled requests draw from the same generator
        engine = Engine(ScriptedDecoder([eos]), tokenizer, Metrics(1), speculative=True)
        return engine, tokenizer, {eos}, ServerConfig(["m"], None, 2048, len(tokenizer))

    served = []

    def run(self):  # uvicorn.Server.run: what the first request would draw, and uvicorn's settings
        served.append((torch.rand(1).item(), self.config.log_level, self.config.root_path))

    monkeypatch.setattr(server, "build_engine", build)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr(server.gc, "freeze", lambda: None)  # not this test process's objects
    monkeypatch.setattr(server.signal, "signal", lambda *a: None)  # nor its signal handlers
    flags = ["--seed", "7", "--uvicorn-log-level", "warning", "--root-path", "/api"]
    server.main(flags)
    server.main(["--random-seed", "7"])
    server.main([])
    torch.manual_seed(7)
    want = torch.rand(1).item()
    assert served[0] == (want, "warning", "/api") and served[1][0] == want
    assert served[2][0] != want and served[2][1:] == ("info", "")


def test_the_model_loads_in_a_thread_that_exits(monkeypatch, capsys):
    """main() builds (and warms up) the engine in a thread of its own that is gone before serving
    starts (an OpenMP team left behind in the main thread slows the engine thread's steps), and an
    error raised there still reaches the command line as one line."""
    from eagle_infer import server
    from eagle_infer.errors import UserError

    seen = []

    def failing_build(args, warm):
        seen.append((threading.current_thread(), warm))
        raise UserError("no such model: /nowhere")

    monkeypatch.setattr(server, "build_engine", failing_build)
    with pytest.raises(SystemExit) as exit_info:
        server.main(["--model-path", "/nowhere"])
    assert exit_info.value.code == 2
    assert "error: no such model: /nowhere" in capsys.readouterr().err
    ((loader, warm),) = seen
    assert loader is not threading.main_thread() and not loader.is_alive()
    assert warm  # compiled steps warm up there too, before serving (engine.warm_up)
    assert server.in_own_thread(lambda a, b: a + b, 2, 3) == 5
