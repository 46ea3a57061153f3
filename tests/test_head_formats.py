"""Draft heads in every published form load and compute the same logits as our canonical form:
EAGLE-1/2 as yuhuili publishes them (pytorch_model.bin, fc bias, embed_tokens, sharded or not),
EAGLE-3 as yuhuili (no eagle_config, .bin) and SpecForge (eagle_config, sharded safetensors)
publish them, and vLLM's speculators layout; export rewrites a head losslessly; a head for
another target, or a variant this runtime does not implement, is refused by name.

Fixture configs use the keys of the real published configs (yuhuili/EAGLE-LLaMA3-Instruct-8B,
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, SpecForge configs/*-eagle3.json, RedHatAI speculators),
sized for the tiny Llama target of conftest.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle_infer.errors import UserError
from eagle_infer.head_formats import export_head, read_weights
from eagle_infer.heads import DraftHead, HeadConfig, load_head, read_head, save_head

DRAFT_VOCAB = 64
torch.manual_seed(0)


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models("llama")[0]


def random_head(target, kind: str, fc_bias: bool = False, norm_before_residual: bool = False) -> DraftHead:
    """A head with large random weights (so a wrong key, bias or norm changes the logits visibly) and,
    for EAGLE-3, a draft vocabulary of every 4th token."""
    cfg = HeadConfig.for_target(target.config, kind, DRAFT_VOCAB, fc_bias=fc_bias)
    cfg.norm_before_residual = norm_before_residual
    head = DraftHead(cfg, target.embed_tokens, target.lm_head.weight)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in head.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
        if kind == "eagle3":
            ids = torch.arange(0, target.config.vocab_size, 4)[:DRAFT_VOCAB]
            head.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
            head.t2d.zero_()
            head.t2d[ids] = True
    return head.eval()


def logits_of(head: DraftHead, target, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, their target ids) for 6 tokens with random target states, causal attention."""
    g = torch.Generator().manual_seed(seed)
    T, h = 6, target.config.hidden_size
    tokens = torch.randint(0, target.config.vocab_size, (1, T), generator=g)
    states = [torch.randn(1, T, h, generator=g) for _ in head.target_layers(target.config.num_layers)]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None]
    with torch.no_grad():
        logits, _, _ = head(tokens, head.project(states), torch.arange(T)[None], mask)
    return logits, head.draft_to_target


def load(path: Path, target) -> DraftHead:
    return load_head(path, target.config, target.embed_tokens, target.lm_head.weight, dtype=torch.float32)


def assert_same(a: DraftHead, b: DraftHead, target) -> None:
    la, ia = logits_of(a, target)
    lb, ib = logits_of(b, target)
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    assert (ia is None and ib is None) or torch.equal(ia, ib)


def llama_config(target, **extra) -> dict:
    """The Llama keys every published EAGLE head config carries, for the tiny target."""
    c = target.config
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": c.hidden_size, "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
            "max_position_embeddings": c.max_position_embeddings, "model_type": "llama",
            "num_attention_heads": c.num_heads, "num_hidden_layers": 1, "num_key_value_heads": c.num_kv_heads,
            "pretraining_tp": 1, "rms_norm_eps": c.rms_norm_eps, "rope_scaling": None,
            "rope_theta": c.rope_theta, "tie_word_embeddings": False, "torch_dtype": "float32",
            "transformers_version": "4.38.2", "use_cache": True, "vocab_size": c.vocab_size} | extra


def weights(head: DraftHead) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in head.head_state_dict().items()}


