"""Prompt-lookup speculative decoding without a head (eagle_infer.ngram): lossless greedy and
sampled, chains that verify in place, rounds that fall back to plain steps."""

from dataclasses import replace

import pytest
import torch
from test_speculative import (
    PENALTIES,
    assert_follows_target,
    digits,
    pair_grammar,
    prompts_for,
    tiny_target,
)

from eagle_infer.engine import PlainDecoder
from eagle_infer.errors import UserError
from eagle_infer.generate import chat_prompt_ids, generate
from eagle_infer.ngram import (
    DEFAULT_DRAFT_TOKENS,
    Corpus,
    NgramDecoder,
    NgramIndex,
    chain_tree,
    generate_ngram,
)
from eagle_infer.sampling import SamplingParams
from eagle_infer.speculative import Sequence_
from eagle_infer.tree import accept_greedy, ngram_lookup

torch.set_num_threads(1)


def repeating_target(seed: int = 5, vocab: int = 12):
    """A tiny target whose next token depends on its last alone and most likely repeats it: its
    answers recur, so lookups match and chains get accepted (and rejected)."""
    target = tiny_target(vocab=vocab, layers=1, seed=seed, silent=True)
    with torch.no_grad():
        target.lm_head.weight.copy_(0.15 * target.embed_tokens.weight)
    return target


def test_chain_tree_is_a_chain_and_accept_greedy_walks_its_prefix():
    tokens = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    tree = chain_tree(tokens)
    assert tree.parent.tolist() == [[0, 0, 1, 2]] * 2 and tree.depth.tolist() == [[0, 1, 2, 3]] * 2
    assert torch.equal(tree.mask[0], torch.ones(4, 4, dtype=torch.bool).tril())
    logits = torch.full((2, 4, 10), -1.0)
    for b, picks in enumerate([[6, 7, 9, 1], [2, 0, 3, 4]]):  # the target's argmax after each node
        logits[b, torch.arange(4), torch.tensor(picks)] = 1.0
    acc = accept_greedy(tree, logits, 3)
    assert acc.n_accepted.tolist() == [2, 1] and acc.bonus.tolist() == [9, 0]


@pytest.mark.parametrize("k,min_match", [(1, 1), (4, 1), (6, 2)])
def test_greedy_is_token_identical_to_plain_decoding(default_model_fp32, tokenizer, k, min_match):
    """fp32, the real target: prompts of other lengths decoded together (rows join, verify chains,
    stop at their EOS or the length) give plain greedy decoding's tokens, and chains were accepted."""
    texts = ["Repeat after me three times: the cat sat on the mat.",
             "Write a Python function that adds two numbers, then the same with type hints.",
             "Say hi."]
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    outs, stats = generate_ngram(default_model_fp32, prompts, 48, num_draft_tokens=k, min_match=min_match)
    for p, out in zip(prompts, outs):
        assert out == generate(default_model_fp32, [p], 48)[0]
    assert stats.row_rounds > 0 and stats.accepted_tokens > 0 and stats.plain_rounds > 0
    assert max(len(o) for o in outs) == 48 and min(len(o) for o in outs) < 48  # one stopped at EOS


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_the_index_finds_what_the_lookup_finds(vocab):
    """NgramIndex, fed a growing history a few tokens at a time, gives tree.ngram_lookup's chain
    and match length after every growth: matches of every length, periodic continuations, none."""
    g = torch.Generator().manual_seed(vocab)
    history = torch.randint(0, vocab, (300,), generator=g).tolist()
    index, end, lengths = NgramIndex(4), 0, set()
    while end < len(history):
        end += int(torch.randint(1, 4, (1,), generator=g))
        tokens = history[:end]
        index.extend(tokens[len(index.tokens):])
        chain, n = index.lookup(6)
        want, want_n = ngram_lookup(torch.tensor([tokens]), torch.tensor([len(tokens) - 1]), 6)
        assert (chain, n) == (want[0].tolist(), int(want_n[0])), end
        lengths.add(n)
    assert {0, 1, 2} <= lengths and (4 in lengths or vocab > 8)


