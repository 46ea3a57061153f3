"""Draft-head training: the training-time-test unroll and its mask, the EAGLE-2 / EAGLE-3 losses,
checkpoint + resume, the saved head, and a two-process accelerate launch.

Everything runs on a tiny random Llama target (hidden 64, 4 layers, vocab 512) and a tiny
synthetic capture of its own sampled continuations, written through eagle_train.shards.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle_infer.heads import DraftHead, HeadConfig, load_head
from eagle_train.losses import draft_loss, leading_matches, shift_left, ttt_mask, unpack_stats, unroll

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
AUX = [1, 2, 3]  # hidden-state indices the synthetic capture keeps (distinct on 4 layers)
DRAFT_VOCAB = 128
N_TRAIN, N_HELDOUT = 12, 4

_ENV: dict = {}


# ---------------------------------------------------------------------------------------------
# The tiny world: target, capture, draft vocabulary


def build_target(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                      rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name == "lm_head.weight":  # confident predictions, as a trained LM makes
                p.copy_(0.6 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out, safe_serialization=True)
    return out


@torch.no_grad()
def sample_sequences(model, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random prompts + the target's own sampled continuations (T = 0.7): on-policy data."""
    from eagle_infer.model import causal_mask

    g = torch.Generator().manual_seed(seed)
    zero = torch.zeros(1, dtype=torch.long)
    out = []
    for i in range(n):
        P, G = 6 + i % 5, 20 + (7 * i) % 13
        ids = torch.randint(3, VOCAB, (P,), generator=g).tolist()
        model.setup_cache(1, P + G)
        pos = torch.arange(P)[None]
        logits, _ = model(torch.tensor([ids]), pos, pos, causal_mask(zero, P, P + G),
                          logits_at=torch.tensor([[P - 1]]))
        for _ in range(G):
            probs = torch.softmax(logits[0, -1] / 0.7, -1)
            ids.append(int(torch.multinomial(probs, 1, generator=g)))
            L = len(ids) - 1
            pos = torch.tensor([[L]])
            logits, _ = model(torch.tensor([[ids[-1]]]), pos, pos, causal_mask(torch.tensor([L]), 1, P + G))
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[P:] = True
        out.append((torch.tensor(ids), mask))
    return out


@torch.no_grad()
def write_capture(model, directory: Path, seqs, split: str) -> None:
    from eagle_infer.model import causal_mask
    from eagle_train.shards import commit, new_manifest

    N = model.config.num_layers
    samples = []
    for sid, (ids, mask) in enumerate(seqs):
        T = len(ids)
        model.setup_cache(1, T)
        pos = torch.arange(T)[None]
        _, hs = model(ids[None], pos, pos, causal_mask(torch.zeros(1, dtype=torch.long), T, T),
                      hidden_layers=[*AUX, N], compute_logits=False)
        samples.append({"input_ids": ids, "loss_mask": mask, "hidden": hs[-1][0],
                        "aux": torch.cat([h[0] for h in hs[:-1]], -1), "sample_id": sid,
                        "messages": None})
    directory.mkdir(parents=True, exist_ok=True)
    manifest = new_manifest(split, model_name="tiny", hidden_size=model.config.hidden_size, vocab_size=VOCAB,
                            num_layers=N, aux_layer_ids=AUX, store_dtype="fp32", eos_token_ids=[2],
                            settings={})
    commit(directory, manifest, samples, complete=True)


def tiny_env(tmp_root: Path) -> dict:
    """Build (once per test session) the tiny target, capture and draft vocabulary."""
    if _ENV:
        return _ENV
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster, and immune to a busy machine
    try:
        return _build_env(tmp_root)
    finally:
        torch.set_num_threads(threads)


def _build_env(tmp_root: Path) -> dict:
    from safetensors.torch import save_file

    from eagle_infer.loader import load_model
    from eagle_train.tokenmap import count_tokens, draft_vocab

    target_dir = build_target(tmp_root / "target")
    model = load_model(target_dir, "fp32", "cpu")
    cap = tmp_root / "capture"
    train_seqs = sample_sequences(model, N_TRAIN, seed=1)
    write_capture(model, cap, train_seqs, "train")
    write_capture(model, cap / "heldout", sample_sequences(model, N_HELDOUT, seed=2), "heldout")
    counts = count_tokens([s for s, _ in train_seqs], [m for _, m in train_seqs], vocab_size=VOCAB)
    d2t, t2d = draft_vocab(counts + 1, DRAFT_VOCAB, [2])  # +1: ties broken by id, all tokens eligible
    save_file({"d2t": d2t, "t2d": t2d}, str(cap / f"d2t_t2d_{DRAFT_VOCAB}.safetensors"))
    _ENV.update(root=tmp_root, target_dir=target_dir, model=model, capture=cap, d2t=d2t, t2d=t2d)
    return _ENV


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and immune to a busy machine's thread stalls."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    return tiny_env(tmp_path_factory.mktemp("eagle_train_env"))