def write(folder: Path, config: dict, sd: dict[str, torch.Tensor], fmt: str = "safetensors",
          shards: int = 1) -> Path:
    """A head folder as published: one file or `shards` files with the index's weight map."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(sd)
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    weight_map = {}
    for i in range(shards):
        part = {k: sd[k] for k in names[i::shards]}
        fname = f"{stem}.{ext}" if shards == 1 else f"{stem}-{i + 1:05d}-of-{shards:05d}.{ext}"
        if fmt == "safetensors":
            save_file(part, str(folder / fname))
        else:
            torch.save(part, folder / fname)
        weight_map |= dict.fromkeys(part, fname)
    if shards > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / f"{stem}.{ext}.index.json").write_text(json.dumps(index))
    return folder


# -- EAGLE-1/2 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 3])
def test_yuhuili_eagle2_bin_with_fc_bias_and_embedding(target, tmp_path, shards):
    """yuhuili/EAGLE-LLaMA3-Instruct-8B: pytorch_model.bin, fc.bias, "bias": true, embed_tokens."""
    ours = random_head(target, "eagle2", fc_bias=True)
    sd = weights(ours) | {"embed_tokens.weight": target.embed_tokens.weight.detach().clone()}
    folder = write(tmp_path / "eagle", llama_config(target, bias=True), sd, fmt="bin", shards=shards)
    assert (folder / ("pytorch_model.bin" if shards == 1 else "pytorch_model.bin.index.json")).is_file()
    loaded = load(folder, target)
    assert loaded.config.fc_bias and loaded.fc.bias is not None
    assert_same(ours, loaded, target)


def test_eagle2_default_is_bias_free_and_says_so(target, tmp_path):
    """Our heads have no fc bias and write "bias": false (vLLM reads "bias" as attention bias)."""
    assert HeadConfig.for_target(target.config, "eagle2").fc_bias is False
    head = random_head(target, "eagle2")
    assert head.fc.bias is None
    save_head(head, tmp_path / "h", dtype=torch.float32)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["bias"] is False and "fc.bias" not in read_weights(tmp_path / "h")
    assert_same(head, load(tmp_path / "h", target), target)


def test_eagle2_bias_follows_the_checkpoint_not_the_config(target, tmp_path):
    """"bias": true without an fc.bias tensor (a head converted for vLLM but not its config) loads
    bias-free instead of failing; the tensors decide."""
    head = random_head(target, "eagle2")
    loaded = load(write(tmp_path / "h", llama_config(target, bias=True), weights(head)), target)
    assert loaded.fc.bias is None
    assert_same(head, loaded, target)


# -- EAGLE-3 --------------------------------------------------------------------------------------


def test_yuhuili_eagle3_bin_without_eagle_config(target, tmp_path):
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: LlamaForCausalLMEagle3 + draft_vocab_size, no
    eagle_config (the target's default layers 2, N/2, N-3), pytorch_model.bin with midlayer.*."""
    ours = random_head(target, "eagle3")
    assert ours.config.aux_hidden_indices == target.config.eagle3_layer_ids()
    config = llama_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
    loaded = load(write(tmp_path / "h", config, weights(ours), fmt="bin"), target)
    assert loaded.config.aux_hidden_indices == target.config.eagle3_layer_ids()
    assert_same(ours, loaded, target)


def test_eagle3_aux_ids_in_both_engines_conventions(target, tmp_path):
    """Our EAGLE-3 config names the trained layers for SGLang (eagle_config: output of layer i)
    and for vLLM (top-level key, read first: state after k layers); a config with only the
    top-level key (written for vLLM) loads to the same layers."""
    ours = random_head(target, "eagle3")
    ours.config.aux_layer_ids = [0, 1, 2]
    save_head(ours, tmp_path / "ours", dtype=torch.float32)
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    del cfg["eagle_config"]
    loaded = load(write(tmp_path / "vllm", cfg, weights(ours)), target)
    assert loaded.config.aux_layer_ids == [0, 1, 2]
    assert_same(ours, loaded, target)


def test_specforge_eagle3_sharded_safetensors(target, tmp_path):
    """SpecForge: eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's convention: output of
    layer i), target_hidden_size, an embed_tokens copy, sharded safetensors with an index."""
    ours = random_head(target, "eagle3")
    ours.config.aux_layer_ids = [0, 1, 2]  # hidden states 1, 2, 3: not the default
    config = llama_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB,
                          target_hidden_size=target.config.hidden_size, attention_bias=False,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    sd = weights(ours) | {"embed_tokens.weight": target.embed_tokens.weight.detach().clone()}
    loaded = load(write(tmp_path / "h", config, sd, shards=2), target)
    assert loaded.config.aux_hidden_indices == [1, 2, 3]
    assert loaded.target_layers(4) == [1, 2, 3]
    assert_same(ours, loaded, target)