def test_the_corpus_finds_what_earlier_requests_said_within_its_capacity():
    """Corpus: a request's continuation after the latest occurrence of the history's longest
    suffix (at least min_n tokens), cut at that request's end and padded with its last token;
    nothing where the match ends a request or is too short; past its capacity the older half
    is dropped, the newest kept."""
    corpus = Corpus(4, capacity=40)
    corpus.add([1, 2, 3, 4, 5, 6])
    corpus.add([7, 2, 3, 9])
    assert corpus.lookup([8, 2, 3], 3, 2) == ([9, 9, 9], 2)  # the latest: the second request's
    assert corpus.lookup([1, 2, 3], 3, 2) == ([4, 5, 6], 3)  # a longer match: the first's
    assert corpus.lookup([3, 4, 5, 6], 3, 2) == ([], 0)  # the first request ended there
    assert corpus.lookup([0, 6, 3], 3, 2) == ([], 0)  # one token alone is too short
    assert corpus.lookup([3, 4], 5, 3) == ([], 0)
    for r in range(10):  # 50 tokens more: the oldest dropped
        corpus.add([10 + r, 11 + r, 12 + r, 13 + r])
    assert corpus.lookup([1, 2, 3], 3, 2) == ([], 0)
    assert corpus.lookup([19, 20], 2, 2) == ([21, 22], 2) and len(corpus.index.tokens) <= 40


def test_a_request_finds_the_words_of_those_before_it():
    """A request decoded after another whose answer it repeats (the same prompt again) accepts
    far more drafts with the corpus than from its own history alone, and both give plain
    decoding's tokens; forget() empties the corpus."""
    target = tiny_target(layers=1, silent=True)
    prompt = prompts_for(target.config.vocab_size)[1]
    plain = generate(target, [prompt], 20, eos_token_ids=[])[0]
    taus = []
    for capacity in (0, 1000):
        dec = NgramDecoder(target, 6, max_batch=1, max_seq_len=128, corpus_tokens=capacity)
        first, _ = generate_ngram(target, [prompt], 20, eos_token_ids=[], decoder=dec)
        again, stats = generate_ngram(target, [prompt], 20, eos_token_ids=[], decoder=dec)
        assert first == again == [plain]
        taus.append(stats.accepted_tokens)
    assert taus[1] > 15 > 2 * taus[0], taus  # nearly every token drafted right, against 6
    assert len(dec.corpus.index.tokens) == 2 * (len(prompt) + 20 + 1)
    dec.forget()
    assert dec.corpus.index.tokens == [] and dec.corpus.capacity == 1000


def test_a_round_without_a_match_is_a_plain_step():
    """Rows whose history holds their last token nowhere before (or too short a match) take a
    plain step: no verify rows, nothing counted as drafted."""
    target = tiny_target(vocab=96, seed=3)
    dec = NgramDecoder(target, 4, min_match=3, max_batch=1, max_seq_len=64)
    seq = Sequence_([1, 2, 3, 4], SamplingParams(), 2, set())
    dec.add(seq)
    dec.step()
    assert dec.last_round_plain and dec.stats.plain_rounds == 1 and dec.stats.row_rounds == 0


@pytest.mark.parametrize("settings", [
    dict(temperature=1.0), dict(temperature=0.8, top_k=5), dict(temperature=1.5, top_p=0.9),
    dict(temperature=1.0, frequency_penalty=1.0, presence_penalty=1.0, repetition_penalty=1.2),
    dict(temperature=1.0, grammar="pairs"), dict(temperature=1.0, grammar="forced"),
], ids=["t1", "topk", "topp", "t1-penalties", "t1-grammar", "t1-grammar-forced"])
def test_sampling_matches_target_distribution(settings):
    """Sampled, the 2nd and 3rd tokens (the first ones a verified chain gives) follow the target's
    exact marginals, on a target that repeats its last token (so chains of the prompt's repeats
    are proposed, and often accepted); with penalties (a chain position's must count the drafted
    tokens before it, which the target likes to repeat), and under a grammar whose next token
    depends on the last, or that forces "56" after a digit 0-4 (chains draft it)."""
    target = repeating_target()
    V = target.config.vocab_size
    settings = dict(settings)
    grammar = {None: None, "pairs": pair_grammar(V, V - 1),
               "forced": replace(pair_grammar(V, V - 1, "([0-4]56|[5-9][5-9])+"), encode=digits),
               }[settings.pop("grammar", None)]
    # under a grammar the output is pairs of a digit 0-4 then 5-9: a prompt of such pairs to look up
    prompt = [1, 7, 2, 8, 1, 7, 2, 8, 1] if grammar is not None else [1, 4, 7, 1, 4, 7, 1]
    n, batch = 6000, 250
    params = [SamplingParams(seed=1000 + i, grammar=grammar, **settings) for i in range(n)]
    dec = NgramDecoder(target, 3, max_batch=batch, max_seq_len=64)
    outs = []
    for i in range(0, n, batch):
        outs += generate_ngram(target, [prompt] * batch, 3, params[i:i + batch], decoder=dec)[0]
    assert dec.stats.row_rounds > 0 and dec.stats.accepted_tokens > 0
    assert_follows_target(target, prompt, outs, params[0], grammar)


