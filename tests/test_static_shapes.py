"""The draft step and the verify step have fixed shapes: torch.compile captures each as one
full graph on CPU, and on CUDA they replay as CUDA graphs. Output stays exact."""

from __future__ import annotations

import pytest
import torch
from test_speculative import prompts_for, random_head, tiny_target

from eagle_infer.engine import PlainDecoder
from eagle_infer.generate import CUDA_GRAPHS, compiled_kv_len, generate
from eagle_infer.sampling import SamplingParams
from eagle_infer.speculative import Sequence_, SpecDecoder, generate_speculative
from eagle_infer.tree import TreeConfig

torch.set_num_threads(1)

# Every CPU test below compiles at these shapes (a 2-layer tiny target, an EAGLE-3 head, a
# 6-node tree, up to 3 rows padded to the batch bucket of 4, a 256-slot cache), so the graphs
# one test compiles are Inductor cache hits for the next: cold, each distinct graph costs ~10 s
# of C++ compilation on a 2-core CPU.
TREE = TreeConfig(num_steps=3, eagle_topk=2, num_draft_tokens=6)
SHAPES = dict(max_batch=3, max_seq_len=256)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test counts the graphs it compiles itself: Dynamo would otherwise reuse another
    test's graphs of the same shapes. The compiled code still comes from Inductor's cache."""
    torch._dynamo.reset()


def tiny_pair(device: str = "cpu"):
    target = tiny_target(layers=2).to(device)
    return target, random_head(target, "eagle3", draft_vocab=40).to(device)


@pytest.mark.parametrize("mode", [None, CUDA_GRAPHS])
def test_compiled_kv_lengths_cover_and_repeat(mode):
    """A compiled step's kv length covers what it needs, never exceeds the cache, stays short of
    the full cache (its own specialisation) while it can, and takes few values: under CUDA
    graphs powers of two or multiples of 8 (Inductor's CUDA guard), elsewhere multiples of 64."""
    for max_seq_len in (128, 300, 512, 1000, 4096):
        lens = {compiled_kv_len(n, max_seq_len, mode) for n in range(1, max_seq_len + 1)}
        for n in range(1, max_seq_len + 1):
            kv = compiled_kv_len(n, max_seq_len, mode)
            assert n <= kv <= max_seq_len and (kv < max_seq_len or n > max_seq_len - 8)
        if mode == CUDA_GRAPHS:
            assert all(kv % 8 == 0 or kv == max_seq_len for kv in lens), sorted(lens)
            assert len(lens) <= 7, sorted(lens)
        else:
            assert all(kv % 64 == 0 or kv >= max_seq_len - 1 for kv in lens), sorted(lens)


def test_compiled_steps_fullgraph_cpu_exact():
    target, head = tiny_pair()
    dec = SpecDecoder(target, head, TREE, **SHAPES).compile()
    prompts = prompts_for(target.config.vocab_size, lens=(5, 9))
    out, _ = generate_speculative(target, head, prompts, 20, tree=TREE, decoder=dec)
    assert out == generate(target, prompts, 20)


def test_compiled_sampled_rounds_match_eager():
    """Rounds sampled at a temperature run verify, distributions, walk, commit, catch-up and the
    next draft phase as one graph (greedy rows beside them too); with top-p the compiled verify,
    then the rest as a second graph, the distributions made eagerly between: either way, seeded,
    a compiled decoder draws the same tokens as an eager one, and the greedy row plain greedy's."""
    target, head = tiny_pair()
    prompts = prompts_for(target.config.vocab_size, lens=(5, 9))
    for sampled in (SamplingParams(temperature=0.8, min_p=0.02, seed=1),
                    SamplingParams(temperature=0.8, top_p=0.9, seed=1)):
        params = [sampled, SamplingParams()]
        eager = SpecDecoder(target, head, TREE, **SHAPES)
        compiled = SpecDecoder(target, head, TREE, **SHAPES).compile()
        if sampled.graph_distribution:  # the two-graph round's steps: unused
            compiled.verify_fn = compiled.sampled_tail_fn = None
        out_eager, _ = generate_speculative(target, head, prompts, 20, params, tree=TREE, decoder=eager)
        out, _ = generate_speculative(target, head, prompts, 20, params, tree=TREE, decoder=compiled)
        assert out == out_eager
        assert out[1] == generate(target, prompts[1:], 20)[0]


def test_compiled_plain_steps_draw_sampled_tokens_in_the_graph_as_eager_does(monkeypatch):
    """Plain decoding sampled at a temperature and min-p (greedy rows beside): the compiled step
    draws each row's token in its graph, at the uniform the row's generator gives pick_tokens
    eagerly, so seeded, generate and the server's decoder draw the same tokens compiled as
    eager, the greedy row plain greedy's; pick_tokens runs for generate's prefill token alone."""
    import eagle_infer.engine
    import eagle_infer.generate

    target = tiny_target(layers=2)
    prompts = prompts_for(target.config.vocab_size, lens=(5, 9, 3))
    params = [SamplingParams(temperature=0.8, min_p=0.02, seed=1), SamplingParams(),
              SamplingParams(temperature=1.3, seed=2)]
    eager = generate(target, prompts, 20, params)
    picks = []
    real = eagle_infer.generate.pick_tokens
    for module in (eagle_infer.generate, eagle_infer.engine):
        monkeypatch.setattr(module, "pick_tokens", lambda *a: picks.append(1) or real(*a))
    assert generate(target, prompts, 20, params, compile=True) == eager and len(picks) == 1
    assert eager[1] == generate(target, prompts[1:2], 20)[0] and eager[0] != eager[2]
    picks.clear()
    dec = PlainDecoder(target, **SHAPES).compile()
    seqs = [Sequence_(p, sp, 20, set()) for p, sp in zip(prompts, params)]
    dec.add_many(seqs)
    while dec.seqs:
        dec.step()
    assert [s.output for s in seqs] == eager and not picks  # its first tokens: next_token's


def test_compiled_plain_decode_exact_one_graph_per_batch_bucket():
    """Prompt lengths and batch sizes vary; once the cache is sized, each batch bucket (1, 2, 4,
    8) compiles one graph and every other call reuses it: no recompile storm."""
    from torch._dynamo.utils import counters

    target = tiny_target(layers=2)
    vocab = target.config.vocab_size
    runs = [(3, 5, 7, 9, 11), (5,), (9, 3), (17, 4, 11), (30,), (2, 40, 6), (12, 13), (60, 1, 2, 3, 4, 5, 6)]
    counters.clear()
    for lens in runs:
        prompts = prompts_for(vocab, lens=lens)
        assert generate(target, prompts, 10, compile=True) == generate(target, prompts, 10), lens
    # 8 runs over batch buckets 8, 1, 2, 4, 1, 4, 2, 8 and one cache (8 rows, kv bucket 128).
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])