def speculators_config(target, aux_hidden: list[int], norm_before_residual: bool = False, **extra) -> dict:
    """As vllm-project/speculators writes it (RedHatAI/*-speculator.eagle3)."""
    c = target.config
    layer = {"attention_bias": False, "attention_dropout": 0.0, "head_dim": c.head_dim, "hidden_act": "silu",
             "hidden_size": c.hidden_size, "initializer_range": 0.02,
             "intermediate_size": c.intermediate_size, "max_position_embeddings": c.max_position_embeddings,
             "mlp_bias": False, "model_type": "llama", "num_attention_heads": c.num_heads,
             "num_hidden_layers": 1, "num_key_value_heads": c.num_kv_heads, "pretraining_tp": 1,
             "rms_norm_eps": c.rms_norm_eps, "rope_scaling": None,
             "rope_theta": c.rope_theta, "use_cache": True, "vocab_size": c.vocab_size}
    return {"architectures": ["Eagle3Speculator"], "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
            "draft_vocab_size": DRAFT_VOCAB, "eagle_aux_hidden_state_layer_ids": aux_hidden,
            "has_no_defaults_at_init": False, "norm_before_residual": norm_before_residual,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                      "speculative_tokens": 3, "verifier_accept_k": 1}],
                "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny/llama"}},
            "speculators_model_type": "eagle3", "speculators_version": "0.2.0", "torch_dtype": "float32",
            "transformer_layer_config": layer, "transformers_version": "4.56.0"} | extra


def speculators_weights(head: DraftHead, target) -> dict[str, torch.Tensor]:
    sd = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
          for k, v in weights(head).items()}
    return sd | {"embed_tokens.weight": target.embed_tokens.weight.detach().clone()}


def test_vllm_speculators_eagle3(target, tmp_path):
    """speculators: layers.0.* keys, nested transformer_layer_config, top-level aux ids in vLLM's
    convention (hidden_states[k], our aux index + 1)."""
    ours = random_head(target, "eagle3")
    config = speculators_config(target, ours.config.aux_hidden_indices)
    loaded = load(write(tmp_path / "h", config, speculators_weights(ours, target)), target)
    assert loaded.config.aux_layer_ids == ours.config.aux_layer_ids
    assert not loaded.config.norm_before_residual
    assert_same(ours, loaded, target)


def test_speculators_norm_before_residual_matches_a_hand_computation(target, tmp_path):
    """norm_before_residual (vLLM's default when absent): the residual is hidden_norm(h). Checked
    against the layer written out by hand for one token, where attention is o_proj(v_proj(x))."""
    ref = random_head(target, "eagle3")
    config = speculators_config(target, ref.config.aux_hidden_indices)
    del config["norm_before_residual"]
    head = load(write(tmp_path / "h", config, speculators_weights(ref, target)), target)
    assert head.config.norm_before_residual
    g = torch.Generator().manual_seed(5)
    h = target.config.hidden_size
    token = torch.tensor([[9]])
    states = [torch.randn(1, 1, h, generator=g) for _ in range(3)]
    with torch.no_grad():
        logits, _, _ = head(token, head.project(states), torch.zeros(1, 1, dtype=torch.long),
                            torch.ones(1, 1, 1, dtype=torch.bool))
        layer = ref.midlayer
        feat = ref.fc(torch.cat(states, -1))
        hn = layer.hidden_norm(feat)
        x = torch.cat([layer.input_layernorm(target.embed_tokens(token)), hn], -1)
        attn = layer.self_attn
        v = attn.v_proj(x).view(1, 1, attn.n_kv, attn.head_dim)
        v = v.repeat_interleave(attn.n_heads // attn.n_kv, dim=2).reshape(1, 1, -1)
        out = hn + attn.o_proj(v)
        out = out + layer.mlp(layer.post_attention_layernorm(out))
        want = ref.lm_head(ref.norm(out))
        plain = ref(token, feat, torch.zeros(1, 1, dtype=torch.long),
                    torch.ones(1, 1, 1, dtype=torch.bool))[0]
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert (plain - want).abs().max() > 1e-2  # the variant really differs from SGLang's layer


# -- refusals -------------------------------------------------------------------------------------


def test_head_for_another_target_is_refused_by_name(target, tmp_path):
    ours = random_head(target, "eagle3")
    config = speculators_config(target, [1, 2, 9])  # layer 9 of a 4-layer target
    with pytest.raises(UserError, match="aux layer 8 outside the target's 4 layers"):
        load(write(tmp_path / "a", config, speculators_weights(ours, target)), target)
    bigger = llama_config(target, hidden_size=2 * target.config.hidden_size, vocab_size=300)
    with pytest.raises(UserError, match=r"hidden size 128 != target's 64.*vocabulary 300 != target's 256"):
        load(write(tmp_path / "b", bigger, weights(random_head(target, "eagle2"))), target)


def test_unsupported_variants_and_wrong_shapes_are_refused(target, tmp_path):
    ours = random_head(target, "eagle3")
    sd = speculators_weights(ours, target)
    with pytest.raises(UserError, match="norm_before_fc"):
        load(write(tmp_path / "a", speculators_config(target, [1, 2, 3], norm_before_fc=True), sd), target)
    config = llama_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB,
                          target_hidden_size=32)
    with pytest.raises(UserError, match="target_hidden_size 32"):
        load(write(tmp_path / "b", config, weights(ours)), target)
    bad = weights(ours) | {"fc.weight": torch.zeros(64, 2 * 64)}  # two aux states' worth
    config = llama_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
    with pytest.raises(UserError, match=r"fc.weight \(64, 128\) \(expected \(64, 192\)\)"):
        load(write(tmp_path / "c", config, bad), target)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="has no weights"):
        load(tmp_path / "d", target)


