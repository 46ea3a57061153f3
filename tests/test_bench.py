"""The benchmark's speculative report: the fields users compare on, and exactness."""

from __future__ import annotations

import json

import torch

from eagle_infer.bench import main
from eagle_infer.heads import DraftHead, HeadConfig, save_head


def save_random_head(target, path) -> None:
    torch.manual_seed(0)
    cfg = HeadConfig.for_target(target.config, "eagle3", draft_vocab_size=1024)
    head = DraftHead(cfg, target.embed_tokens, target.lm_head.weight)
    head.t2d.zero_()
    head.t2d[:1024] = True
    save_head(head, path)


def test_bench_speculative_report(tmp_path, default_model_fp32):
    save_random_head(default_model_fp32, tmp_path / "head")
    out = tmp_path / "bench.json"
    main(["--num-prompts", "1", "--max-new-tokens", "6", "--dtype", "fp32", "--no-hf",
          "--draft", str(tmp_path / "head"), "--num-steps", "3", "--eagle-topk", "2",
          "--num-draft-tokens", "6", "--sweep", "--sweep-steps", "2", "--sweep-topk", "1",
          "--sweep-draft-tokens", "3", "--no-compile", "--count-ops", "--json", str(out)])
    r = json.loads(out.read_text())
    for key in ("acceptance_length", "accept_rate_per_position", "tokens_per_s", "plain_tokens_per_s",
                "hf_tokens_per_s", "speedup_vs_plain", "speedup_vs_hf", "greedy_identical",
                "draft_ms", "verify_ms", "other_ms", "warmup_s", "verify_vs_plain_step",
                "draft_step_vs_plain_step", "plain_step_ms"):
        assert key in r, key
    assert r["compiled"] is False and r["warmup_s"]["plain"] > 0 and r["warmup_s"]["spec s3k2n6g4"] > 0
    assert r["timing"] == "interleaved"  # batch 1: plain and the main tree take turns
    # TTFT (prefill) and TPOT (decode steps) per method that reports tokens as they come; a
    # round is compared with plain decoding's TPOT, not with tokens/s, which carries the prefill
    for name in ("plain", "spec s3k2n6g4"):  # the CPU's n-gram branch of 4 where no flag says otherwise
        m = r["methods"][name]
        assert 0 < m["ttft_ms"] and 0 < m["tpot_ms"], m
        assert m["ttft_ms"] + 5 * m["tpot_ms"] <= 1e3 * m["seconds"] * 1.001, m  # 6 tokens, one call
    assert r["plain_step_ms"] == r["methods"]["plain"]["tpot_ms"]
    ops = r["aten_ops_eager"]
    assert ops["plain_step"] > 0 and ops["round_keep_slots"] < 40, ops  # one index op pair, all layers
    assert r["greedy_identical"] is True
    assert r["greedy_agreement_spec_vs_plain"] == {"common_prefix_tokens": [6], "prompts_identical": 1,
                                                   "prompts": 1}
    assert len(r["accept_rate_per_position"]) == 4 and r["acceptance_length"] >= 1.0  # max(3 steps, 4)
    assert [row["tree"]["eagle_topk"] for row in r["sweep"]] == [2, 1]
    assert {row["tree"]["ngram_branch"] for row in r["sweep"]} == {4}
    assert out.with_suffix(".png").stat().st_size > 1000