def test_rounds_above_disable_by_batch_size_are_plain_steps():
    target = repeating_target()
    prompt = [1, 4, 7, 1, 4, 7, 1]
    dec = NgramDecoder(target, 3, max_batch=2, max_seq_len=64, disable_by_batch_size=1)
    outs, stats = generate_ngram(target, [prompt, prompt], 6, eos_token_ids=[], decoder=dec)
    assert stats.row_rounds == 0 and stats.plain_rounds == stats.rounds == 5
    _, alone = generate_ngram(target, [prompt], 6, eos_token_ids=[], decoder=dec)  # one row: it speculates
    assert alone.row_rounds > 0 and outs[0] == generate(target, [prompt], 6, eos_token_ids=[])[0]


def test_penalized_greedy_is_plain_penalized_greedy():
    """Penalties and logit_bias are lossless under prompt lookup: greedy n-gram decoding with them
    equals plain greedy decoding with them, token for token, each row with its own settings (one
    without) in one batch, chains of 3 and 6, where rounds accept chains (a position's penalties
    count the drafted tokens before it: a negative frequency penalty, alone at batch 1, loops
    sooner as the chain does; a positive one ends a target's runs of repeats). The settings change
    the output (else the test would prove nothing)."""
    target = tiny_target(layers=1, silent=True)
    prompts = prompts_for(target.config.vocab_size)
    params = PENALTIES[:3] + [SamplingParams()]
    plain = generate(target, prompts, 40, params)
    assert all(a != b for a, b in zip(plain[:3], generate(target, prompts[:3], 40)))
    for k in (3, 6):
        out, stats = generate_ngram(target, prompts, 40, params, num_draft_tokens=k)
        assert out == plain and sum(stats.accepted_hist[2:]) > 0 and stats.row_rounds > stats.plain_rounds
    for p, ref in zip(prompts, generate(target, prompts, 40, PENALTIES[3])):
        out, stats = generate_ngram(target, [p], 40, [PENALTIES[3]])
        assert out[0] == ref and sum(stats.accepted_hist[2:]) > 0
    # a target that repeats its last token until a frequency penalty (growing with every repeat,
    # drafted ones too) moves it on: accepted chains of repeats end where plain decoding's do
    target, params = repeating_target(), SamplingParams(frequency_penalty=0.5)
    prompts = [[1, 4, 7, 1, 4, 7, 1], [2, 3, 2, 3, 5]]
    plain = generate(target, prompts, 30, params, eos_token_ids=[])
    assert all(len(set(out)) > 2 for out in plain)
    out, stats = generate_ngram(target, prompts, 30, [params] * 2, eos_token_ids=[])
    assert out == plain and sum(stats.accepted_hist[2:]) > 0