def make_cfg(env: dict, out: Path, kind: str = "eagle3", **overrides):
    """The project's Hydra config, composed as `python -m eagle_train` would, paths resolved."""
    from hydra import compose, initialize_config_dir

    from eagle_train.pipeline import prepare_config

    args = {
        "stage": "train", "preset": "none", "draft": kind, "model.path": str(env["target_dir"]),
        "model.name": "tiny", "capture_dir": str(env["capture"]), "tokenmap_dir": str(out / "tokenmaps"),
        "head_dir": str(out / "head"), "eval_dir": str(out / "eval"), "workdir": str(out),
        "device": "cpu", "train.wandb.mode": "disabled", "train.batch_size": 4, "train.max_length": 64,
        "train.lr": 3e-3, "train.warmup_ratio": 0.1, "train.bf16": False, "train.log_every": 1,
        "train.save_every": 2, "eval.num_samples": N_HELDOUT, "eval.unroll": 4,
    }
    if kind == "eagle3":
        args["draft.draft_vocab_size"] = DRAFT_VOCAB
        args["draft.ttt_steps"] = 3
    args.update(overrides)
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "conf")):
        cfg = compose("config", overrides=[f"{k}={v}" for k, v in args.items()])
    return prepare_config(cfg)


def fresh_head(env: dict, kind: str, seed: int = 0) -> DraftHead:
    model = env["model"]
    torch.manual_seed(seed)
    if kind == "eagle3":
        hc = HeadConfig.for_target(model.config, "eagle3", DRAFT_VOCAB, AUX)
        head = DraftHead(hc, model.embed_tokens)
        head.d2t.copy_(env["d2t"])
        head.t2d.copy_(env["t2d"])
    else:
        head = DraftHead(HeadConfig.for_target(model.config, "eagle2"), model.embed_tokens,
                         model.lm_head.weight)
    return head


def capture_batch(env: dict, n: int = 4, split: str = "train") -> dict:
    from eagle_train.shards import CaptureDataset, pad_collate

    ds = CaptureDataset(env["capture"], split=split)
    return pad_collate([ds[i] for i in range(n)])


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


# ---------------------------------------------------------------------------------------------
# The unroll and its attention mask


def test_ttt_mask_is_causal_then_diagonal():
    m = ttt_mask(4, 2)
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(m[:, 8:], torch.eye(4, dtype=torch.bool))
    assert torch.equal(shift_left(torch.arange(5)[None], 2), torch.tensor([[2, 3, 4, 0, 0]]))


def test_unrolled_attention_equals_dense_masked_attention():
    """The structured attention of steps >= 1 equals plain attention over cat(K_0, ..., K_s) with
    the dense [causal | I | I ..] mask, outputs and gradients, grouped-query heads included."""
    from eagle_infer.heads import unrolled_attention

    torch.manual_seed(0)
    B, nh, nkv, T, d, s = 2, 6, 2, 7, 8, 3
    q = torch.randn(B, nh, T, d, requires_grad=True)
    kvs = [tuple(torch.randn(B, T, nkv, d, requires_grad=True) for _ in range(2)) for _ in range(s + 1)]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    causal[3, :2] = False  # any key pattern over K_0 (the compact unroll's rows differ per sample)
    out = unrolled_attention(q, kvs[:-1], *kvs[-1], causal[None].expand(B, T, T))
    dense = torch.cat([causal] + [torch.eye(T, dtype=torch.bool)] * s, -1)
    keys = torch.cat([k for k, _ in kvs], 1).transpose(1, 2)
    values = torch.cat([v for _, v in kvs], 1).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=dense, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    leaves = [q] + [x for kv in kvs for x in kv]
    w = torch.randn_like(ref)
    g_out = torch.autograd.grad((out * w).sum(), leaves)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "eagle2"])
