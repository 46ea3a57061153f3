"""The target runtime against transformers, and the cache operations speculative decoding needs.

Every test runs on the default SmolLM2 (real weights) and on tiny random checkpoints of each
supported architecture (GQA Llama, Qwen2 with attention bias, tied embeddings with an
explicit head_dim, Llama-3 rope scaling, Mistral, Qwen3 with query/key norms).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle_infer.errors import UserError
from eagle_infer.generate import chat_prompt_ids, generate, prefill
from eagle_infer.loader import load_model
from eagle_infer.model import build_attn_mask, causal_mask

REPO = Path(__file__).resolve().parents[1]
# CLI subprocesses: one thread unless told otherwise (see conftest.pytest_configure).
CLI_ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
ALL_TARGETS = ["default", "llama", "qwen2", "tied", "llama3_rope", "mistral", "mistral_window", "qwen3",
               "qwen3_window", "phi3", "gemma", "gemma2", "gemma3", "gemma3_vision"]
# Cache tests need no second look at the rope variants.
CACHE_TARGETS = ["default", "llama", "qwen2", "tied", "mistral_window", "qwen3", "qwen3_window", "phi3",
                 "gemma2", "gemma3"]

CHAT_MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "user", "content": "Give me three tips for learning to program."},
        {"role": "assistant", "content": "Practice daily, read other people's code, build projects."},
        {"role": "user", "content": "Explain the second one in more detail, with an example."},
    ],
]


@pytest.fixture
def target(request, default_model_fp32, hf_default_fp32, tokenizer, tiny_models):
    """(our model, HF model or None, list of prompt token-id lists) for a target name."""
    name = request.param
    if name == "default":
        prompts = [tokenizer("Hello")["input_ids"],
                   tokenizer("The quick brown fox jumps over the lazy dog because")["input_ids"]]
        prompts += [chat_prompt_ids(tokenizer, m) for m in CHAT_MESSAGES]
        return default_model_fp32, hf_default_fp32, prompts
    ours, hf = tiny_models(name)
    g = torch.Generator().manual_seed(7)
    vocab = ours.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 17, 60)]
    return ours, hf, prompts


def full_forward(model, ids: list[int], hidden_layers=()):
    """Score a whole sequence on a fresh cache: logits [T, V] and hidden states [T, H]."""
    T = len(ids)
    model.setup_cache(1, T)
    pos = torch.arange(T)[None]
    mask = causal_mask(torch.zeros(1, dtype=torch.long), T, T)
    with torch.no_grad():
        logits, hidden = model(torch.tensor([ids]), pos, pos, mask, hidden_layers=hidden_layers)
    return logits[0], [h[0] for h in hidden]


# ---------------------------------------------------------------------------------------
# Against transformers


@pytest.mark.parametrize("target", ALL_TARGETS, indirect=True)
def test_logits_and_hidden_states_match_transformers(target):
    model, hf, prompts = target
    n = model.config.num_layers
    layers = sorted({i for i in (0, 2, n // 2, n - 3, n) if 0 <= i <= n})
    for ids in prompts:
        n_ids = len(ids)
        logits, hidden = full_forward(model, ids, hidden_layers=layers)
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), output_hidden_states=True)
        assert len(ref.hidden_states) == n + 1
        torch.testing.assert_close(logits, ref.logits[0], atol=1e-3, rtol=0,
                                   msg=lambda m, n_ids=n_ids: f"logits, prompt of {n_ids} tokens: {m}")
        for i, h in zip(layers, hidden):
            # The residual stream has a few massive activations (~2e4 in SmolLM2): allow a
            # relative error there, fp32 rounding level.
            torch.testing.assert_close(h, ref.hidden_states[i][0], atol=1e-3, rtol=1e-5,
                                       msg=lambda m, i=i: f"hidden state {i}: {m}")


def test_eagle3_layer_ids_are_hf_indices(default_model_fp32):
    # Inputs of layers 2, N/2, N-3 (reference section 2); SmolLM2 has 30 layers.
    assert default_model_fp32.config.eagle3_layer_ids() == [2, 15, 27]


# ---------------------------------------------------------------------------------------
# Batching and the tree / keep_slots machinery


@pytest.mark.parametrize("target", CACHE_TARGETS, indirect=True)
def test_batched_prefill_matches_single(target):
    model, _, prompts = target
    model.setup_cache(len(prompts), max(map(len, prompts)) + 8)
    batched, _ = prefill(model, prompts)
    for i, ids in enumerate(prompts):
        alone, _ = full_forward(model, ids)
        torch.testing.assert_close(batched[i], alone[-1], atol=1e-4, rtol=0,
                                   msg=lambda m, i=i: f"prompt {i}: {m}")


# Two trees of 7 nodes (node 0 = root), given by parent index. Tree B lists a depth-1 node
# after depth-2 ones, so slot order and position order differ.
TREE_A = [-1, 0, 0, 1, 1, 2, 3]  # depths 0 1 1 2 2 2 3
TREE_B = [-1, 0, 1, 1, 0, 2, 4]  # depths 0 1 2 2 1 3 2
# Accepted root-to-node paths used in the keep_slots test (non-contiguous slots).
PATH_A = [0, 1, 3, 6]
PATH_B = [0, 4, 6]


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Root-to-node path (node indices) for every node."""
    paths = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