def test_grammar_greedy_is_plain_grammar_greedy_and_drafts_what_it_forces():
    """Structured outputs under prompt lookup: greedy rows with a grammar (each chain position
    masked after the drafted tokens before it) and one without, in one batch, write plain
    decoding's tokens; a grammar that forces text ("0123456789" after each free digit, Grammar.encode
    given) is drafted: the forced digits are accepted where the lookup alone has nothing yet."""
    target = tiny_target(layers=1, silent=True)
    V, stop = target.config.vocab_size, 95
    prompts = prompts_for(V)
    pairs = pair_grammar(V, stop)
    params = [SamplingParams(grammar=pairs)] * 3 + [SamplingParams()]
    plain = generate(target, prompts, 40, params, eos_token_ids=[stop])
    assert plain[:3] != generate(target, prompts[:3], 40, eos_token_ids=[stop])
    out, stats = generate_ngram(target, prompts, 40, params, eos_token_ids=[stop])
    assert out == plain and sum(stats.accepted_hist[2:]) > 0
    counting = pair_grammar(V, stop, "(0123456789[0-4])+")
    plain = generate(target, prompts[:2], 40, SamplingParams(grammar=counting), eos_token_ids=[stop])
    taus = []
    for g in (counting, replace(counting, encode=digits)):
        params = [SamplingParams(grammar=g)] * 2
        out, stats = generate_ngram(target, prompts[:2], 40, params, eos_token_ids=[stop])
        assert out == plain
        taus.append(stats.acceptance_length())
    assert taus[0] < 1.5 < 3 < taus[1], taus