def test_unroll_matches_step_by_step_drafting(env, kind):
    """Step s at position t equals an explicit chain draft: step 0 over the prefix 0..t
    (causal), then one query per step at position t+s seeing the prefix keys and its own
    earlier steps' keys at t only."""
    head = fresh_head(env, kind).eval()
    batch = capture_batch(env, 2)
    steps = 3
    with torch.no_grad():
        outs = unroll(head, batch, steps)
        states = [batch["aux"].float()] if kind == "eagle3" else [batch["hidden"].float()]
        feat0 = head.project(states)
        ids = batch["input_ids"]
        for b, t in [(0, 0), (0, 5), (1, 9), (1, 14)]:
            # Step 0 over the prefix: pairs (f_i, x_{i+1}), i = 0..t.
            pos = torch.arange(t + 1)[None]
            mask = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()[None]
            logits, g, (k0, v0) = head(ids[b:b + 1, 1:t + 2], feat0[b:b + 1, :t + 1], pos, mask)
            torch.testing.assert_close(g[0, t], outs[0][1][b, t], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[0, t], outs[0][0][b, t], atol=1e-4, rtol=1e-4)
            past = [(k0, v0)]
            feat = g[:, t:t + 1]
            for s in range(1, steps):
                tok = ids[b:b + 1, t + 1 + s:t + 2 + s]
                mask = torch.ones(1, 1, t + 1 + s, dtype=torch.bool)
                logits, g, kv = head(tok, feat, torch.tensor([[t + s]]), mask, past_kv=past)
                torch.testing.assert_close(g[0, 0], outs[s][1][b, t], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(logits[0, 0], outs[s][0][b, t], atol=1e-4, rtol=1e-4)
                past.append(kv)
                feat = g


def test_unroll_never_looks_ahead(env):
    """Changing token x_j leaves every (t, s) with t+1+s < j unchanged; changing the target
    state at j leaves every t < j unchanged (and does change later ones)."""
    head = fresh_head(env, "eagle3").eval()
    batch = capture_batch(env, 2)
    j, steps = 12, 4
    with torch.no_grad():
        ref = unroll(head, batch, steps)
        b2 = dict(batch)
        b2["input_ids"] = batch["input_ids"].clone()
        b2["input_ids"][:, j] = (b2["input_ids"][:, j] + 7) % VOCAB
        tok = unroll(head, b2, steps)
        b3 = dict(batch)
        b3["aux"] = batch["aux"].clone()
        b3["aux"][:, j] += 1.0
        feat = unroll(head, b3, steps)
    for s in range(steps):
        safe = j - 1 - s  # positions t < safe use only tokens before j
        torch.testing.assert_close(tok[s][1][:, :safe], ref[s][1][:, :safe], atol=0, rtol=0)
        assert not torch.allclose(tok[s][1][:, safe], ref[s][1][:, safe])
        torch.testing.assert_close(feat[s][1][:, :j], ref[s][1][:, :j], atol=0, rtol=0)
        assert not torch.allclose(feat[s][1][:, j], ref[s][1][:, j])


@pytest.mark.parametrize("kind", ["eagle3", "eagle2"])
def test_compact_unroll_equals_full_unroll_where_needed(env, kind):
    """Steps >= 1 on the needed positions only (what training and eval use) give the same
    outputs and gradients there as the full unroll."""
    from eagle_train.losses import needed_positions

    batch = capture_batch(env, 4)
    steps = 4
    need = needed_positions(batch["loss_mask"], steps)
    assert 0 < int(need.sum()) < need.numel()
    runs = []
    for compact in (False, True):
        head = fresh_head(env, kind)
        outs = unroll(head, batch, steps, needed=need if compact else None)
        loss = sum((outs[s][0][need].float().logsumexp(-1)).sum() for s in range(steps))
        loss.backward()
        runs.append((outs, {n: p.grad.clone() for n, p in head.named_parameters()}))
    (ref, g_ref), (outs, g_new) = runs
    torch.testing.assert_close(outs[0][1], ref[0][1], atol=0, rtol=0)
    for s in range(1, steps):
        assert float(outs[s][1][~need].detach().abs().max()) == 0.0  # zeros where not needed
        torch.testing.assert_close(outs[s][1][need], ref[s][1][need], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[s][0][need], ref[s][0][need], atol=1e-4, rtol=1e-4)
    grads = [g_ref, g_new]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-4, rtol=1e-3)


class OracleHead(torch.nn.Module):
    """An EAGLE-2-shaped 'head' whose output at (t, s) is the target's own state f_{t+1+s}: its
    draft is the target's choice everywhere, so every alignment must give full acceptance."""

    eagle3 = False
    draft_lm_head = None
    draft_to_target = None

    def __init__(self, hidden, lm_head_w):
        super().__init__()
        self.fc = torch.nn.Linear(1, 1)
        self.hidden = hidden.float()
        self.w = lm_head_w
        V = lm_head_w.shape[0]
        self.config = type("C", (), {"vocab_size": V, "draft_vocab_size": V})

    def project(self, states):
        return states[0]

    def logits(self, g):
        return torch.nn.functional.linear(g, self.w)

    def forward(self, tokens, feature, positions, mask, slots=None, past_kv=(), compute_logits=True):
        # Pair t at step s has RoPE position t+s and predicts the target at t+1+s.
        idx = (positions + 1).clamp(max=self.hidden.shape[1] - 1)
        H = self.hidden.shape[-1]
        g = torch.gather(self.hidden, 1, idx[:, :, None].expand(-1, -1, H)) + 0.0 * feature
        k = torch.zeros(1)
        return (self.logits(g) if compute_logits else None), g, (k, k)


def test_oracle_draft_is_fully_accepted(env):
    batch = capture_batch(env, 4, "heldout")
    w = env["model"].lm_head.weight
    oracle = OracleHead(batch["hidden"], w)
    match, valid, lead = leading_matches(oracle, batch, w, 4)
    assert valid.any() and bool(match[valid].all())
    start = valid[..., 0]
    # Leading matches = counted positions of the chain (it stops at the end of the answer).
    assert torch.equal(lead[start], valid[start].long().cumprod(-1).sum(-1))
    out = draft_loss(oracle, batch, w, steps=2, feature_weight=1.0, ce_weight=0.1)
    assert out.correct.tolist() == out.count.tolist() and out.count.min() > 0
    assert float(out.feature_sum.abs().max()) < 1e-6