def tree_local_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, path in enumerate(tree_paths(parents)):
        mask[i, path] = True
    return mask


def score_trees(model, prompts, trees, tree_tokens):
    """Prefill two prompts, then score one tree per sequence in a single forward."""
    B, T = len(prompts), len(trees[0])
    prefix = torch.tensor([len(p) for p in prompts])
    kv_len = int(prefix.max()) + T + 8
    model.setup_cache(B, kv_len + 8)
    prefill(model, prompts)
    local = torch.stack([tree_local_mask(t) for t in trees])  # [B, T, T]
    depth = torch.tensor([[len(p) - 1 for p in tree_paths(t)] for t in trees])
    idx = torch.arange(T)[None]
    with torch.no_grad():
        logits, _ = model(tree_tokens, prefix[:, None] + depth, prefix[:, None] + idx,
                          build_attn_mask(prefix, local, kv_len))
    return logits, prefix, kv_len


def two_prompts(prompts):
    return [prompts[1], prompts[-1]]  # different lengths


@pytest.mark.parametrize("target", CACHE_TARGETS, indirect=True)
def test_tree_scoring_matches_chains(target):
    model, _, prompts = target
    prompts = two_prompts(prompts)
    trees = [TREE_A, TREE_B]
    g = torch.Generator().manual_seed(3)
    tree_tokens = torch.randint(3, model.config.vocab_size, (2, 7), generator=g)
    logits, _, _ = score_trees(model, prompts, trees, tree_tokens)
    for b, (prompt, parents) in enumerate(zip(prompts, trees)):
        leaves = [i for i in range(len(parents)) if i not in parents]
        for leaf in leaves:
            path = tree_paths(parents)[leaf]
            ref, _ = full_forward(model, prompt + tree_tokens[b, path].tolist())
            got = logits[b, path]
            torch.testing.assert_close(got, ref[len(prompt) - 1 + 1:], atol=1e-4, rtol=0,
                                       msg=lambda m, b=b, p=path: f"seq {b}, path {p}: {m}")


