"""SGLang's native /generate (and /get_model_info, /health_generate) on an in-process server whose
answers are scripted (the real tokenizer); the real engine's answers and log-probs through it:
test_openai_conformance."""

import json

import httpx
from test_server import in_process, scripted_app

ANSWER = "Paris is the capital. It is large."


def ask(tokenizer, requests: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
    """(method, path, body) each on an in-process server answering ANSWER (then EOS)."""
    from eagle_infer.server import ServerConfig

    engine, app = scripted_app(tokenizer, ANSWER, ServerConfig(["m"], None, 2048, len(tokenizer)))
    return in_process(engine, app, requests)


def test_generate_answers_as_sglang_whole_batched_and_streamed(tokenizer):
    """text or input_ids, one or a batch: {text, output_ids, meta_info} with SGLang's finish_reason
    (stop: the EOS or stop string matched; length: the count), token counts and spec_verify_ct (the
    rounds); streamed: each piece the text and output_ids so far, the last with its finish_reason,
    then [DONE]."""
    eos = tokenizer.eos_token_id
    answer_ids = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [eos]
    prompt = "The capital of France?"
    ids = tokenizer(prompt)["input_ids"]
    greedy = {"temperature": 0, "max_new_tokens": 64}
    one, batch, by_ids, cut, stopped, streamed = ask(tokenizer, [
        ("POST", "/generate", {"text": prompt, "sampling_params": greedy}),
        ("POST", "/generate", {"text": [prompt, "Hi"], "sampling_params": greedy}),
        ("PUT", "/generate", {"input_ids": ids, "sampling_params": greedy}),
        ("POST", "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 3}}),
        ("POST", "/generate", {"text": prompt, "sampling_params": greedy | {"stop": ["capital", "zz"]}}),
        ("POST", "/generate", {"text": prompt, "sampling_params": greedy, "stream": True})])
    out = one.json()
    assert out["text"] == ANSWER and out["output_ids"] == answer_ids
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": eos}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), len(answer_ids))
    assert meta["spec_verify_ct"] > 0 and meta["e2e_latency"] > 0
    assert [o["text"] for o in batch.json()] == [ANSWER, ANSWER]
    assert by_ids.json()["text"] == ANSWER and by_ids.json()["meta_info"]["prompt_tokens"] == len(ids)
    assert cut.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert len(cut.json()["output_ids"]) == 3
    assert stopped.json()["text"] == "Paris is the "
    assert stopped.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": "capital"}
    lines = [ln[len("data: "):] for ln in streamed.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    pieces = [json.loads(x) for x in lines[:-1]]
    texts = [p["text"] for p in pieces]
    assert texts[-1] == ANSWER and all(ANSWER.startswith(t) for t in texts) and len(pieces) > 2
    assert all(p["meta_info"]["finish_reason"] is None for p in pieces[:-1])
    assert pieces[-1]["meta_info"]["finish_reason"] == meta["finish_reason"]
    assert pieces[-1]["output_ids"] == answer_ids
    ids_so_far = [p["output_ids"] for p in pieces]
    assert all(a == b[:len(a)] for a, b in zip(ids_so_far, ids_so_far[1:]))
    assert len(ids_so_far[0]) < len(answer_ids)
    assert all(tokenizer.decode(p["output_ids"], skip_special_tokens=True) == p["text"] for p in pieces)


def test_generate_refuses_what_it_cannot_do_and_the_info_routes(tokenizer):
    """Both text and input_ids, a sampling key unknown here, sampling params listed for another
    number of prompts, a batch whose prompts ask for different n, the prompt's log-probs streamed:
    400s in SGLang's error shape; /get_model_info and /health_generate answer."""
    bad = [{"text": "a", "input_ids": [1]}, {"text": "a", "sampling_params": {"beam_width": 2}},
           {"text": ["a", "b"], "sampling_params": [{"temperature": 0}]},
           {"text": "a", "sampling_params": {"json_schema": "{not json"}},
           {"text": "a", "stream": True, "return_logprob": True, "logprob_start_len": 0},
           {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 1}]},
           {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}, {"beam_width": 2}]}]
    *refused, info, health = ask(tokenizer, [("POST", "/generate", b) for b in bad]
                                 + [("GET", "/get_model_info", None), ("GET", "/health_generate", None)])
    assert [r.status_code for r in refused] == [400] * 7
    messages = [r.json()["error"]["message"] for r in refused]
    assert "text or input_ids" in messages[0] and "beam_width" in messages[1]
    assert "a list of 1 for 2 prompt(s)" in messages[2] and "json_schema" in messages[3]
    assert "logprob_start_len" in messages[4] and "stream" in messages[4]
    assert "n must be the same" in messages[5] and "beam_width" in messages[6]
    assert info.json()["is_generation"] is True and info.json()["served_model_name"] == "m"
    assert health.status_code == 200


