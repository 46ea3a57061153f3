"""Plain decoding: token-for-token against transformers, batching, sampling, and the CLI."""

from __future__ import annotations

import copy
import gc
import io
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from eagle_infer.errors import UserError
from eagle_infer.generate import StreamPrinter, chat_prompt_ids, compiled_decode, generate
from eagle_infer.sampling import SamplingParams, greedy_tokens, logits_to_probs

REPO = Path(__file__).resolve().parents[1]
# CLI subprocesses: one thread unless told otherwise (see conftest.pytest_configure).
CLI_ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

GREEDY_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works.",
    "List five fruits and say one thing about each.",
]


@pytest.fixture(scope="module")
def chat_ids(tokenizer):
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in GREEDY_PROMPTS]


def test_greedy_matches_transformers(default_model_fp32, hf_default_fp32, tokenizer, chat_ids):
    eos = default_model_fp32.config.eos_token_ids
    assert eos == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    for ids in chat_ids:
        ours = generate(default_model_fp32, [ids], 64)[0]
        with torch.no_grad():
            x = torch.tensor([ids])
            ref = hf_default_fp32.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                           max_new_tokens=64)
        ref = ref[0, len(ids):].tolist()
        # Both stop at EOS (kept) or after 64 tokens.
        assert ours == ref, f"\nours: {tokenizer.decode(ours)!r}\nhf:   {tokenizer.decode(ref)!r}"
        assert len(ours) == 64 or ours[-1] in eos


def test_batched_equals_one_by_one(default_model_fp32, chat_ids, tokenizer):
    prompts = chat_ids + [tokenizer("Once upon a time")["input_ids"]]
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ
    batched = generate(default_model_fp32, prompts, 20)
    for p, out in zip(prompts, batched):
        assert out == generate(default_model_fp32, [p], 20)[0]


def test_uneven_prompts_prefill_in_length_groups(tiny_models, monkeypatch):
    """Chat prompts differ wildly in length: the prefill runs one forward per group of similar
    lengths instead of padding every prompt to the longest, and outputs stay in prompt order."""
    model, _ = tiny_models("llama")
    prompts = [list(range(5, 125)), [5, 6, 7], list(range(9, 129)), [9, 10, 11]]
    alone = [generate(model, [p], 5, eos_token_ids=[])[0] for p in prompts]
    shapes = []
    forward = type(model).forward

    def record(self, tokens, *a, **kw):
        shapes.append(tuple(tokens.shape))
        return forward(self, tokens, *a, **kw)

    monkeypatch.setattr(type(model), "forward", record)
    outs = generate(model, prompts, 5, eos_token_ids=[])
    assert outs == alone
    prefill_tokens = sum(b * t for b, t in shapes if t > 1)
    assert prefill_tokens <= 1.1 * sum(len(p) for p in prompts)  # one padded batch: 4 x 120 = 480
    assert sorted(shapes[:2]) == [(2, 3), (2, 120)]


def test_max_new_tokens_eos_and_stop_callback(tiny_models):
    model, _ = tiny_models("llama")
    prompt = [5, 6, 7, 8]
    free = generate(model, [prompt], 10, eos_token_ids=[])[0]
    assert len(free) == 10
    # An EOS is kept and ends the sequence.
    cut = generate(model, [prompt], 10, eos_token_ids=[free[3]])[0]
    assert cut == free[: free.index(free[3]) + 1]
    # on_token returning True stops only that sequence.
    seen = []

    def stop_seq0_after_2(b, t):
        seen.append((b, t))
        return b == 0 and sum(1 for s, _ in seen if s == 0) == 2

    outs = generate(model, [prompt, prompt[:2]], 6, eos_token_ids=[], on_token=stop_seq0_after_2)
    assert len(outs[0]) == 2 and len(outs[1]) == 6
    with pytest.raises(UserError):
        generate(model, [prompt], 0)


def test_sampling_with_seed_is_reproducible(tiny_models):
    model, _ = tiny_models("llama")
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234)
    a = generate(model, prompts, 20, params, eos_token_ids=[])
    b = generate(model, prompts, 20, params, eos_token_ids=[])
    assert a == b
    other = generate(model, prompts, 20, SamplingParams(1.0, 0.95, 50, seed=99), eos_token_ids=[])
    assert other != a
    # Each sequence draws from its own generator: its tokens don't depend on the batch.
    alone = generate(model, prompts[:1], 20, params, eos_token_ids=[])
    assert alone[0] == a[0]
    # Per-sequence settings: a greedy row in a sampled batch stays greedy.
    mixed = generate(model, prompts, 20, [SamplingParams(), params], eos_token_ids=[])
    assert mixed[0] == generate(model, prompts[:1], 20, eos_token_ids=[])[0]