@pytest.mark.parametrize("target", CACHE_TARGETS, indirect=True)
def test_keep_slots_then_decode_matches_fresh_prefill(target):
    model, _, prompts = target
    prompts = two_prompts(prompts)
    trees, paths = [TREE_A, TREE_B], [PATH_A, PATH_B]
    g = torch.Generator().manual_seed(5)
    V = model.config.vocab_size
    tree_tokens = torch.randint(3, V, (2, 7), generator=g)
    extra = torch.randint(3, V, (2, 3), generator=g)  # tokens decoded after the accepted path
    tree_logits, prefix, kv_len = score_trees(model, prompts, trees, tree_tokens)

    K = max(map(len, paths))
    src = torch.stack([prefix[b] + torch.tensor(p + [p[-1]] * (K - len(p))) for b, p in enumerate(paths)])
    model.keep_slots(src, prefix)
    cur = prefix + torch.tensor([len(p) for p in paths])
    step_logits = []
    with torch.no_grad():
        for t in range(extra.shape[1]):
            out, _ = model(extra[:, t : t + 1], cur[:, None], cur[:, None], causal_mask(cur, 1, kv_len))
            step_logits.append(out[:, 0])
            cur = cur + 1
    step_logits = torch.stack(step_logits, 1)  # [B, 3, V]

    for b, (prompt, path) in enumerate(zip(prompts, paths)):
        accepted = tree_tokens[b, path].tolist()
        ref, _ = full_forward(model, prompt + accepted + extra[b].tolist())
        start = len(prompt) + len(accepted)
        # The tree's logits at the last accepted node predict the first extra token.
        torch.testing.assert_close(tree_logits[b, path[-1]], ref[start - 1], atol=1e-4, rtol=0)
        torch.testing.assert_close(step_logits[b], ref[start:], atol=1e-4, rtol=0,
                                   msg=lambda m, b=b: f"seq {b} after keep_slots: {m}")


def test_compiled_keep_moves_the_rows_without_copying_the_whole_cache():
    """A cache write through the opaque op (as a verify's layers make) then KVCache.keep, compiled:
    the same cache as eager, and no kernel over the whole cache (an index_copy_ in keep made
    Inductor end such graphs with a copy of the cache onto itself: 6.6 MB a verify)."""
    from torch._inductor.utils import run_and_get_code

    from eagle_infer.model import KVCache, kv_write

    caches = [KVCache(3, 2, 2, 40, 16, torch.float32, "cpu") for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    caches[0].kv.normal_(generator=g)
    caches[1].kv.copy_(caches[0].kv)
    before = caches[0].kv.clone()
    new, index = torch.randn(4, 16, generator=g), torch.tensor([1, 50, 99, 130])
    src, dst = torch.tensor([[5, 7, 8], [9, 12, 12]]), torch.tensor([[2, 3, 4], [6, 7, 8]])

    def step(cache: KVCache, new: torch.Tensor, index: torch.Tensor, src: torch.Tensor, dst: torch.Tensor):
        kv_write(cache.kv, index, new)
        cache.keep(src, dst)

    step(caches[1], new, index, src, dst)  # eager
    assert torch.equal(caches[1].kv[:, :, 1, :, 7], before[:, :, 1, :, 12])  # row 1: slot 12 kept at 7
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(step, fullgraph=True), caches[0], new, index, src, dst)
    assert torch.equal(caches[0].kv, caches[1].kv)
    assert f"{caches[0].kv.numel()}L" not in "\n".join(code)  # no loop over every cache element


def test_bf16_runs_and_agrees_with_fp32(default_model_dir, default_model_fp32, tokenizer):
    bf16 = load_model(default_model_dir, "bf16", "cpu")
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    ids = chat_prompt_ids(tokenizer, CHAT_MESSAGES[0])
    out_bf16 = generate(bf16, [ids], 6)[0]
    out_fp32 = generate(default_model_fp32, [ids], 6)[0]
    assert out_bf16[:4] == out_fp32[:4], (tokenizer.decode(out_bf16), tokenizer.decode(out_fp32))
    lb, _ = full_forward(bf16, ids)
    lf, _ = full_forward(default_model_fp32, ids)
    assert lb.dtype == torch.bfloat16
    # Loose: bf16 rounding over 30 layers, but the same distribution shape.
    cos = torch.nn.functional.cosine_similarity(lb[-1].float(), lf[-1], dim=0)
    assert cos > 0.99, float(cos)


# ---------------------------------------------------------------------------------------
# Bad input