def test_a_batchs_prompts_take_their_own_sampling_params(tokenizer):
    """sampling_params as a list, one set a prompt (SGLang's): each prompt's answer keeps to its
    own max_new_tokens and stop, whole and streamed, in the prompts' order; n answers a prompt
    where every set asks for that n."""
    eos = tokenizer.eos_token_id
    answer_ids = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [eos]
    own = [{"max_new_tokens": 2}, {"max_new_tokens": 64, "stop": ["capital"]}, {"max_new_tokens": 64}]
    whole, streamed, twice = ask(tokenizer, [
        ("POST", "/generate", {"text": ["a", "b", "c"], "sampling_params": own}),
        ("POST", "/generate", {"text": ["a", "b"], "sampling_params": own[:2], "stream": True}),
        ("POST", "/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2, "max_new_tokens": 1},
                                                                       {"n": 2, "max_new_tokens": 3}]})])
    first, second, third = whole.json()
    assert first["output_ids"] == answer_ids[:2] and first["meta_info"]["finish_reason"]["type"] == "length"
    assert second["text"] == "Paris is the " and second["meta_info"]["finish_reason"]["matched"] == "capital"
    assert third["text"] == ANSWER and third["output_ids"] == answer_ids
    pieces = [json.loads(ln[6:]) for ln in streamed.text.splitlines() if ln.startswith("data: {")]
    last = {p["index"]: p for p in pieces}
    assert last[0]["output_ids"] == answer_ids[:2] and last[1]["text"] == "Paris is the "
    assert [len(o["output_ids"]) for o in twice.json()] == [1, 1, 3, 3]


def test_get_server_info_reports_the_acceptance_length_until_a_flush(tokenizer):
    """/get_server_info (and /server_info): the flags given, context length, version and SGLang's
    internal_states; avg_spec_accept_length (the scripted rounds accept nothing: 1.0) once a
    request ran, forgotten by /flush_cache as SGLang's."""
    from eagle_infer.server import ServerConfig

    cfg = ServerConfig(["m"], None, 2048, len(tokenizer), flags={"model_path": "default", "api_key": "k"})
    engine, app = scripted_app(tokenizer, ANSWER, cfg)
    got = in_process(engine, app, [
        ("GET", "/get_server_info", None), ("POST", "/generate", {"text": "Hi"}),
        ("GET", "/get_server_info", None), ("GET", "/server_info", None), ("POST", "/flush_cache", None),
        ("GET", "/get_server_info", None)])
    before, after, alias, cleared = (got[i].json() for i in (0, 2, 3, 5))
    assert before["model_path"] == "default" and "api_key" not in before
    assert before["context_length"] == 2048 and before["version"]
    assert "avg_spec_accept_length" not in before["internal_states"][0]
    assert after["internal_states"][0]["avg_spec_accept_length"] == 1.0 and alias == after
    assert got[4].status_code == 200 and "avg_spec_accept_length" not in cleared["internal_states"][0]


def test_an_empty_batch_is_refused_and_rids_name_their_prompts_answers(tokenizer):
    """text [] (an empty batch) is a 400 in SGLang's shape; a list of rids names each prompt's
    answers, all n of them."""
    empty, rids = ask(tokenizer, [
        ("POST", "/generate", {"text": []}),
        ("POST", "/generate", {"text": ["a", "b"], "rid": ["r0", "r1"],
                               "sampling_params": {"n": 2, "max_new_tokens": 2}})])
    assert empty.status_code == 400 and "empty batch" in empty.json()["error"]["message"]
    assert [o["meta_info"]["id"] for o in rids.json()] == ["r0", "r0", "r1", "r1"]


def test_bench_apis_requests_are_answered_alike_by_every_api(tokenizer):
    """scripts/bench_apis.py's streamed requests (chat, Responses, Messages, /generate): each API
    accepts its body and streams an answer cut at the same max tokens (EOS ignored)."""
    from script_module import load_script

    bench = load_script("bench_apis")
    each = bench.requests_for("The capital of France?", "m", 5)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "The capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    each["generate"][1]["input_ids"] = tokenizer(prompt)["input_ids"]
    got = ask(tokenizer, [("POST", path, body) for path, body in each.values()])
    assert [r.status_code for r in got] == [200] * 4
    data = {api: [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
            for api, r in zip(each, got)}
    assert data["chat"][-1]["choices"][0]["finish_reason"] == "length"
    completed = data["responses"][-1]
    assert completed["type"] == "response.completed" and completed["response"]["usage"]["output_tokens"] == 5
    assert data["messages"][-2]["usage"]["output_tokens"] == 5
    assert data["messages"][-2]["delta"]["stop_reason"] == "max_tokens"
    assert data["generate"][-1]["meta_info"]["completion_tokens"] == 5