# ---------------------------------------------------------------------------------------------
# Losses


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_loss_decreases_when_overfitting(env, kind):
    head = fresh_head(env, kind)
    batch = capture_batch(env, 4)
    w = env["model"].lm_head.weight
    kw = ({"steps": 3, "decay": 0.8} if kind == "eagle3"
          else {"steps": 1, "noise": 0.2, "ce_weight": 0.1, "feature_weight": 1.0})
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    losses, accs = [], []
    for _ in range(30):
        out = draft_loss(head, batch, w, **kw)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
        accs.append((out.correct / out.count.clamp(min=1)).tolist())
    assert losses[-1] < 0.5 * losses[0], losses
    assert sum(losses[-5:]) < sum(losses[:5])
    assert accs[-1][0] > accs[0][0]
    if kind == "eagle3":
        # Every unrolled step learns, not only the first.
        assert all(a_end > a_start for a_start, a_end in zip(accs[0], accs[-1]))


def test_eagle3_loss_ignores_targets_outside_draft_vocab_but_accuracy_counts_them(env):
    head = fresh_head(env, "eagle3")
    batch = capture_batch(env, 4)
    w = env["model"].lm_head.weight
    out = draft_loss(head, batch, w, steps=1)
    from eagle_train.losses import prediction_mask, target_argmax

    am = shift_left(target_argmax(batch["hidden"], w), 1)
    counted = prediction_mask(batch["loss_mask"], 0)
    in_vocab = counted & env["t2d"][am]
    n_all, n_in = int(counted.sum()), int(in_vocab.sum())
    assert 0 < n_in < n_all  # the fixture's draft vocabulary misses some targets
    # Accuracy's denominator: every assistant prediction (out-of-vocabulary = a sure miss).
    assert int(out.count[0]) == n_all
    assert int(out.correct[0]) <= n_in
    # CE is still the mean over the in-vocabulary predictions the loss is computed on.
    st = unpack_stats(out.stats(), 1)
    assert st["ce"][0] == pytest.approx(float(out.loss.detach()), rel=1e-5)
    # Every target drawable: the loss covers more predictions, the accuracy denominator stays.
    head.t2d.fill_(True)
    head.d2t.zero_()
    out_all = draft_loss(head, batch, w, steps=1)
    assert int(out_all.count[0]) == n_all


def test_soft_capped_targets_teach_the_capped_distribution(env):
    """logit_softcap (a Gemma 2 target's): the soft labels are the capped logits' softmax, so the
    loss moves with the cap, top-1 counts do not (tanh keeps the order), and a cap far above the
    logits changes nothing."""
    head = fresh_head(env, "eagle3")
    batch = capture_batch(env, 4)
    w = env["model"].lm_head.weight
    plain, wide, tight = (draft_loss(head, batch, w, steps=1, logit_softcap=c) for c in (0.0, 1e9, 2.0))
    assert float(wide.loss.detach()) == pytest.approx(float(plain.loss.detach()), rel=1e-6)
    assert abs(float(tight.loss.detach()) - float(plain.loss.detach())) > 1e-3  # a fresh head: near flat
    assert torch.equal(tight.correct, plain.correct) and torch.equal(tight.count, plain.count)


# ---------------------------------------------------------------------------------------------
# The recipe: resume, saved head


def _head_params(head_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(head_dir / "model.safetensors"))


def _train(cfg, stop_after=None):
    from eagle_train.train import TrainRecipe

    reset_accelerate()
    r = TrainRecipe(cfg)
    r.setup(cfg)
    try:
        summary = r.train(stop_after=stop_after)
        head = r.acc.unwrap_model(r.model).head
    finally:
        r.cleanup()
    return summary, head