def test_missing_model_folder(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises((UserError, FileNotFoundError), match="no_such_model"):
        load_model(missing, "fp32", "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises((UserError, FileNotFoundError), match="config.json"):
        load_model(tmp_path / "empty", "fp32", "cpu")


def test_unsupported_architecture(tmp_path):
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 10,
           "n_embd": 8, "n_layer": 1, "n_head": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="gpt2"):
        load_model(tmp_path, "fp32", "cpu")


def test_folder_without_weights(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_text((tiny_model_dir("llama") / "config.json").read_text())
    with pytest.raises(UserError, match="safetensors"):
        load_model(tmp_path, "fp32", "cpu")


def test_weights_of_another_shape(tmp_path, tiny_model_dir):
    # qwen2 config (with biases) over llama weights (without): a clear error, not a crash.
    cfg = json.loads((tiny_model_dir("qwen2") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((tiny_model_dir("llama") / "model.safetensors").read_bytes())
    with pytest.raises(UserError, match="missing"):
        load_model(tmp_path, "fp32", "cpu")


def test_sliding_windows_are_read_as_transformers_uses_them(tiny_model_dir):
    """A config's window slides where transformers slides it (Mistral and Phi-3 unless told
    otherwise, every layer; Qwen2 and Qwen3 only with use_sliding_window, from max_window_layers
    on), and the whole context is served: one window for every layer folds into the step's mask,
    which the fused layer op reads; others get their own (as Gemma's)."""
    from eagle_infer.heads import HeadConfig
    from eagle_infer.model import ModelConfig

    base = json.loads((tiny_model_dir("llama") / "config.json").read_text())  # 4 layers, context 128
    every = (0, 1, 2, 3)
    cases = [("mistral", {"sliding_window": 32}, every), ("mistral", {"sliding_window": None}, ()),
             ("qwen2", {"sliding_window": 32, "use_sliding_window": False}, ()),
             ("qwen3", {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 2}, (2, 3)),
             ("phi3", {"sliding_window": 32}, every),  # Phi-3-mini-4k's 2047 of 4096
             ("mistral", {"sliding_window": 4096}, ())]
    for model_type, extra, sliding in cases:
        cfg = ModelConfig.from_hf({**base, "model_type": model_type, **extra})
        assert cfg.max_position_embeddings == 128 and cfg.sliding_layers == sliding, (model_type, extra)
        assert cfg.window_everywhere() is (sliding == every) and cfg.fused_layers_compute()
        assert cfg.qk_norm is (model_type == "qwen3")
        # a head for it declares the target's own context, as the target's config does
        head = HeadConfig.for_target(cfg, "eagle3")
        assert head.to_hf()["max_position_embeddings"] == base["max_position_embeddings"] == 128


def test_phi3_configs_of_every_vintage(tiny_model_dir):
    """Phi-3 configs name LongRoPE "su" (Phi-3-mini-128k), "longrope" or transformers 5's
    rope_parameters, with the original context at the top level or inside: each serves the whole
    context, its tables turn with the short factors (and a second half with the long ones), cos /
    sin scaled by LongRoPE's
    attention factor, and a head for it takes plain RoPE (the long/short factors are sized for the
    target's partial rotary). Other activations than SiLU are refused by name."""
    from eagle_infer.heads import HeadConfig
    from eagle_infer.model import ModelConfig, rope_attention_factor, rope_tables

    base = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    base |= {"model_type": "phi3", "max_position_embeddings": 512, "partial_rotary_factor": 0.5}
    short, long = [1.0 + i for i in range(4)], [8.0] * 4  # head size 16, 8 dims turned
    old = {"rope_scaling": {"type": "su", "short_factor": short, "long_factor": long},
           "original_max_position_embeddings": 128}
    new = {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                               "long_factor": long, "original_max_position_embeddings": 128,
                               "partial_rotary_factor": 0.5}}
    for extra in (old, new):
        cfg = ModelConfig.from_hf({k: v for k, v in base.items() if k != "rope_parameters"} | extra)
        assert cfg.rope_scaling["rope_type"] == "longrope"
        assert (cfg.max_position_embeddings, cfg.rotary_dim, cfg.long_rope_from()) == (512, 8, 128)
        factor = rope_attention_factor(cfg)
        assert factor == pytest.approx((1 + math.log(4.0) / math.log(128.0)) ** 0.5)
        cos, sin = rope_tables(cfg, 200)  # [2 x 200, 16]: turned 0-3 and 8-11, still 4-7 and 12-15
        assert cos.shape == (400, 16)
        assert torch.equal(cos[:, 4:8], torch.ones(400, 4)) and torch.equal(sin[:, 12:], torch.zeros(400, 4))
        assert cos[0, 0] == pytest.approx(factor)
        for row, pos, f in ((5, 5, 4.0), (150, 150, 4.0), (205, 5, 8.0), (399, 199, 8.0)):
            assert cos[row, 3] == pytest.approx(factor * math.cos(pos / f / 10000 ** 0.75)), row
        head = HeadConfig.for_target(cfg, "eagle3")
        assert head.rope_scaling is None and head.rope_config().rotary_dim == head.head_dim
    with pytest.raises(UserError, match="hidden_act 'gelu_new'"):
        ModelConfig.from_hf(base | {"hidden_act": "gelu_new"})


def test_a_gemma3_with_its_vision_tower_reads_as_its_language_model():
    """gemma-3-4b-it's config.json (the Hub's: text_config holds only what differs from
    transformers' defaults, eos at the top): the language model's full config, as transformers
    completes it."""
    from eagle_infer.model import ModelConfig

    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}
    cfg = ModelConfig.from_hf(hub)
    assert (cfg.model_type, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("gemma3_text", 34, 8, 4)
    assert cfg.head_dim == 256
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.eos_token_ids) == (262208, 131072, [1, 106])
    assert cfg.rope_scaling["rope_type"] == "linear" and cfg.rope_scaling["factor"] == 8.0
    assert cfg.rope_theta == 1e6
    assert cfg.local_rope_theta == 1e4 and cfg.sliding_window == 1024 and cfg.tie_word_embeddings
    assert [i for i in range(34) if i not in cfg.sliding_layers] == [5, 11, 17, 23, 29]


def test_generation_configs_end_of_turn_ends_decoding(tmp_path, tiny_model_dir):
    """An instruct checkpoint's end-of-turn id lives in generation_config.json (Gemma's
    <end_of_turn>, Llama 3's <|eot_id|>): the loaded target stops there too, as vLLM does."""
    import shutil

    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir("llama") / f, tmp_path / f)
    free = load_model(tmp_path, "fp32", "cpu")
    assert free.config.eos_token_ids == [2]
    out = generate(free, [[5, 6, 7]], 24, eos_token_ids=[])[0]
    turn_end = next(t for t in out[1:] if t != 2)  # a token it emits after the first
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, turn_end]}))
    model = load_model(tmp_path, "fp32", "cpu")
    assert model.config.eos_token_ids == [2, turn_end]
    got = generate(model, [[5, 6, 7]], 24)[0]
    assert got == out[:out.index(turn_end) + 1]