def test_pick_tokens_groups_rows_as_if_each_sampled_alone():
    # Rows with equal settings are sampled together (one softmax, one CDF search); each row's
    # token must still be the one its own generator gives it sampled alone.
    from eagle_infer.generate import pick_tokens
    from eagle_infer.sampling import next_token

    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(0.7, seed=1), SamplingParams(), SamplingParams(0.7, seed=2),
              SamplingParams(1.0, top_p=0.9, seed=3), SamplingParams(0.7, seed=4),
              SamplingParams(1.0, top_p=0.9, seed=5), SamplingParams(1.3, top_k=5, seed=6),
              SamplingParams(0.7, seed=7)]
    for step in range(3):  # the generators advance one draw a step, together or alone
        gens = [p.generator() for p in params]
        alone_gens = [p.generator() for p in params]
        for _ in range(step + 1):
            got = pick_tokens(logits, params, gens).tolist()
            want = [next_token(logits[b], p, alone_gens[b]) for b, p in enumerate(params)]
            assert got == want
        logits = logits.roll(1, dims=-1)
    with pytest.raises(ValueError, match="2 generators for 3 rows"):
        from eagle_infer.sampling import sample
        sample(torch.ones(3, 4), [None, None])


def test_sampled_tokens_respect_top_k(tiny_models):
    model, _ = tiny_models("llama")
    prompt = [5, 6, 7, 8]
    first = [generate(model, [prompt], 1, SamplingParams(2.0, top_k=3, seed=s), eos_token_ids=[])[0][0]
             for s in range(30)]
    from eagle_infer.generate import prefill

    model.setup_cache(1, 16)
    logits, _ = prefill(model, [prompt])
    assert set(first) <= set(logits[0].topk(3).indices.tolist())


# ---------------------------------------------------------------------------------------
# logits_to_probs


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, 0.0)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3)) and int((probs > 0).sum()) == 3