# eagle2: input noise, so the RNG must resume too; eagle3-scaled: the fc input scale recomputed
@pytest.mark.parametrize("kind", ["eagle3", "eagle2", "eagle3-scaled"])
def test_checkpoint_resume_equals_uninterrupted_run(env, tmp_path, kind):
    over = {"train.epochs": 2, "train.grad_accum": 2, "train.batch_size": 2}  # 3 per epoch -> 6 steps
    if kind == "eagle3-scaled":
        kind, over = "eagle3", over | {"draft.fc_input_scale": "channel"}
    cfg_a = make_cfg(env, tmp_path / "a", kind, **over)
    summary_a, _ = _train(cfg_a)
    assert summary_a["finished"] and summary_a["step"] == 6
    cfg_b = make_cfg(env, tmp_path / "b", kind, **over)
    part, _ = _train(cfg_b, stop_after=3)  # "killed" after step 3: last checkpoint is step 2
    assert not part["finished"]
    assert not (tmp_path / "b" / "head" / "model.safetensors").exists()
    ckpts = sorted(p.name for p in (tmp_path / "b" / "head" / "checkpoints").iterdir())
    assert ckpts == ["step_2"]
    summary_b, _ = _train(cfg_b)  # same command again: resumes from step 2
    assert summary_b["finished"] and summary_b["step"] == 6
    assert summary_b["tokens_total"] == summary_a["tokens_total"] > summary_b["tokens_this_run"]
    pa, pb = _head_params(tmp_path / "a" / "head"), _head_params(tmp_path / "b" / "head")
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    # The log holds each step once, in order, as in the uninterrupted run.
    log_b = [json.loads(x) for x in (tmp_path / "b" / "head" / "train_log.jsonl").read_text().splitlines()]
    log_a = [json.loads(x) for x in (tmp_path / "a" / "head" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log_b] == list(range(1, 7))
    assert [r["loss"] for r in log_b] == pytest.approx([r["loss"] for r in log_a], rel=1e-5)
    from eagle_train.train import is_complete

    assert is_complete(cfg_b)


@pytest.mark.parametrize("kind", ["eagle3", "eagle2"])
def test_trained_head_saved_in_official_layout_reloads(env, tmp_path, kind):
    cfg = make_cfg(env, tmp_path, kind, **{"train.max_steps": 4})
    summary, head = _train(cfg)
    hd = tmp_path / "head"
    conf = json.loads((hd / "config.json").read_text())
    sd = _head_params(hd)
    if kind == "eagle3":
        assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["draft_vocab_size"] == DRAFT_VOCAB
        assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
        assert sd["lm_head.weight"].dtype == torch.bfloat16 and sd["d2t"].dtype == torch.int64
        assert torch.equal(sd["d2t"], env["d2t"]) and torch.equal(sd["t2d"], env["t2d"])
    else:
        assert "fc.bias" not in sd and conf["bias"] is False and "layers.0.self_attn.q_proj.weight" in sd
    for f in ("train_summary.json", "train_log.jsonl", "train_loss.png"):
        assert (hd / f).is_file(), f
    assert summary["tokens_per_s"] > 0
    assert len(summary["final_acc_per_step"]) == (3 if kind == "eagle3" else 1)

    model = env["model"]
    loaded = load_head(hd, model.config, model.embed_tokens, model.lm_head.weight, dtype=torch.float32)
    batch = capture_batch(env, 2, "heldout")
    head = head.float().eval()
    with torch.no_grad():
        a = unroll(head, batch, 2)
        b = unroll(loaded, batch, 2)
    for (la, _), (lb, _) in zip(a, b):
        torch.testing.assert_close(lb, la, atol=0.1, rtol=0.05)  # bf16 weights
        agree = (la.argmax(-1) == lb.argmax(-1)).float().mean()
        assert agree > 0.9


def test_init_from_a_trained_head_starts_from_its_weights(env, tmp_path):
    from eagle_infer.errors import UserError
    from eagle_train.train import build_head, load_target_io

    _train(make_cfg(env, tmp_path / "first", **{"train.max_steps": 2}))
    first = tmp_path / "first" / "head"
    target = load_target_io(env["target_dir"])
    manifest = json.loads((env["capture"] / "manifest.json").read_text())
    cfg = make_cfg(env, tmp_path / "second", **{"train.init_from": str(first)})
    head = build_head(cfg, target, manifest)
    saved = _head_params(first)
    got = head.state_dict()
    assert set(saved) <= set(got)
    for k, v in saved.items():
        torch.testing.assert_close(got[k], v.to(got[k].dtype), msg=k)
    fresh = build_head(make_cfg(env, tmp_path / "third"), target, manifest)
    assert not torch.equal(fresh.fc.weight, head.fc.weight)
    with pytest.raises(UserError, match="eagle3 head, but this run trains eagle2"):
        cfg2 = make_cfg(env, tmp_path / "e2", "eagle2", **{"train.init_from": str(first)})
        build_head(cfg2, target, manifest)


def test_fc_input_scale_trains_on_unit_rms_inputs_and_saves_the_plain_architecture(env, tmp_path):
    """draft.fc_input_scale: EAGLE-3's fc trains on aux states scaled to RMS 1 (per channel, or
    per aux layer) over positions 1.. of the capture; the saved head has the scale folded into
    fc.weight, so it holds the keys of an unscaled head and, loaded as any head is, projects the
    states as the training head did; a warm start from it divides the scale back out."""
    from eagle_infer.errors import UserError
    from eagle_train.shards import CaptureSet
    from eagle_train.train import build_head, fc_input_scale_of, load_target_io

    data = CaptureSet([env["capture"]], require_aux=True)
    aux = torch.cat([data[i]["aux"][1:].float() for i in range(len(data))])  # [N, 3H]
    scale, info = fc_input_scale_of("channel", data, None)
    torch.testing.assert_close((aux * scale).square().mean(0).sqrt(), torch.ones(aux.shape[1]))
    assert info["positions"] == aux.shape[0] and len(info["layer_rms"]) == len(AUX)
    per_layer, _ = fc_input_scale_of("layer", data, None)
    scaled = (aux * per_layer).view(aux.shape[0], len(AUX), -1)
    torch.testing.assert_close(scaled.square().mean((0, 2)).sqrt(), torch.ones(len(AUX)))
    assert per_layer.view(len(AUX), -1).std(-1).max() == 0 and not torch.equal(per_layer, scale)
    with pytest.raises(UserError, match="fc_input_scale='token'"):
        fc_input_scale_of("token", data, None)

    _, plain = _train(make_cfg(env, tmp_path / "plain", **{"train.max_steps": 3}))
    cfg = make_cfg(env, tmp_path / "scaled", **{"train.max_steps": 3, "draft.fc_input_scale": "channel"})
    _, head = _train(cfg)
    torch.testing.assert_close(head.fc_input_scale, scale)
    saved = _head_params(tmp_path / "scaled" / "head")
    assert saved.keys() == _head_params(tmp_path / "plain" / "head").keys()
    target = load_target_io(env["target_dir"])
    loaded = load_head(tmp_path / "scaled" / "head", target.config, target.embed_tokens,
                       target.lm_head_weight, dtype=torch.float32)
    assert loaded.fc_input_scale is None
    states = [data[0]["aux"][None].float()]
    with torch.no_grad():
        want = head.project(states)
        torch.testing.assert_close(loaded.project(states), want, atol=0.05, rtol=0.02)  # bf16 weights
        warm_cfg = make_cfg(env, tmp_path / "warm", **{"train.init_from": str(tmp_path / "scaled" / "head")})
        warm = build_head(warm_cfg, target, data.manifest, scale)
        torch.testing.assert_close(warm.project(states), loaded.project(states))
        torch.testing.assert_close(warm.fc.weight * scale, loaded.fc.weight)


def test_readout_from_target_and_frozen_lm_head(env, tmp_path):
    """draft.readout_from_target starts the EAGLE-3 readout as the target's (lm_head rows of the
    draft vocabulary, final norm); draft.freeze_lm_head keeps those rows through training while
    the rest of the head moves."""
    from safetensors import safe_open

    from eagle_infer.loader import safetensors_files
    from eagle_train.train import build_head, load_target_io

    target = load_target_io(env["target_dir"])
    for f in safetensors_files(env["target_dir"]):
        with safe_open(str(f), "pt") as st:
            if "model.norm.weight" in st.keys():
                norm = st.get_tensor("model.norm.weight").float()
    rows = target.lm_head_weight[torch.arange(DRAFT_VOCAB) + env["d2t"]]
    cfg = make_cfg(env, tmp_path / "frozen", **{"train.max_steps": 3, "draft.readout_from_target": True,
                                                "draft.freeze_lm_head": True})
    start = build_head(cfg, target, json.loads((env["capture"] / "manifest.json").read_text()))
    torch.testing.assert_close(start.lm_head.weight, rows)
    torch.testing.assert_close(start.norm.weight, norm)
    _, head = _train(cfg)
    assert torch.equal(head.lm_head.weight.detach(), rows)
    assert not torch.equal(head.fc.weight.detach(), start.fc.weight)
    assert not torch.equal(head.norm.weight.detach(), norm)  # only lm_head is frozen
    free_cfg = make_cfg(env, tmp_path / "free", **{"train.max_steps": 3, "draft.readout_from_target": True})
    _, free = _train(free_cfg)
    assert not torch.equal(free.lm_head.weight.detach(), rows)


@pytest.mark.parametrize("arch,prefix", [("gemma3", "model."), ("gemma3_vision", "language_model.model.")])
def test_a_gemma_targets_final_norm_reaches_the_head_as_the_scale_it_applies(tiny_model_dir, arch, prefix):
    """Gemma's norms scale by 1 + weight, the head's by its weight: the readout starts from the
    scale the target applies, which is what the target's own norm computes; the embedding and norm
    are found under a multimodal checkpoint's language_model too."""
    from safetensors import safe_open

    from eagle_infer.loader import load_model
    from eagle_train.train import load_target_io

    folder = tiny_model_dir(arch)
    with safe_open(str(folder / "model.safetensors"), "pt") as st:
        stored = st.get_tensor(prefix + "norm.weight").float()
        embed = st.get_tensor(prefix + "embed_tokens.weight").float()
    target = load_target_io(folder)
    torch.testing.assert_close(target.final_norm_weight, 1.0 + stored)
    assert torch.equal(target.embed_tokens.weight, embed)
    assert target.lm_head_weight is target.embed_tokens.weight
    x = torch.randn(3, target.config.hidden_size)
    ours = load_model(folder, "fp32", "cpu").norm(x)
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps)
    torch.testing.assert_close(ours, unit * target.final_norm_weight)


