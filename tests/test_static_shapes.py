"""The draft step and the verify step have fixed shapes: torch.compile captures each as one
full graph on CPU, and on CUDA they replay as CUDA graphs. Output stays exact."""

from __future__ import annotations

import pytest
import torch
from test_speculative import prompts_for, random_head, tiny_target

from eagle_infer.generate import generate
from eagle_infer.speculative import SpecDecoder, generate_speculative
from eagle_infer.tree import TreeConfig

torch.set_num_threads(1)


def test_compiled_steps_fullgraph_cpu_exact():
    target = tiny_target(layers=2)
    head = random_head(target, "eagle3", draft_vocab=40)
    tree = TreeConfig(num_steps=3, eagle_topk=2, num_draft_tokens=6)
    dec = SpecDecoder(target, head, tree, max_batch=2, max_seq_len=128).compile()
    prompts = prompts_for(target.config.vocab_size, lens=(5, 9))
    out, _ = generate_speculative(target, head, prompts, 20, tree=tree, decoder=dec)
    assert out == generate(target, prompts, 20)


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_exact():
    target = tiny_target(layers=2).cuda()
    head = random_head(target, "eagle2").cuda()
    tree = TreeConfig(num_steps=4, eagle_topk=2, num_draft_tokens=8)
    dec = SpecDecoder(target, head, tree, max_batch=2, max_seq_len=128).compile(mode="reduce-overhead")
    prompts = prompts_for(target.config.vocab_size, lens=(5, 9))
    out, _ = generate_speculative(target, head, prompts, 24, tree=tree, decoder=dec)
    assert out == generate(target, prompts, 24)