def serve_all(dec, jobs: list[tuple[list[int], int]],
              params: SamplingParams | None = None) -> tuple[list[list[int]], list[int]]:
    """Run (prompt, max_new_tokens) jobs through a decoder the way the server does: join while
    rows are free, one step at a time; returns the outputs and the batch size of every step."""
    seqs = [Sequence_(p, params or SamplingParams(), n, set()) for p, n in jobs]
    waiting, batches = list(seqs), []
    while waiting or dec.seqs:
        while waiting and dec.free_rows:
            dec.add(waiting.pop(0))
        batches.append(len(dec.seqs))
        dec.step()
    return [s.output for s in seqs], batches


def cuda_graph_launches(fn) -> int:
    """cudaGraphLaunch calls while fn runs (torch.profiler): a step replayed from a CUDA graph
    makes one; an eager or Inductor-only step launches its kernels one by one instead."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch")


def assert_no_cudagraph_skips() -> None:
    """Inductor counts each graph it compiled for CUDA graphs but ran without them (a CPU
    tensor, an input mutation it cannot replay, ...): none may fall back silently."""
    from torch._dynamo.utils import counters

    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def check_replayed(dec, jobs: list[tuple[list[int], int]], ref: list[list[int]]) -> None:
    """Serving the jobs again on a decoder that served them once replays CUDA graphs (a launch
    per step at least every few tokens) and gives the same output."""
    out: list = []
    launches = cuda_graph_launches(lambda: out.append(serve_all(dec, jobs)[0]))
    assert out == [ref] and launches >= max(n for _, n in jobs) // 2, launches


def check_decoders_at_batch_buckets(device: str, mode: str | None) -> None:
    """The server's decoders, compiled and warmed up as the server starts them (engine.warm_up
    runs each batch bucket up to max_bs once, greedy, sampled, with top-p): afterwards requests of any
    batch size, prompt length and sampling compile nothing new, and the warm-up's rounds are not
    in the statistics. Batches of 3 run padded to the bucket of 4 (the padding rows write only
    to rows no sequence holds), 1 and 2 at their own; output equals plain greedy decoding at
    every batch size the steps went through. A bucket over max_bs runs eagerly: the plain decoder
    again at max_bs 2, the speculative ones with rounds without drafts above batch 1 (their
    target step, and the head's deferred catch-up, which warm_up runs long enough to reach) and
    with a batch tree from 2 compiled up to bucket 2 only (a cold graph costs 15-30 s
    on a 2-core AMD Zen 1: bucket 4 is the plain and the speculative decoder's)."""
    from torch._dynamo.utils import counters

    from eagle_infer.engine import warm_up

    target, head = tiny_pair(device)
    prompts = prompts_for(target.config.vocab_size, lens=(5, 90, 3, 40))
    jobs = list(zip(prompts, (6, 14, 10, 18)))  # finishing apart: batches 3, 2, 1 and back
    ref = [generate(target, [p], n)[0] for p, n in jobs]
    small = (2, TreeConfig(1, 2, 3))  # the batch tree from 2 sequences
    # The decoders compiled up to bucket 2 only get four cache rows, the shape of the ones compiled
    # to bucket 4, whose batch-1 graphs then serve them too (Dynamo's cache is the functions',
    # shared by decoders of the same shapes)
    four = dict(SHAPES, max_batch=4)
    for make, max_bs in ((lambda: PlainDecoder(target, **SHAPES), None),
                         (lambda: SpecDecoder(target, head, TREE, **SHAPES), None),
                         (lambda: SpecDecoder(target, head, TREE, disable_by_batch_size=1, **four), 2),
                         (lambda: SpecDecoder(target, head, TREE, batch_tree=small, **four), 2)):
        counters.clear()
        dec = make().compile(mode, max_bs=max_bs)
        # cache rows for the padded bucket of 4 where it is compiled, else one a sequence
        rows = 4 if dec.max_bs == 4 else dec.max_batch
        assert dec.max_bs == (max_bs or 4) and target.cache.kv.shape[2] == rows
        seen: list = []  # what warm_up reports as it goes (the server logs it)
        sizes = warm_up(dec, lambda n, all_sizes, s, seen=seen: seen.append((n, all_sizes)))
        assert sizes == [1, 2, 3][:dec.max_bs] and dec.stats.rounds == 0 and not dec.seqs
        assert seen == [(n, sizes) for n in sizes]
        graphs = counters["stats"]["unique_graphs"]
        # spec: draft phase, greedy round, sampled round, top-p's verify and the rest, a bucket each
        if mode is None:
            if isinstance(dec, PlainDecoder):
                want = 2 * 3  # greedy and sampled at a temperature, buckets 1, 2, 4
            elif dec.disable_by_batch_size:
                want = 4  # bucket 2 without drafts: the target's step greedy and sampled at a
                # temperature, top-p's verify, the deferred catch-up
            elif dec.batch_tree:
                want = 5  # bucket 2 on its tree
            else:
                want = 5 * 3  # buckets 1, 2, 4
            assert graphs == want, dict(counters["stats"])
        out, batches = serve_all(dec, jobs)
        assert out == ref and {1, 2, 3} <= set(batches), batches
        serve_all(dec, jobs, SamplingParams(temperature=0.8, seed=3))
        serve_all(dec, jobs, SamplingParams(temperature=0.8, top_k=4, repetition_penalty=1.2, seed=3))
        assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
        if getattr(dec, "disable_by_batch_size", None):
            assert dec.stats.plain_rounds > 0 and dec.stats.rounds > 0
        if mode == CUDA_GRAPHS:  # the same jobs again replay the graphs recorded above
            assert_no_cudagraph_skips()
            check_replayed(dec, jobs, ref)
        if isinstance(dec, PlainDecoder):
            counters.clear()
            eager_over = PlainDecoder(target, **four).compile(mode, max_bs=2)
            out, batches = serve_all(eager_over, jobs)
            assert out == ref and {3, 4} <= set(batches)  # batches of 3 and 4 (bucket 4) run eagerly
            # buckets 1 and 2 only; on CPU the graphs compiled above (the same cache shape): none new
            assert counters["stats"]["unique_graphs"] <= (0 if mode is None else 2)


def test_inductor_steps_one_graph_per_batch_bucket_across_kv_lengths():
    """Under Inductor the kv length is a traced symbol: prompts of 5 to 220 tokens (kv lengths
    64 to 255 of a 256-slot cache) reuse one graph per step at batch 1, output exact. With the
    length static this compiled a graph per power-of-two kv bucket (3 here)."""
    from torch._dynamo.utils import counters

    target, head = tiny_pair()
    prompts = prompts_for(target.config.vocab_size, lens=(5, 70, 150, 220))
    jobs = [(p, 12) for p in prompts]
    ref = [generate(target, [p], n)[0] for p, n in jobs]
    for make, steps in ((lambda: PlainDecoder(target, **SHAPES), 1),
                        (lambda: SpecDecoder(target, head, TREE, **SHAPES), 2)):
        counters.clear()
        dec = make().compile()
        served = [serve_all(dec, [job]) for job in jobs]  # one at a time: batch 1
        assert [o for (o,), _ in served] == ref and {b for _, bs in served for b in bs} == {1}
        assert counters["stats"]["unique_graphs"] == steps, dict(counters["stats"])


def test_server_decoders_compiled_at_batch_buckets_exact():
    check_decoders_at_batch_buckets("cpu", None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_server_decoders_replay_cuda_graphs_at_batch_buckets_exact():
    check_decoders_at_batch_buckets("cuda", CUDA_GRAPHS)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_exact():
    """Speculative decoding with the draft phase and greedy rounds (verify to the next round's
    draft phase) replayed from CUDA graphs: the same
    tokens as eager plain decoding, and the second call launches graphs, not kernels one by one
    (the first records them: cudagraph trees run a new shape once eagerly, then record)."""
    from torch._dynamo.utils import counters

    target = tiny_target(layers=2).cuda()
    head = random_head(target, "eagle2").cuda()
    tree = TreeConfig(num_steps=4, eagle_topk=2, num_draft_tokens=8)
    counters.clear()
    dec = SpecDecoder(target, head, tree, max_batch=2, max_seq_len=128).compile(mode=CUDA_GRAPHS)
    prompts = prompts_for(target.config.vocab_size, lens=(5, 9))
    ref = generate(target, prompts, 24)
    for _ in range(2):
        out, _ = generate_speculative(target, head, prompts, 24, tree=tree, decoder=dec)
        assert out == ref
    assert_no_cudagraph_skips()
    runs: list = []
    launches = cuda_graph_launches(
        lambda: runs.append(generate_speculative(target, head, prompts, 24, tree=tree, decoder=dec)))
    (out, stats), = runs
    assert out == ref
    # a graph a greedy round (the next round's draft phase in it), two in the first round
    assert launches >= stats.rounds + 1, (launches, stats.rounds)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_plain_generate_compiled_replays_graphs():
    """generate(compile=True) on CUDA runs its decode step from CUDA graphs (compile_mode_for)
    at batch buckets: output equals eager decoding, one graph launch per step once recorded."""
    target = tiny_target(layers=2).cuda()
    prompts = prompts_for(target.config.vocab_size, lens=(5, 9, 3))
    ref = generate(target, prompts, 20)
    for _ in range(2):
        assert generate(target, prompts, 20, compile=True) == ref
    assert_no_cudagraph_skips()
    out: list = []
    assert cuda_graph_launches(lambda: out.append(generate(target, prompts, 20, compile=True))) >= 19
    assert out == [ref]


def test_compiled_plain_rounds_draw_sampled_tokens_in_the_graph_as_eager_does(monkeypatch):
    """Rounds without drafts (disable_by_batch_size) sampled at a temperature and min-p, greedy
    rows beside: the target's step draws each bonus in its graph (_plain_round_sampled) at the
    uniforms the eager round draws after its verify (accept_sampling), so seeded, the in-graph
    draw compiled and eager gives the eager round's tokens, and the greedy row plain greedy's."""
    target, head = tiny_pair()
    prompts = prompts_for(target.config.vocab_size, lens=(5, 9, 3))
    params = [SamplingParams(temperature=0.8, min_p=0.02, seed=1), SamplingParams(),
              SamplingParams(temperature=1.3, seed=2)]

    def decode(dec: SpecDecoder) -> list[list[int]]:
        out, _ = generate_speculative(target, head, prompts, 20, params, tree=TREE, decoder=dec)
        assert dec.stats.plain_rounds > 0 and dec.stats.rounds == 0
        return out

    in_graph = decode(SpecDecoder(target, head, TREE, disable_by_batch_size=0, **SHAPES))
    compiled = SpecDecoder(target, head, TREE, disable_by_batch_size=0, **SHAPES).compile()
    compiled.verify_fn = None  # the eager round's verify: unused
    assert decode(compiled) == in_graph
    with monkeypatch.context() as m:  # every row through the eager round: distributions, then the walk
        m.setattr(SamplingParams, "graph_distribution", property(lambda self: False))
        eager = decode(SpecDecoder(target, head, TREE, disable_by_batch_size=0, **SHAPES))
    assert in_graph == eager and in_graph[0] != in_graph[2]
    assert in_graph[1] == generate(target, prompts[1:2], 20)[0]