def test_extra_captures_train_on_the_union(env, tmp_path):
    from eagle_infer.errors import UserError
    from eagle_train.shards import CaptureDataset, CaptureSet, commit, new_manifest, read_manifest
    from eagle_train.train import is_complete

    model = env["model"]
    extra = tmp_path / "extra"
    write_capture(model, extra, sample_sequences(model, 3, seed=7), "train")
    both = CaptureSet([env["capture"], extra])
    first, second = CaptureDataset(env["capture"]), CaptureDataset(extra)
    assert len(both) == len(first) + 3 and both.num_tokens == first.num_tokens + second.num_tokens
    assert both.lengths() == first.lengths() + second.lengths()
    last = both[len(first) + 2]
    assert last["index"] == len(first) + 2 and torch.equal(last["hidden"], second[2]["hidden"])

    cfg = make_cfg(env, tmp_path / "run", **{"train.max_steps": 2, "train.extra_captures": f"[{extra}]"})
    summary, _ = _train(cfg)
    assert summary["samples"] == len(both)
    assert summary["fingerprint"]["capture_tokens"] == both.num_tokens
    assert is_complete(cfg)
    # A grown extra capture makes the head out of date.
    m = read_manifest(extra)
    commit(extra, m, [dict(CaptureDataset(extra)[0], sample_id=99, messages=None)], complete=True)
    assert not is_complete(cfg)

    odd = tmp_path / "odd"  # other aux layers: refused, naming both captures
    odd.mkdir()
    m = new_manifest("train", model_name="tiny", hidden_size=model.config.hidden_size, vocab_size=VOCAB,
                     num_layers=model.config.num_layers, aux_layer_ids=[1], store_dtype="fp32",
                     eos_token_ids=[2], settings={})
    commit(odd, m, [], complete=True)
    with pytest.raises(UserError, match="differ in aux_layer_ids"):
        CaptureSet([env["capture"], odd])