def test_bench_batches_prompts(tmp_path, default_model_fp32):
    """--batch-size 2 over 3 prompts: calls of 2 and 1 prompts, speculative output equal to plain
    decoding of the same batches, transformers skipped; the tree flags not given take the CPU's
    default tree (2/4/4 with an n-gram branch of 4, the server's), the one given overrides its part."""
    save_random_head(default_model_fp32, tmp_path / "head")
    out = tmp_path / "bench.json"
    main(["--num-prompts", "3", "--batch-size", "2", "--max-new-tokens", "5", "--dtype", "fp32",
          "--draft", str(tmp_path / "head"), "--num-draft-tokens", "3", "--no-compile", "--ngram", "3",
          "--json", str(out)])
    r = json.loads(out.read_text())
    # prompt lookup without a head took turns with plain and the tree, the same batches, plain's tokens
    ngram = r["ngram"]
    assert ngram["method"] == "ngram k3" and ngram["greedy_identical"] is True
    assert [b["tokens"] for b in r["methods"]["ngram k3"]["per_batch"]] == [10, 5]
    assert ngram["verify_rounds"] + ngram["plain_rounds"] > 0 and len(ngram["accept_rate_per_position"]) == 3
    assert r["tree"] == {"num_steps": 2, "eagle_topk": 4, "num_draft_tokens": 3, "ngram_branch": 4}
    assert r["settings"]["batch_size"] == 2 and r["hf_tokens_per_s"] is None
    assert r["timing"] == "interleaved"  # batch by batch
    plain = r["methods"]["plain"]
    assert [b["tokens"] for b in plain["per_batch"]] == [10, 5] and plain["tokens"] == 15
    assert r["greedy_identical"] is True and r["rounds"] > 0


