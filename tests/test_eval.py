"""Offline acceptance evaluation (stage=eval) on the tiny target and capture of test_train."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from test_train import N_HELDOUT, OracleHead, _train, env, fresh_head, make_cfg, one_thread  # noqa: F401

from eagle_infer.errors import UserError
from eagle_infer.heads import save_head
from eagle_train import evaluate
from eagle_train.shards import CaptureDataset, pad_collate

UNROLL = 4


@pytest.fixture(scope="module")
def trained(env, tmp_path_factory):  # noqa: F811
    """An EAGLE-3 head trained (overfit) on the tiny capture, and its config."""
    out = tmp_path_factory.mktemp("eval_trained")
    cfg = make_cfg(env, out, **{"train.max_steps": 40, "train.lr": 1e-2, "eval.unroll": UNROLL})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train(cfg)
    finally:
        torch.set_num_threads(threads)
    return cfg, out


def test_eval_writes_report_and_plot(trained):
    cfg, out = trained
    assert not evaluate.is_complete(cfg)
    res = evaluate.run(cfg)
    rec = json.loads((out / "eval" / "eval.json").read_text())
    assert (out / "eval" / "acceptance.png").stat().st_size > 0
    assert rec["acceptance_length"] == pytest.approx(res["acceptance_length"])
    assert rec["acceptance_length"] >= 1.0
    for key in ("accept_rate_per_position", "top1_per_position", "positions_counted"):
        assert len(rec[key]) == UNROLL, key
        assert all(0.0 <= x <= 1.0 for x in rec[key]) or key == "positions_counted"
    assert rec["num_samples"] == N_HELDOUT and rec["num_start_positions"] > 0 and rec["num_tokens"] > 0
    assert rec["kind"] == "eagle3" and rec["unroll"] == UNROLL
    # Position 1 is unconditional either way; tau = 1 + mean leading matches.
    assert rec["accept_rate_per_position"][0] == pytest.approx(rec["top1_per_position"][0])
    hist = rec["leading_matches_histogram"]
    assert sum(hist) == rec["num_start_positions"]
    assert rec["acceptance_length"] == pytest.approx(1 + sum(i * h for i, h in enumerate(hist)) / sum(hist))
    assert evaluate.is_complete(cfg)


def test_trained_head_beats_fresh_head(trained, env):  # noqa: F811
    """On the capture it was trained on, the trained head drafts far better than a fresh one."""
    from eagle_infer.heads import load_head

    cfg, out = trained
    model = env["model"]
    target = SimpleNamespace(lm_head_weight=model.lm_head.weight)
    ds = CaptureDataset(env["capture"])
    head = load_head(out / "head", model.config, model.embed_tokens, model.lm_head.weight,
                     dtype=torch.float32)
    fresh = fresh_head(env, "eagle3", seed=1).eval()
    args = (ds, UNROLL, None, 4, 64, torch.device("cpu"))
    good = evaluate.evaluate_head(head, target, *args)
    bad = evaluate.evaluate_head(fresh, target, *args)
    assert good["acceptance_length"] > bad["acceptance_length"] + 0.5, (good, bad)
    assert good["top1_per_position"][0] > 0.5


def test_oracle_head_is_fully_accepted(env):  # noqa: F811
    ds = CaptureDataset(env["capture"], split="heldout")
    batch = pad_collate([ds[i] for i in range(len(ds))])
    w = env["model"].lm_head.weight
    res = evaluate.evaluate_head(OracleHead(batch["hidden"], w), SimpleNamespace(lm_head_weight=w), ds,
                                 UNROLL, None, len(ds), 1024, torch.device("cpu"))
    assert res["accept_rate_per_position"] == [1.0] * UNROLL
    assert res["top1_per_position"] == [1.0] * UNROLL
    # Every start drafts until the chain or the answer ends.
    lens = [int(ds[i]["loss_mask"].sum()) for i in range(len(ds))]  # answers run to the end
    # Start t = P-2+j (j < n) predicts answer token j first; n - j answer tokens remain.
    leads = [min(UNROLL, n - j) for n in lens for j in range(n)]
    assert res["num_start_positions"] == len(leads)
    assert res["acceptance_length"] == pytest.approx(1 + sum(leads) / len(leads))


def test_eval_head_override_and_missing_head(env, tmp_path):  # noqa: F811
    cfg = make_cfg(env, tmp_path, "eagle2", **{"eval.unroll": 2})
    with pytest.raises(UserError, match="stage=train"):
        evaluate.run(cfg)
    other = tmp_path / "other_head"
    save_head(fresh_head(env, "eagle2"), other)
    cfg = make_cfg(env, tmp_path, "eagle2", **{"eval.unroll": 2, "eval.head": str(other)})
    res = evaluate.run(cfg)
    assert res["head"] == str(other) and res["kind"] == "eagle2"
    assert len(res["accept_rate_per_position"]) == 2 and res["acceptance_length"] >= 1.0
    with pytest.raises(UserError, match="no draft head"):
        evaluate.run(make_cfg(env, tmp_path, **{"eval.head": str(tmp_path / "nowhere")}))


def test_eval_on_the_training_split(trained, env, tmp_path):  # noqa: F811
    """eval.split=train measures a head on its own training data (beside the held-out split:
    fitting against generalising), in its own eval folder; another split name is an error
    naming the choices."""
    _, out = trained

    def cfg(**over):
        return make_cfg(env, out, **{"eval.unroll": UNROLL, **over})

    own = cfg(**{"eval.split": "train", "eval.num_samples": "null", "eval_dir": str(tmp_path / "eval-train")})
    res = evaluate.run(own)
    train = CaptureDataset(env["capture"])
    assert res["split"] == "train" and res["capture"] == str(train.path) and res["num_samples"] == len(train)
    held = evaluate.run(cfg(**{"eval_dir": str(tmp_path / "eval-heldout")}))
    assert held["split"] == "heldout" and held["num_samples"] == N_HELDOUT
    assert res["acceptance_length"] > held["acceptance_length"]  # the head was overfit on these
    assert evaluate.is_complete(own)  # a held-out eval into the same folder is not this one
    assert not evaluate.is_complete(cfg(**{"eval.num_samples": "null", "eval_dir": own.eval_dir}))
    with pytest.raises(UserError, match="unknown capture split 'test': use train or heldout"):
        evaluate.run(cfg(**{"eval.split": "test", "eval_dir": str(tmp_path / "e")}))
