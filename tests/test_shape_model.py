"""scripts/shape_model.py: random-weight targets of real models' shapes, read by our loader as
those models (head size, query/key norms, biases, rope), and a random head that loads for them."""

from __future__ import annotations

import json

import torch
from script_module import load_script

from eagle_infer.model import ModelConfig


def test_shapes_read_as_the_models_they_copy():
    sm = load_script("shape_model")
    got = {name: ModelConfig.from_hf(sm.hf_config(name).to_dict()) for name in sm.SHAPES}
    q3, q25, ll = got["qwen3-0.6b"], got["qwen2.5-0.5b"], got["llama-3.2-1b"]
    assert (q3.head_dim, q3.qk_norm, q3.attention_bias, q3.vocab_size) == (128, True, False, 151936)
    assert (q25.head_dim, q25.qk_norm, q25.attention_bias, q25.num_kv_heads) == (64, False, True, 2)
    assert (ll.head_dim, ll.rope_scaling["rope_type"], ll.num_layers) == (64, "llama3", 16)
    assert got["qwen3-1.7b"].hidden_size == 2048 and all(c.tie_word_embeddings for c in got.values())
    g3 = got["gemma-3-270m"]  # layers 5, 11, 17 full, the others slide over 512 slots
    assert (g3.head_dim, g3.qk_norm, g3.sandwich_norms) == (256, True, True)
    assert (g3.sliding_window, g3.local_rope_theta) == (512, 1e4)
    assert sorted(set(range(18)) - set(g3.sliding_layers)) == [5, 11, 17] and g3.rope_theta == 1e6
    assert g3.embed_scale == 640 ** 0.5 and g3.hidden_act == "gelu_pytorch_tanh" and g3.fused_layers_compute()


def test_a_random_head_loads_for_its_target(tmp_path, monkeypatch, tiny_model_dir):
    """write_head on a small target (a tiny Qwen3 checkpoint): the head loads for it, its draft
    vocabulary the first ids."""
    from eagle_infer.heads import load_head_for
    from eagle_infer.loader import load_model

    sm = load_script("shape_model")
    target_dir = tiny_model_dir("qwen3")
    sm.write_head(target_dir, tmp_path / "head", draft_vocab_size=64)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["head_dim"] == 32
    head = load_head_for(tmp_path / "head", load_model(target_dir, "fp32", "cpu"))
    assert torch.equal(head.t2d.nonzero().flatten(), torch.arange(64))