def tokens_only_copy(src: Path, dst: Path) -> Path:
    """An online-mode copy of a capture (train and heldout splits): tokens and masks, no states."""
    from eagle_train.shards import HELDOUT_SUBDIR, CaptureDataset, commit, new_manifest

    for split, sub in (("train", ""), ("heldout", HELDOUT_SUBDIR)):
        ds = CaptureDataset(src, split=split)
        out = dst / sub
        out.mkdir(parents=True, exist_ok=True)
        m = new_manifest(split, model_name="tiny", hidden_size=ds.hidden_size, vocab_size=VOCAB,
                         num_layers=ds.manifest["num_layers"], aux_layer_ids=AUX, store_dtype="fp32",
                         eos_token_ids=[2], settings={"dtype": "fp32"}, states=False)
        items = [ds[i] for i in range(len(ds))]
        commit(out, m, [{"input_ids": it["input_ids"], "loss_mask": it["loss_mask"], "hidden": None,
                         "sample_id": it["sample_id"], "messages": None} for it in items], complete=True)
    return dst


def test_online_capture_trains_and_evaluates_like_the_stored_one(env, tmp_path, monkeypatch):
    """capture.store_states=false: shards hold tokens only, training and eval run the target per
    batch, and get what the stored states give (same losses step by step, same weights, same tau)."""
    from eagle_infer.errors import UserError
    from eagle_train import capture, evaluate
    from eagle_train.shards import CaptureDataset, CaptureSet

    # train.online_tf32 (EAGLE-3 below): the target's forward runs with TF32 matmuls allowed (a
    # no-op on a CPU, so the losses still match), and only the forward.
    tf32_seen = []
    real_states = capture.teacher_forced_states

    def spy(*args, **kwargs):
        tf32_seen.append(torch.backends.cuda.matmul.allow_tf32)
        return real_states(*args, **kwargs)

    monkeypatch.setattr(capture, "teacher_forced_states", spy)

    online = tokens_only_copy(env["capture"], tmp_path / "online")
    name = f"d2t_t2d_{DRAFT_VOCAB}.safetensors"  # the draft vocabulary lives beside the capture
    shutil.copy(env["capture"] / name, online / name)
    ds = CaptureDataset(online)
    assert not ds.has_states and "hidden" not in ds[0] and "aux" not in ds[0]
    stored_bytes = sum(f.stat().st_size for f in env["capture"].glob("shard-*"))
    assert sum(f.stat().st_size for f in online.glob("shard-*")) < stored_bytes / 10
    with pytest.raises(UserError, match="differ in has_states"):
        CaptureSet([env["capture"], online])

    for kind in ("eagle3", "eagle2"):
        over = {"train.max_steps": 4, "train.save_every": 0}
        cfg_s = make_cfg(env, tmp_path / f"stored-{kind}", kind, **over)
        tf32 = {"train.online_tf32": True} if kind == "eagle3" else {}
        cfg_o = make_cfg(env, tmp_path / f"online-{kind}", kind, capture_dir=str(online), **over, **tf32)
        _train(cfg_s)
        tf32_seen.clear()
        _train(cfg_o)
        assert tf32_seen and set(tf32_seen) == {kind == "eagle3"}
        assert torch.backends.cuda.matmul.allow_tf32 is False
        summary = json.loads((tmp_path / f"online-{kind}" / "head" / "train_summary.json").read_text())
        # false (the default) is left out of the fingerprint, so earlier heads stay complete
        assert summary["fingerprint"]["train"].get("online_tf32") is (True if tf32 else None)
        logs = [[json.loads(x) for x in (tmp_path / f"{w}-{kind}" / "head" / "train_log.jsonl").read_text()
                 .splitlines()] for w in ("stored", "online")]
        assert [r["loss"] for r in logs[1]] == pytest.approx([r["loss"] for r in logs[0]], rel=1e-4)
        ps = _head_params(tmp_path / f"stored-{kind}" / "head")
        po = _head_params(tmp_path / f"online-{kind}" / "head")
        for k in ps:
            torch.testing.assert_close(po[k].float(), ps[k].float(), atol=1e-2, rtol=0, msg=k)
        # The held-out split is online too: same head, same acceptance.
        cfg_e = make_cfg(env, tmp_path / f"online-{kind}", kind, capture_dir=str(online),
                         head_dir=str(tmp_path / f"stored-{kind}" / "head"))
        tau_o = evaluate.run(cfg_e)["acceptance_length"]
        tau_s = evaluate.run(cfg_s)["acceptance_length"]
        assert tau_o == pytest.approx(tau_s, abs=1e-6)