def test_longrope_sequences_turn_with_one_set_of_factors(tiny_models):
    """A LongRoPE target (the tiny Phi-3: original context 96 of 256) turns a sequence that may
    pass its original context (prompt + max new tokens) with the long factors throughout, others
    with the short ones. transformers agrees where it makes one choice: a sequence that stays
    within (short) and a prompt past it (long); one that decoding carries past it matches
    transformers with the long factors throughout (vLLM's choice once its context is longer; Phi-3's
    generate in transformers runs short until the switch, then recomputes the cache long). Greedy,
    one sequence at a time, in a batch, and speculatively."""
    from test_speculative import random_head
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from eagle_infer.generate import generate
    from eagle_infer.speculative import generate_speculative
    from eagle_infer.tree import TreeConfig

    ours, hf = tiny_models("phi3")
    assert ours.config.long_rope_from() == 96 and ours.config.max_position_embeddings == 256
    g = torch.Generator().manual_seed(3)
    within, past = (torch.randint(3, 256, (n,), generator=g).tolist() for n in (80, 100))

    def hf_greedy(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
        return out[0, len(ids):].tolist()

    short16, long24 = hf_greedy(within, 16), hf_greedy(past, 24)
    rotary = hf.model.rotary_emb
    short_inv_freq = rotary.original_inv_freq.clone()
    rotary.original_inv_freq.copy_(ROPE_INIT_FUNCTIONS["longrope"](hf.config, None, seq_len=97)[0])
    try:  # transformers with the long factors at every length
        crossing24 = hf_greedy(within, 24)
        assert hf_greedy(within, 16) != short16  # the two sets of factors part within 16 tokens
    finally:
        rotary.original_inv_freq.copy_(short_inv_freq)
    assert generate(ours, [within], 16) == [short16]
    assert generate(ours, [past], 24) == [long24]
    assert generate(ours, [within], 24) == [crossing24]
    assert generate(ours, [within, past], 24) == [crossing24, long24]
    # rows sorted by prompt length: a row's choice sits in the cache, and a row moved (a finished
    # sequence's row reused) takes it along
    assert ours.cache.rope_row0[:2].tolist() == [ours.max_seq_len] * 2
    generate(ours, [within, past[:90]], 6)
    assert ours.cache.rope_row0[:2].tolist() == [0, 0]
    ours.cache.rope_row0[1] = 7
    ours.cache.copy_prefix(1, 0, 5)
    assert ours.cache.rope_row0[:2].tolist() == [7, 7]
    ours.cache.rope_row0[0] = 3
    ours.cache.swap_rows(0, 1, 5)
    assert ours.cache.rope_row0[:2].tolist() == [7, 3]
    # compiled steps read each row's choice at run time (Inductor's weight freezing, the fp32
    # default on AVX-512 CPUs, must not fold it in): long, short and long again in one graph
    for n, want in ((24, crossing24), (16, short16), (24, crossing24)):
        assert generate(ours, [within], n, compile=True) == [want], n
    head = random_head(ours, "eagle3", draft_vocab=64)
    for tree in (TreeConfig(), TreeConfig.chain(3)):
        assert generate_speculative(ours, head, [within, past], 24, tree=tree)[0] == [crossing24, long24]
        assert generate_speculative(ours, head, [within], 16, tree=tree)[0] == [short16]


def test_prompt_logprobs_are_of_the_soft_capped_logits(tiny_models):
    """Gemma 2 caps its logits: prompt logprobs (scored from the prefill's final states) are those
    of transformers' capped logits, as the decoding steps' are."""
    from eagle_infer.sampling import SamplingParams
    from eagle_infer.speculative import Sequence_, prefill_rows

    model, hf = tiny_models("gemma2")
    ids = torch.randint(3, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    ids = ids.tolist()
    seq = Sequence_(ids, SamplingParams(), 4, set())
    seq.prompt_logprobs = 0
    model.setup_cache(1, 32)
    with torch.no_grad():
        prefill_rows(model, [seq], 0, 32)
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = [float(ref[t, ids[t + 1]]) for t in range(len(ids) - 1)]
    assert [lp[0] for lp in seq.prompt_token_logprobs] == pytest.approx(want, abs=1e-4)


def test_prompt_longer_than_context(tiny_models):
    model, _ = tiny_models("llama")
    ctx = model.config.max_position_embeddings
    with pytest.raises(UserError, match="context"):
        generate(model, [[5] * (ctx + 10)], 4)
    with pytest.raises(UserError, match="context"):
        generate(model, [[5] * (ctx - 2)], 4)  # fits alone, not with the new tokens
    with pytest.raises(UserError, match="context"):
        model.setup_cache(1, ctx + 1)
    with pytest.raises(UserError, match="empty"):
        generate(model, [[5, 6], []], 4)


def test_bad_dtypes(tiny_model_dir):
    with pytest.raises(UserError, match="fp16"):
        load_model(tiny_model_dir("llama"), "fp16", "cpu")
    with pytest.raises(UserError, match="int8"):
        load_model(tiny_model_dir("llama"), "int8", "cpu")


def test_cli_missing_model_is_one_error_line():
    proc = subprocess.run(
        [sys.executable, "-m", "eagle_infer.generate", "--model-path", "/nope"],
        cwd=REPO, env=CLI_ENV, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "/nope" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cpu_fp32_linears_are_column_major_with_the_same_values(tiny_model_dir):
    """load_model stores fp32 Linear weights on CPU transposed-contiguous (fast few-row GEMMs for
    tree verification): same values and names as the checkpoint, tied embedding still shared,
    and a 4-token forward equal to the row-major model's."""
    from eagle_infer.loader import column_major_linears

    path = tiny_model_dir("llama")
    col = load_model(path, dtype="fp32", device="cpu")
    row = load_model(path, dtype="fp32", device="cpu")
    for m in row.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.data = m.weight.data.contiguous()
    linears = [(n, m.weight) for n, m in col.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(w.t().is_contiguous() and not w.is_contiguous() for _, w in linears)
    rows = dict(row.named_parameters())
    assert all(torch.equal(w, rows[n + ".weight"]) for n, w in linears)
    if col.config.tie_word_embeddings:
        assert col.lm_head.weight is col.embed_tokens.weight
    for m in (col, row):
        m.setup_cache(1, 64)
    tokens = torch.tensor([[5, 9, 2, 7]])
    pos = torch.arange(4)[None]
    mask = causal_mask(torch.tensor([0]), 4, 64)
    with torch.no_grad():
        a, b = col(tokens, pos, pos, mask)[0], row(tokens, pos, pos, mask)[0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    column_major_linears(col)  # idempotent
    assert all(w.t().is_contiguous() for _, w in linears)


@pytest.mark.parametrize("batch,queries", [(1, 1), (3, 1), (2, 5)])
def test_bf16_attention_matches_fp32_sdpa(batch, queries):
    """attention() runs one bf16 query per row in fp32 (torch's CPU kernel is slow there): the
    result must be what SDPA gives on the same values, with either mask form."""
    import torch.nn.functional as F

    from eagle_infer.model import attention, attn_bias

    torch.manual_seed(0)
    S = 40
    q = torch.randn(batch, 6, queries, 16).bfloat16()
    k, v = torch.randn(2, batch, 2, S, 16).bfloat16()
    mask = torch.rand(batch, queries, S) < 0.7
    mask[..., 0] = True  # every query sees a key
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[:, None],
                                          enable_gqa=True)
    for m in (mask[:, None], attn_bias(mask, torch.bfloat16)):
        out = attention(q, k, v, m, gqa=True)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("batch,queries", [(1, 1), (3, 1), (2, 5)])
def test_grouped_query_attention_folds_heads_exactly(batch, queries):
    """attention() on CUDA folds the query heads sharing a kv head into its query rows (SDPA's
    enable_gqa takes only the flash kernel, which refuses masks): the same values as SDPA with
    enable_gqa, with either mask form, and masks of one row broadcast over the queries."""
    import torch.nn.functional as F

    from eagle_infer.model import attn_bias, grouped_query_attention

    torch.manual_seed(0)
    S = 40
    q = torch.randn(batch, 6, queries, 16)
    k, v = torch.randn(2, batch, 2, S, 16)
    mask = torch.rand(batch, queries, S) < 0.7
    mask[..., 0] = True
    for m in (mask[:, None], attn_bias(mask, torch.float32), mask[:1, None, :1]):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        out = grouped_query_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, m)
        assert out.shape == q.shape
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