# -- export ---------------------------------------------------------------------------------------


def test_export_speculators_round_trip(target, tmp_path):
    ours = random_head(target, "eagle3")
    ours.config.aux_layer_ids = [0, 1, 2]
    save_head(ours, tmp_path / "ours", dtype=torch.float32)
    spec = export_head(tmp_path / "ours", tmp_path / "spec", "speculators", verifier="tiny/llama",
                       verifier_arch="LlamaForCausalLM", speculative_tokens=5)
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: hidden_states[k]
    assert cfg["norm_before_residual"] is False  # our layer; vLLM would assume true without it
    assert cfg["transformer_layer_config"]["hidden_size"] == 64
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "tiny/llama",
                                                     "architectures": ["LlamaForCausalLM"]}
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    keys = set(read_weights(spec))
    assert "layers.0.self_attn.q_proj.weight" in keys and not any(k.startswith("midlayer.") for k in keys)
    assert read_weights(spec)["fc.weight"].dtype == torch.float32  # dtype kept
    assert_same(ours, load(spec, target), target)
    # ... and back to the official layout: the same config and weights as the original.
    back = export_head(spec, tmp_path / "back", "official")
    original = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert json.loads((back / "config.json").read_text()) == original
    a, b = read_weights(back), read_weights(tmp_path / "ours")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_official_from_bin_and_eagle2_refused_as_speculators(target, tmp_path):
    ours = random_head(target, "eagle2", fc_bias=True)
    src = write(tmp_path / "bin", llama_config(target, bias=True), weights(ours), fmt="bin", shards=2)
    out = export_head(src, tmp_path / "off", dtype=torch.bfloat16)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["bias"] is True  # its fc bias is kept
    assert read_head(out)[1]["fc.weight"].dtype == torch.bfloat16
    with pytest.raises(UserError, match="speculators format is for EAGLE-3"):
        export_head(src, tmp_path / "spec", "speculators")


def test_export_stage_cli(target, tmp_path, monkeypatch):
    """python -m eagle_train stage=export ... (in process, the same entry point)."""
    import sys

    from eagle_train.__main__ import main

    ours = random_head(target, "eagle3")
    save_head(ours, tmp_path / "head", dtype=torch.float32)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["eagle_train", "stage=export", "export.head=head", "export.out=spec",
                                      "export.format=speculators", "export.verifier=tiny/llama",
                                      f"workdir={tmp_path}/wd", "hydra/job_logging=none",
                                      "hydra/hydra_logging=none"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    main()
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tiny/llama"
    assert_same(ours, load(tmp_path / "spec", target), target)