def test_greedy_tokens_is_argmax_compiled_too():
    """greedy_tokens compiled (a max, then the least index holding it) picks what argmax does:
    the first of tied maxima, a NaN as the maximum (the first of several), a row of -inf's first."""
    logits = torch.randn(2, 5, 3000, generator=torch.Generator().manual_seed(2))
    logits[0, 1, [7, 2900]] = 50.0  # a tie
    logits[0, 2, [11, 40]] = float("nan")
    logits[1, 0] = float("-inf")
    logits[1, 3] = 0.0  # all tied
    logits[1, 4, 2999] = 1e4  # the last
    compiled = torch.compile(greedy_tokens, fullgraph=True, dynamic=False)
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        assert torch.equal(greedy_tokens(x), x.argmax(-1))
        got = compiled(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
    assert compiled(logits)[0, 1] == 7 and compiled(logits)[0, 2] == 11 and compiled(logits)[1, 4] == 2999


def test_compiled_decode_is_built_once_and_goes_with_its_model(tiny_model_dir):
    """generate(compile=True) builds a model's compiled step once and reuses it; a deep copy
    compiles its own (the original's graphs read the original's weights); the step is freed with
    its model (a module-wide table kept every compiled model alive: a test building servers grew
    a worker to 15 GB)."""
    from eagle_infer.loader import load_model

    target = load_model(tiny_model_dir("llama"), "fp32", "cpu")
    prompts = [[5, 6, 7, 8]]
    eager = generate(target, prompts, 6)
    assert generate(target, prompts, 6, compile=True) == eager
    step = compiled_decode(target)
    assert target.compiled_decode_steps == {None: step}
    assert generate(target, prompts, 6, compile=True) == eager and compiled_decode(target) is step
    copied = copy.deepcopy(target)
    with torch.no_grad():
        copied.lm_head.weight.mul_(-1)  # other weights, other tokens
    assert compiled_decode(copied) is not step
    assert generate(copied, prompts, 6, compile=True) == generate(copied, prompts, 6) != eager
    gone = weakref.ref(target)
    del target, step
    gc.collect()
    assert gone() is None


def test_temperature_only_is_softmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for t in (0.5, 1.0, 1.7):
        torch.testing.assert_close(logits_to_probs(logits, t), torch.softmax(logits.float() / t, -1))
    assert logits_to_probs(logits.bfloat16(), 1.0).dtype == torch.float32


@pytest.mark.parametrize("top_k", [1, 7, 49])
def test_top_k_keeps_exactly_k(top_k):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    probs = logits_to_probs(logits, 0.8, top_k=top_k)
    for row, p in zip(logits, probs):
        kept = set(torch.nonzero(p).flatten().tolist())
        assert kept == set(row.topk(top_k).indices.tolist())
        expect = torch.softmax(row[sorted(kept)] / 0.8, -1)
        torch.testing.assert_close(p[sorted(kept)], expect)
    # top_k >= vocab means off.
    torch.testing.assert_close(logits_to_probs(logits, 0.8, top_k=50), logits_to_probs(logits, 0.8))


def _smallest_prefix_reaching(p_row: torch.Tensor, top_p: float) -> set[int]:
    order = torch.argsort(p_row, descending=True).tolist()
    mass, kept = 0.0, set()
    for i in order:
        kept.add(i)
        mass += float(p_row[i])
        if mass >= top_p:
            break
    return kept


@pytest.mark.parametrize("top_p", [0.01, 0.3, 0.75, 0.9, 0.999])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p):
    logits = 2.0 * torch.randn(4, 60, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    full = torch.softmax(logits / 1.3, -1)
    probs = logits_to_probs(logits, 1.3, top_p=top_p)
    for row_full, p in zip(full, probs):
        kept = set(torch.nonzero(p).flatten().tolist())
        assert kept == _smallest_prefix_reaching(row_full, top_p)
        assert len(kept) >= 1
        idx = sorted(kept)
        torch.testing.assert_close(p[idx], (row_full[idx] / row_full[idx].sum()).float())


def test_top_p_from_candidates_equals_a_full_sort():
    """top_p_probs sorts only topk candidates (64, then 1,024, then every token) until a row's
    candidates hold top_p: rows peaked (done at 64), broad (at 1,024) and flat (the full sort)
    in one batch keep exactly what a sort of the whole row keeps, renormalised, zeros elsewhere."""
    from eagle_infer.sampling import TOP_P_CANDIDATES, top_p_probs

    g = torch.Generator().manual_seed(5)
    V = 5000
    scales = torch.tensor([12.0, 4.0, 1.5, 0.2])[:, None]  # peaked ... nearly flat
    probs = torch.softmax(torch.randn(4, V, generator=g, dtype=torch.float64) * scales, -1).float()
    top_p = 0.95
    mass = [probs.topk(k, -1).values.sum(-1) for k in TOP_P_CANDIDATES]
    assert mass[0][0] >= top_p and mass[0][1] < top_p <= mass[1][1] and mass[1][2] < top_p  # each level met
    for tp in (0.01, 0.5, top_p, 0.999):
        sorted_p, order = probs.sort(-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= tp
        keep = ~torch.zeros_like(drop).scatter(-1, order, drop)
        expected = probs.masked_fill(~keep, 0.0)
        got = top_p_probs(probs, tp)
        assert torch.equal(got > 0, keep), tp
        torch.testing.assert_close(got, expected / expected.sum(-1, keepdim=True))
        for r in range(4):  # each row alone: the same as in the batch
            assert torch.equal(top_p_probs(probs[r:r + 1], tp), got[r:r + 1]), (tp, r)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_keeps_tokens_at_least_min_p_of_the_most_likely(min_p):
    """vLLM's min-p after temperature: a token stays iff its probability is at least min_p x the
    most likely one's (1.0: the maxima alone), the rest renormalised; then top-k as usual."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 2
    full = torch.softmax(logits / 0.8, -1)
    keep = full >= min_p * full.amax(-1, keepdim=True)
    expect = torch.where(keep, full, 0.0)
    expect /= expect.sum(-1, keepdim=True)
    torch.testing.assert_close(logits_to_probs(logits, 0.8, min_p=min_p), expect)
    both = logits_to_probs(logits, 0.8, top_k=2, min_p=min_p)
    assert ((both > 0).sum(-1) == torch.minimum(keep.sum(-1), torch.tensor(2))).all()


def test_top_k_then_top_p():
    # top-p applies to the distribution left after top-k (the transformers order).
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    probs = logits_to_probs(logits, 1.0, top_p=0.6, top_k=10)
    after_k = logits_to_probs(logits, 1.0, top_k=10).double()
    for row_k, p in zip(after_k, probs):
        assert set(torch.nonzero(p).flatten().tolist()) == _smallest_prefix_reaching(row_k, 0.6)


def test_sample_draws_each_row_from_its_distribution():
    """CDF inversion: unnormalised rows, zero-probability tokens never drawn, frequencies right."""
    from scipy.stats import chisquare

    from eagle_infer.sampling import sample

    probs = torch.tensor([[0.0, 1.0, 0.0, 0.6, 0.4, 0.0],   # sums to 2: rows need not be normalised
                          [0.0, 0.0, 0.0, 0.0, 0.0, 3.0]])  # one token: always it
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs, g) for _ in range(8000)])  # [n, 2]
    assert (draws[:, 1] == 5).all()
    counts = torch.bincount(draws[:, 0], minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    expected = probs[0, [1, 3, 4]] / probs[0].sum() * len(draws)
    assert chisquare(counts[[1, 3, 4]].numpy(), expected.numpy()).pvalue > 1e-3


def test_bad_sampling_params():
    for kwargs in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"min_p": 1.5},
                   {"frequency_penalty": 2.5}, {"presence_penalty": -3.0}, {"repetition_penalty": 0.0},
                   {"repetition_penalty": 2.5}, {"logit_bias": {5: 101.0}}, {"logit_bias": {-1: 1.0}},
                   {"min_tokens": -1}):
        with pytest.raises(UserError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)


def test_penalize_is_vllms_and_transformers_penalties():
    """penalize on one step's logits: repetition_penalty as transformers' processor over prompt +
    output, frequency and presence penalties as OpenAI's formula over the output only, logit_bias
    added first (vLLM's order); a row without settings keeps its logits, and with none at all
    the tensor itself comes back."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from eagle_infer.sampling import penalize

    V = 50
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1, V, generator=g) * 3
    prompts = [[1, 2, 3, 3], [4, 5], [6], [7, 8, 9]]
    outputs = [[10, 11, 10, 2], [5, 12, 12, 12, 4], [], [13]]
    params = [SamplingParams(repetition_penalty=1.7),
              SamplingParams(frequency_penalty=0.6, presence_penalty=-0.4),
              SamplingParams(logit_bias={0: 5.0, 49: -100.0}, repetition_penalty=0.5),
              SamplingParams(top_k=3)]
    out = penalize(logits, params, prompts, outputs, [{49}] * 4)
    assert out.shape == logits.shape and out.dtype == torch.float32
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompts[0] + outputs[0]]), logits[0].clone())
    torch.testing.assert_close(out[0], hf)
    counts = torch.bincount(torch.tensor(outputs[1]), minlength=V).float()  # not the prompt's 4, 5
    torch.testing.assert_close(out[1, 0], logits[1, 0] - 0.6 * counts + 0.4 * (counts > 0).float())
    biased = logits[2].clone()
    biased[0, 0] += 5.0
    biased[0, 49] -= 100.0
    torch.testing.assert_close(out[2], RepetitionPenaltyLogitsProcessor(0.5)(torch.tensor([[6]]), biased))
    assert torch.equal(out[3], logits[3])
    assert penalize(logits, [SamplingParams(top_k=3)] * 4, prompts, outputs, [{49}] * 4) is logits
    # min_tokens: the row's stop tokens barred while its output is shorter (outputs: 4, 5, 0, 1 tokens)
    barred = penalize(logits, [SamplingParams(min_tokens=5)] * 4, prompts, outputs, [{3, 7}, {3}, {3}, set()])
    assert barred[0, 0, [3, 7]].isneginf().all() and barred[2, 0, 3].isneginf()
    assert torch.equal(barred[1], logits[1]) and torch.equal(barred[3], logits[3])
    assert not barred[0, 0, :3].isinf().any()