def test_missing_draft_vocab_names_tokenmap_stage(env, tmp_path):
    from eagle_infer.errors import UserError

    cfg = make_cfg(env, tmp_path, **{"draft.draft_vocab_size": 64})
    with pytest.raises(UserError, match="stage=tokenmap"):
        _train(cfg)


def test_cosine_decays_over_the_time_budget_when_time_runs_ahead_of_steps():
    from eagle_train.train import cosine_with_warmup

    frac = [0.0]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    factor = cosine_with_warmup(opt, warmup=2, total=100, time_progress=lambda: frac[0]).lr_lambdas[0]
    assert factor(1) == 0.5  # warm-up counts steps
    assert factor(51) == pytest.approx(0.5 * (1 + math.cos(math.pi * 49 / 98)))  # steps ahead of time
    frac[0] = 0.01  # time ahead of steps in the warm-up: so is the ramp
    assert factor(0) == pytest.approx(0.5)
    frac[0] = 0.75  # and in the decay
    assert factor(10) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.73 / 0.98)))
    frac[0] = 1.5
    assert factor(10) == 0.0


class _Clock:
    """`time` for eagle_train.train, with a perf_counter that moves one second a call."""

    def __init__(self):
        import time

        self.t, self.time, self.sleep = 0.0, time.time, time.sleep

    def perf_counter(self) -> float:
        self.t += 1.0
        return self.t


def test_time_budget_ends_the_run_with_the_lr_decayed_and_resumes_within_it(env, tmp_path, monkeypatch):
    """train.max_seconds: the run ends where its budget does (not at max_steps), finished, with the
    lr decayed over the seconds spent; killed and resumed, it counts the seconds spent before."""
    import eagle_train.train as tr

    over = {"train.max_steps": 500, "train.max_seconds": 40, "train.save_every": 1}
    monkeypatch.setattr(tr, "time", _Clock())  # 3 s a step: the step's clock read and the log's two
    summary, _ = _train(make_cfg(env, tmp_path / "a", **over))
    assert summary["finished"] and summary["ended_by"] == "max_seconds"
    assert 10 <= summary["step"] <= 15 and summary["total_steps"] == summary["step"]
    log = [json.loads(x) for x in (tmp_path / "a" / "head" / "train_log.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in log]
    # warm-up is 10% of max_steps (50 steps, past the end): counted in steps the lr would still be
    # rising; over 10% of the budget it peaks early, then decays to near 0 by the budget's end
    assert lrs[-1] < 0.1 * max(lrs) and lrs.index(max(lrs)) < len(lrs) - 3
    from eagle_train.train import is_complete

    assert is_complete(make_cfg(env, tmp_path / "a", **over))
    # Killed after 5 steps, then resumed: the budget counts the seconds before the kill.
    monkeypatch.setattr(tr, "time", _Clock())
    part, _ = _train(make_cfg(env, tmp_path / "b", **over), stop_after=5)
    assert not part["finished"]
    state = json.loads((tmp_path / "b" / "head" / "checkpoints" / "step_5" / tr.STATE_FILE).read_text())
    assert state["train_seconds"] >= 13
    monkeypatch.setattr(tr, "time", _Clock())
    resumed, _ = _train(make_cfg(env, tmp_path / "b", **over))
    assert resumed["finished"] and resumed["ended_by"] == "max_seconds"
    assert resumed["step"] <= summary["step"] + 1


# ---------------------------------------------------------------------------------------------
# Two processes through accelerate launch (gloo on CPU)


@pytest.mark.slow
def test_accelerate_launch_two_processes(env, tmp_path):
    if shutil.which("accelerate") is None:
        pytest.skip("accelerate CLI not installed")
    out = tmp_path / "run"
    cmd = ["accelerate", "launch", "--config_file", str(REPO / "conf/accelerate/cpu_2proc.yaml"),
           "-m", "eagle_train", "stage=train", "preset=none", f"model.path={env['target_dir']}",
           "model.name=tiny", f"capture_dir={env['capture']}", f"workdir={out}", f"head_dir={out / 'head'}",
           "device=cpu", "train.wandb.mode=disabled", "train.max_steps=3", "train.batch_size=2",
           "train.max_length=48", "train.bf16=false", "train.save_every=2", "train.log_every=1",
           f"draft.draft_vocab_size={DRAFT_VOCAB}", "draft.ttt_steps=2"]
    envv = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_PORT="29533")
    p = subprocess.run(cmd, cwd=tmp_path, env=envv, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    summary = json.loads((out / "head" / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["finished"] and summary["step"] == 3
    assert (out / "head" / "model.safetensors").is_file()
    assert sys.executable  # (the launcher runs the same interpreter's accelerate)
