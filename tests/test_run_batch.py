"""python -m eagle_infer.run_batch: OpenAI batch files (vLLM's run-batch) through the server's app
in-process, on the default target in fp32 with the shipped EAGLE-3 head (eager steps)."""

import json

import pytest

from eagle_infer.errors import UserError
from eagle_infer.generate import chat_prompt_ids, generate
from eagle_infer.run_batch import main, read_requests, results_so_far

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?"]


def batch_lines() -> list[dict]:
    chats = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": q}], "max_tokens": 16, "temperature": 0}}
             for i, q in enumerate(QUESTIONS)]
    return chats + [
        {"custom_id": "completion", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}},
        {"custom_id": "bad", "url": "/v1/chat/completions", "body": {"messages": "Hi"}},
        {"custom_id": "streamed", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "stream": True}},
        {"custom_id": "nowhere", "url": "/v1/nope", "body": {}},
        {"custom_id": "sglang", "url": "/generate",
         "body": {"text": "The sky is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}}]


def test_a_batch_answers_each_line_and_a_killed_run_resumes(default_model_dir, default_model_fp32, tokenizer,
                                                            tmp_path, capsys):
    """Every line gets one result line named by its custom_id: chat answers token-identical to
    plain greedy decoding (fp32), a bad body / a streamed request / an unknown route as their
    status with the error body (and `error`, vLLM's). Cut after four results (the last a server
    error) and half a line (a killed run), the run again keeps the first three as they were and
    writes the other five; a third run finds nothing to do."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in batch_lines()))
    flags = ["-i", str(src), "-o", str(out), "--model-path", str(default_model_dir), "--dtype", "float32",
             "--disable-torch-compile", "--max-running-requests", "2"]
    main(flags)
    assert "8 requests in" in capsys.readouterr().out
    lines = out.read_text().splitlines()
    results = {r["custom_id"]: r for r in map(json.loads, lines)}
    assert len(lines) == len(results) == 8
    status = {k: r["response"]["status_code"] for k, r in results.items()}
    assert status == {"chat-0": 200, "chat-1": 200, "chat-2": 200, "completion": 200, "bad": 400,
                      "streamed": 400, "nowhere": 404, "sglang": 200}
    for i, q in enumerate(QUESTIONS):
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": q}])
        want = tokenizer.decode(generate(default_model_fp32, [ids], 16)[0], skip_special_tokens=True)
        assert results[f"chat-{i}"]["response"]["body"]["choices"][0]["message"]["content"] == want
        assert results[f"chat-{i}"]["error"] is None
    bad = results["bad"]
    assert bad["error"]["param"] == "messages" == bad["response"]["body"]["error"]["param"]
    assert "stream" in results["streamed"]["error"]["message"]
    assert len(results["sglang"]["response"]["body"]["output_ids"]) == 4

    kept = lines[:3]
    failed = json.loads(lines[3])  # a server error (5xx) is run again, a client error (4xx) is not
    failed["response"]["status_code"] = 503
    out.write_text("\n".join([*kept, json.dumps(failed)]) + "\n" + lines[4][:40])  # killed mid-write
    main(flags)
    assert "5 requests in" in capsys.readouterr().out
    again = out.read_text().splitlines()
    assert again[:3] == kept and len(again) == 8
    assert {json.loads(x)["custom_id"] for x in again} == set(results)
    rerun = next(json.loads(x) for x in again if json.loads(x)["custom_id"] == failed["custom_id"])
    assert rerun["response"]["status_code"] == status[failed["custom_id"]]
    main(flags)
    assert "all 8 requests have results" in capsys.readouterr().out


@pytest.mark.parametrize("text, error", [
    ('{"custom_id": "a", "url": "/v1/completions", "body": {}}\n{not json\n', "in.jsonl:2: not JSON"),
    ('{"custom_id": "a", "url": "/v1/completions"}\n', "in.jsonl:1: missing body"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/models", "body": {}}\n', "only POST"),
    ('{"custom_id": "a", "url": "/x", "body": {}}\n\n{"custom_id": "a", "url": "/x", "body": {}}\n',
     "in.jsonl:3: custom_id 'a' is used twice"),
    ('[1, 2]\n', "in.jsonl:1: a request is an object")])
def test_a_bad_input_line_is_named_before_anything_runs(tmp_path, text, error):
    (tmp_path / "in.jsonl").write_text(text)
    with pytest.raises(UserError, match=error):
        read_requests(tmp_path / "in.jsonl")


def test_a_bad_flag_or_file_ends_with_one_error_line(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "url": "/x", "body": {}}\n')
    for src, flags, error in (("in.jsonl", ["--batch-concurrency", "0"], "--batch-concurrency must be >= 1"),
                              ("missing.jsonl", [], "missing.jsonl: no such file")):
        with pytest.raises(SystemExit) as stop:
            main(["-i", str(tmp_path / src), "-o", str(tmp_path / "out.jsonl"), *flags])
        assert stop.value.code == 2 and error in capsys.readouterr().err


def test_an_output_file_that_is_not_results_is_not_overwritten(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("some notes\nmore notes\n")
    with pytest.raises(UserError, match="line 1 is not a result"):
        results_so_far(out)
    assert out.read_text() == "some notes\nmore notes\n"
    out.write_text("some notes\n")  # a whole last line is no cut line either
    with pytest.raises(UserError, match="line 1 is not a result"):
        results_so_far(out)
    with pytest.raises(UserError, match="no such file"):
        read_requests(tmp_path / "missing.jsonl")


def test_bench_run_batch_writes_a_file_run_batch_reads_and_reads_both_timings(tmp_path):
    """scripts/bench_run_batch.py: its batch file passes read_requests; the batch's seconds come
    from our summary and from vLLM's progress bar (its last 100% line)."""
    from script_module import load_script

    bench = load_script("bench_run_batch")
    bench.batch_file(tmp_path / "b.jsonl", ["Hi", "Why?"], "m", 8)
    reqs = read_requests(tmp_path / "b.jsonl")
    assert [r["custom_id"] for r in reqs] == ["q0", "q1"] and reqs[0]["body"]["ignore_eos"] is True
    assert bench.batch_seconds("ours", "80 requests in 25.9 s (80 ok, 0 failed)") == 25.9
    bar = ("Running batch:   1% Completed | 1/80 [00:19<25:03, 19.03s/req]\n"
           "Running batch: 100% Completed | 80/80 [01:21<00:00,  4.12req/s]\n")
    assert bench.batch_seconds("vllm", bar) == 81.0 and bench.batch_seconds("vllm", "no bar") is None


def test_run_batch_starts_from_the_servers_warmed_compile_cache(tmp_path):
    """run_batch's own flags cannot change a graph: its start finds the marker a server start with
    the same flags left in the compile cache (else it would compile beside a helper again)."""
    from eagle_infer import run_batch, server

    flags = ["--dtype", "bfloat16", "--max-running-requests", "4"]
    ours = run_batch.build_parser().parse_args(["-i", "a", "-o", "b", "--batch-concurrency", "3", *flags])
    assert server.warmed_marker(ours) == server.warmed_marker(server.build_parser().parse_args(flags))


def test_a_kernel_setting_marks_a_compile_cache_of_its_own(monkeypatch):
    """$EAGLE_FUSED_LAYERS=0 (and the other kernel settings) change the graphs a start compiles:
    the marker a start with the op left does not say the Python layers' graphs are cached."""
    from eagle_infer import server

    args = server.build_parser().parse_args(["--dtype", "bfloat16"])
    monkeypatch.delenv("EAGLE_FUSED_LAYERS", raising=False)
    fused = server.warmed_marker(args)
    monkeypatch.setenv("EAGLE_FUSED_LAYERS", "0")
    assert server.warmed_marker(args) != fused
    monkeypatch.delenv("EAGLE_FUSED_LAYERS")
    assert server.warmed_marker(args) == fused