# ---------------------------------------------------------------------------------------
# Streaming and the command line


def test_stream_printer_holds_back_partial_utf8(tokenizer, monkeypatch):
    text = "Fast 🚀 decoding, naïve café ✓ done"
    ids = tokenizer(text)["input_ids"]
    writes: list[str] = []

    class Sink(io.StringIO):
        def write(self, s):
            writes.append(s)
            return len(s)

    monkeypatch.setattr(sys, "stdout", Sink())
    printer = StreamPrinter(tokenizer)
    for t in ids:
        assert printer(0, t) is False
    assert "".join(writes) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len([w for w in writes if w]) > 5  # text arrives token by token
    assert not any("\ufffd" in w for w in writes)


def test_cli_streams_greedy_text(default_model_fp32, tokenizer):
    prompt = "What is the capital of France?"
    proc = subprocess.run(
        [sys.executable, "-m", "eagle_infer.generate", "--prompt", prompt, "--max-new-tokens", "12",
         "--dtype", "fp32"],
        cwd=REPO, env=CLI_ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    expect = tokenizer.decode(generate(default_model_fp32, [ids], 12)[0], skip_special_tokens=True)
    assert proc.stdout.strip() == expect.strip()
    assert "tokens/s" in proc.stderr


def test_cli_bad_flag_values_are_one_error_line():
    proc = subprocess.run(
        [sys.executable, "-m", "eagle_infer.generate", "--temperature", "-1", "--max-new-tokens", "2"],
        cwd=REPO, env=CLI_ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "temperature" in lines[0], proc.stderr


def test_bad_messages_json():
    from eagle_infer.generate import parse_messages

    assert parse_messages('[{"role": "user", "content": "hi"}]') == [{"role": "user", "content": "hi"}]
    with pytest.raises(UserError, match="--messages"):
        parse_messages("[not json")
    with pytest.raises(UserError, match="--messages"):
        parse_messages('{"role": "user"}')


# ---------------------------------------------------------------------------------------
# The benchmark's pieces (the full run with transformers baselines is too slow for tests)


def test_bench_load_prompts(tokenizer, mtbench_prompts, tmp_path):
    from eagle_infer.bench import load_prompts

    ids = load_prompts(None, 2, tokenizer)
    assert ids == [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in mtbench_prompts[:2]]
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "Say hi."}\n\n"Count to three."\n'
                    '{"conversations": [{"from": "human", "value": "Hello?"}]}\n')
    got = load_prompts(path, 10, tokenizer)
    assert [tokenizer.decode(g) for g in got] == [
        tokenizer.decode(chat_prompt_ids(tokenizer, [{"role": "user", "content": m}]))
        for m in ("Say hi.", "Count to three.", "Hello?")]
    path.write_text('{"prompt": "ok"}\n{broken\n')
    with pytest.raises(UserError, match=":2"):
        load_prompts(path, 10, tokenizer)
    # --per-category: the first K of each category, in file order; records need a category.
    path.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in
                            [("a", "A1"), ("a", "A2"), ("a", "A3"), ("b", "B1"), ("c", "C1"), ("b", "B2")]))
    got = load_prompts(path, 1, tokenizer, per_category=2)
    assert [tokenizer.decode(g) for g in got] == [
        tokenizer.decode(chat_prompt_ids(tokenizer, [{"role": "user", "content": m}]))
        for m in ("A1", "A2", "B1", "C1", "B2")]
    assert len(load_prompts(None, 1, tokenizer, per_category=1)) == 8  # MT-bench's categories
    path.write_text('{"prompt": "no category"}\n')
    with pytest.raises(UserError, match="category"):
        load_prompts(path, 1, tokenizer, per_category=1)