def test_bench_ngram_without_a_head_takes_turns_with_plain(tmp_path, default_model_fp32):
    """--no-spec --ngram: prompt lookup against plain alone, interleaved, its warm-up apart."""
    out = tmp_path / "bench.json"
    main(["--num-prompts", "2", "--max-new-tokens", "12", "--dtype", "fp32", "--no-hf", "--no-spec",
          "--ngram", "4", "--ngram-min-match", "2", "--no-compile", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["timing"] == "interleaved" and "acceptance_length" not in r  # no head, no tree
    assert r["ngram"]["greedy_identical"] is True and r["ngram"]["min_match"] == 2
    assert r["warmup_s"]["ngram k4"] > 0 and r["methods"]["ngram k4"]["tokens"] == 24


def test_bench_int8_target_reports_its_weights(tmp_path, default_model_fp32):
    """--quantization int8: the JSON says so, and a step streams about a quarter of the bytes."""
    from eagle_infer.bench import weight_bytes_per_token

    save_random_head(default_model_fp32, tmp_path / "head")
    out = tmp_path / "bench.json"
    main(["--num-prompts", "1", "--max-new-tokens", "6", "--dtype", "fp32", "--no-hf",
          "--quantization", "int8", "--draft", str(tmp_path / "head"), "--num-steps", "2",
          "--eagle-topk", "2", "--num-draft-tokens", "3", "--no-compile", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["settings"]["quantization"] == "int8"
    assert r["weight_bytes_per_token"] < 0.3 * weight_bytes_per_token(default_model_fp32)
    assert r["methods"]["plain"]["tokens"] == 6 and r["rounds"] > 0


def test_time_interleaved_alternates_the_order():
    """Each prompt runs through every method, in the given order and then reversed, so drift of
    the machine's speed falls on both; each method's outputs stay in prompt order."""
    from eagle_infer.bench import time_interleaved

    calls = []

    def method(name):
        def run(batch, on_token):
            calls.append((name, batch[0][0]))
            on_token(0, 7)
            return [[batch[0][0] * 10]]
        return run

    res = time_interleaved({"a": method("a"), "b": method("b")}, [[1], [2], [3]])
    assert calls == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]
    for name in ("a", "b"):
        r = res[name]
        assert r.outputs == [[10], [20], [30]] and len(r.seconds) == 3 and len(r.token_times) == 3


def test_time_interleaved_takes_batches():
    """batch_size 2 over 3 prompts: calls of [1, 2] and [3], the order reversed at the second,
    outputs in prompt order."""
    from eagle_infer.bench import time_interleaved

    calls = []

    def method(name):
        def run(batch, on_token):
            calls.append((name, [p[0] for p in batch]))
            for i in range(len(batch)):
                on_token(i, 7)
            return [[p[0] * 10] for p in batch]
        return run

    res = time_interleaved({"a": method("a"), "b": method("b")}, [[1], [2], [3]], batch_size=2)
    assert calls == [("a", [1, 2]), ("b", [1, 2]), ("b", [3]), ("a", [3])]
    for name in ("a", "b"):
        assert res[name].outputs == [[10], [20], [30]] and res[name].batch_size == 2



def test_bench_sampled_plain_samples_too(tmp_path, default_model_fp32):
    """--temperature: plain decoding samples with the same settings (the fair baseline for a
    sampled speculative run), seeded like the speculative runs' requests; the settings are
    reported (settings.greedy false: it said true for every run)."""
    from eagle_infer.bench import load_prompts, plain_decode_fn
    from eagle_infer.generate import generate
    from eagle_infer.loader import load_tokenizer
    from eagle_infer.sampling import SamplingParams

    save_random_head(default_model_fp32, tmp_path / "head")
    main(["--num-prompts", "1", "--max-new-tokens", "8", "--dtype", "fp32", "--no-hf", "--no-compile",
          "--draft", str(tmp_path / "head"), "--num-steps", "2", "--eagle-topk", "2",
          "--num-draft-tokens", "3", "--temperature", "5.0", "--top-p", "0.9", "--top-k", "100",
          "--json", str(tmp_path / "s.json")])
    r = json.loads((tmp_path / "s.json").read_text())
    assert (r["temperature"], r["top_p"], r["top_k"]) == (5.0, 0.9, 100)
    assert r["greedy_identical"] is None and r["methods"]["plain"]["tokens"] == 8
    assert r["settings"]["greedy"] is False
    prompt = load_prompts(None, 1, load_tokenizer(None))[:1]
    params = SamplingParams(5.0, 0.9, 100, seed=0)
    sampled = plain_decode_fn(default_model_fp32, 8, params=params)(prompt, lambda i, t: False)
    assert sampled == generate(default_model_fp32, prompt, 8, params, eos_token_ids=[])
    assert sampled != plain_decode_fn(default_model_fp32, 8)(prompt, lambda i, t: False)


def test_bench_penalized_greedy_is_compared_with_penalized_plain(tmp_path, default_model_fp32):
    """--frequency-penalty / --presence-penalty / --repetition-penalty: greedy runs with them on
    both sides, so speculative output is still compared with plain output (identical in fp32),
    and the settings are reported."""
    save_random_head(default_model_fp32, tmp_path / "head")
    main(["--num-prompts", "1", "--max-new-tokens", "8", "--dtype", "fp32", "--no-hf", "--no-compile",
          "--draft", str(tmp_path / "head"), "--num-steps", "2", "--eagle-topk", "2",
          "--num-draft-tokens", "3", "--frequency-penalty", "1.0", "--presence-penalty", "0.5",
          "--repetition-penalty", "1.3", "--json", str(tmp_path / "p.json")])
    r = json.loads((tmp_path / "p.json").read_text())
    assert (r["frequency_penalty"], r["presence_penalty"], r["repetition_penalty"]) == (1.0, 0.5, 1.3)
    assert r["temperature"] == 0.0 and r["greedy_identical"] is True and r["settings"]["greedy"] is True
    # --structured-output: both sides decode under the grammar (a phone number, then EOS, ends it)
    main(["--num-prompts", "1", "--max-new-tokens", "16", "--dtype", "fp32", "--no-hf", "--no-compile",
          "--draft", str(tmp_path / "head"), "--num-steps", "2", "--eagle-topk", "2",
          "--num-draft-tokens", "3", "--structured-output", "regex:[0-9]{3}-[0-9]{4}",
          "--json", str(tmp_path / "g.json")])
    r = json.loads((tmp_path / "g.json").read_text())
    assert r["structured_output"] == "regex:[0-9]{3}-[0-9]{4}" and r["greedy_identical"] is True