def test_the_server_flags_resolve_and_refuse():
    from eagle_infer.server import ngram_settings, resolve_draft
    from eagle_infer.server_flags import apply_speculative_config, build_parser

    def args_of(*flags):
        args = build_parser().parse_args(list(flags))
        apply_speculative_config(args)
        return args

    assert ngram_settings(args_of("--speculative-algorithm", "ngram")) == (DEFAULT_DRAFT_TOKENS, 1, 4)
    vllm = args_of("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                   '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert resolve_draft(vllm) == ("NGRAM", None) and ngram_settings(vllm) == (3, 2, 5)
    for flags, says in [(["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "2"], "eagle-topk"),
                        (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"], ">= 2"),
                        (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size",
                          "3", "--speculative-ngram-max-match-window-size", "2"], "min <= max"),
                        (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size",
                          "0"], "min <= max"),  # a 0 given is refused, not read as the default
                        (["--speculative-algorithm", "NGRAM", "--speculative-ngram-capacity", "-1"], ">= 0")]:
        with pytest.raises(UserError, match=says):
            ngram_settings(args_of(*flags))
    with pytest.raises(UserError, match="takes no draft model"):
        resolve_draft(args_of("--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "/x"))
    for flag in ("--speculative-ngram-min-match-window-size", "--speculative-ngram-capacity"):
        with pytest.raises(UserError, match=f"{flag} is for --speculative-algorithm NGRAM"):
            resolve_draft(args_of(flag, "2"))


def test_decoder_refuses_bad_settings_and_requests_without_room():
    target = tiny_target()
    with pytest.raises(UserError, match="num_draft_tokens"):
        NgramDecoder(target, 0)
    with pytest.raises(UserError, match="min_match"):
        NgramDecoder(target, 4, min_match=3, max_match=2)
    dec = NgramDecoder(target, 4, max_batch=1, max_seq_len=32)
    with pytest.raises(UserError):  # 20 + 10 fit a plain decoder's 32 slots, not the chain's 4 more
        dec.check(Sequence_(list(range(1, 21)), SamplingParams(), 10, set()))
    PlainDecoder(target, 1, 32).check(Sequence_(list(range(1, 21)), SamplingParams(), 10, set()))


def test_the_server_speculates_by_prompt_lookup(tmp_path, default_model_fp32, tokenizer):
    """`--speculative-algorithm NGRAM` served (vLLM's speculative config spelling): greedy chat
    answers are plain decoding's tokens, the usage reports the rounds' acceptance, and /metrics
    counts drafts of the chain's length; an answer under a JSON schema (response_format) is the
    plain decoder's with the grammar, and its rounds accept drafts (the schema's forced keys)."""
    import json

    import httpx
    from test_server import PERSON_SCHEMA, Server, metrics, plain_answer

    from eagle_infer.grammar import Grammars

    srv = Server(["--dtype", "fp32", "--disable-torch-compile", "--max-running-requests", "2",
                  "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
                 tmp_path / "server.log")
    try:
        srv.wait_ready()
        msgs = [{"role": "user", "content": "Write a Python function that adds two numbers, then the "
                                            "same with type hints."}]
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": msgs, "max_tokens": 40, "temperature": 0}).json()
        m = metrics(srv)
        info = httpx.get(srv.url + "/get_server_info", timeout=30).json()
        person = PERSON_SCHEMA
        asked = [{"role": "user", "content": "Describe a person as JSON with name and age."}]
        structured = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": asked, "max_tokens": 40, "temperature": 0, "response_format": {
                "type": "json_schema", "json_schema": {"name": "person", "schema": person}}}).json()
    finally:
        srv.stop()
    model = default_model_fp32
    grammars = Grammars.for_tokenizer(tokenizer, model.config.vocab_size, set(model.config.eos_token_ids))
    grammar = grammars.compile("json_schema", person)
    text = structured["choices"][0]["message"]["content"]
    assert (text, structured["choices"][0]["finish_reason"]) == plain_answer(
        model, tokenizer, chat_prompt_ids(tokenizer, asked), grammar, 40)
    assert set(json.loads(text)) == {"name", "age"}
    assert structured["usage"]["speculative"]["accepted_tokens"] > 0
    want = generate(default_model_fp32, [chat_prompt_ids(tokenizer, msgs)], 40)[0]
    assert tokenizer.decode(want, skip_special_tokens=True) == r["choices"][0]["message"]["content"]
    assert r["usage"]["completion_tokens"] == len(want) == 40
    spec = r["usage"]["speculative"]
    assert spec["rounds"] > 0 and spec["accepted_tokens"] > 0
    assert m["eagle:spec_decode_num_draft_tokens_total"] == 3 * m["eagle:spec_decode_num_drafts_total"] > 0
    assert info["speculative_num_draft_tokens"] == 4 and info["speculative_ngram_capacity"] == 100_000


def test_compiled_rounds_compile_at_warm_up_then_decode_as_eager():
    """compile(): the chain's verify as a graph per batch bucket beside the plain steps; the
    server's warm-up (engine.warm_up) compiles both paths' graphs, so decoding after it compiles
    nothing, and gives the eager decoder's tokens; the corpus forgets the warm-up's requests."""
    from torch._dynamo.utils import counters

    from eagle_infer.engine import warm_up

    target = repeating_target(vocab=24)
    prompts = [[1, 4, 7, 1, 4, 7, 1], [2, 5, 2, 5, 2]]
    eager, _ = generate_ngram(target, prompts, 12, num_draft_tokens=3, eos_token_ids=[])
    dec = NgramDecoder(target, 3, max_batch=2, max_seq_len=64).compile()
    warm_up(dec)
    assert dec.corpus.index.tokens == []  # the warm-up's requests forgotten
    graphs = counters["stats"]["unique_graphs"]
    outs, stats = generate_ngram(target, prompts, 12, eos_token_ids=[], decoder=dec)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after the warm-up
    assert outs == eager and stats.row_rounds > 0 and dec.min_match == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_exact():
    """On CUDA the chain's verify and the plain steps replay CUDA graphs (compile(CUDA_GRAPHS)):
    the same tokens as eager plain decoding, no graph run without them, and once recorded a
    launch a round, not kernels one by one. (Written without a GPU to run it on: the first
    session with one runs it.)"""
    from test_static_shapes import assert_no_cudagraph_skips, cuda_graph_launches

    from eagle_infer.generate import CUDA_GRAPHS

    target = repeating_target(vocab=24).cuda()
    prompts = [[1, 4, 7, 1, 4, 7, 1], [2, 5, 2, 5, 2]]
    ref = generate(target, prompts, 24, eos_token_ids=[])
    dec = NgramDecoder(target, 3, max_batch=2, max_seq_len=64).compile(mode=CUDA_GRAPHS)
    for _ in range(2):
        out, stats = generate_ngram(target, prompts, 24, eos_token_ids=[], decoder=dec)
        assert out == ref and stats.row_rounds > 0
    assert_no_cudagraph_skips()
    runs: list = []
    launches = cuda_graph_launches(
        lambda: runs.append(generate_ngram(target, prompts, 24, eos_token_ids=[], decoder=dec)))
    (out, stats), = runs
    assert out == ref and launches >= stats.rounds, (launches, stats.rounds)