def test_bench_weight_bytes(tiny_models):
    from eagle_infer.bench import weight_bytes_per_token

    for arch in ("llama", "tied"):
        model, _ = tiny_models(arch)
        params = {p.data_ptr(): p for p in model.parameters()}  # tied weights once
        total = sum(p.numel() * 4 for p in params.values())
        embed = model.embed_tokens.weight.numel() * 4
        # Untied: the input table isn't read per token; tied: it is the output head.
        assert weight_bytes_per_token(model) == (total if arch == "tied" else total - embed)


def test_bench_main_plain_only(tmp_path, monkeypatch):
    from eagle_infer.bench import main

    # The previous default backend: the fp32 default compiles the real target's step on Inductor's
    # GEMM template (~1.5 minutes cold on 2 cores); test_cpu_linears compiles it on tiny targets.
    monkeypatch.setenv("EAGLE_CPU_LINEARS", "onednn")

    out = tmp_path / "bench.json"
    report = main(["--num-prompts", "1", "--max-new-tokens", "3", "--dtype", "fp32", "--no-hf",
                   "--no-spec", "--json", str(out)])
    assert report["methods"]["plain"]["tokens"] == 3
    saved = json.loads(out.read_text())
    assert saved["plain_tokens_per_s"] > 0 and saved["floor_tokens_per_s"] > 0
    assert saved["hf_tokens_per_s"] is None and saved["settings"]["dtype"] == "fp32"
