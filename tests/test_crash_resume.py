"""Crash-resume for real: training and capture are SIGKILLed at chosen points in subprocesses and
started again; the end result equals an uninterrupted run's, bit for bit.

Kill points are deterministic: ``EAGLE_TEST_KILL_AT=<site>:<n>`` makes the process SIGKILL
itself the n-th time it passes the named site (`eagle_train.shards.kill_point`), and prints a
line first, so each test checks that the process died of SIGKILL exactly there and that the
files on disk are in the state that point implies (a half-written checkpoint, a temp shard, a
shard the manifest does not list yet) before it restarts the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import _head_params, _train, tiny_env

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # several interpreter start-ups each (still run in CI)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The in-process reference runs must compute exactly as the one-thread subprocesses
    (OMP_NUM_THREADS=1) do, whatever EAGLE_TEST_THREADS says."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return tiny_env(tmp_path_factory.mktemp("crash_env"))


def run_cli(args: list[str], cwd: Path, kill: str | None = None, timeout: int = 240) -> str:
    """python -m eagle_train ARGS in a subprocess; with `kill` (site:n, or site:n=SIGNAME) it must
    die of SIGKILL (or that signal) at that site, without it it must succeed. Returns its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("EAGLE_TEST_KILL_AT", None)
    env.pop("HYDRA_FULL_ERROR", None)
    if kill:
        env["EAGLE_TEST_KILL_AT"] = kill
    # SIGINT as a terminal gives it (pytest-xdist's workers, and so their children, ignore it)
    p = subprocess.run([sys.executable, "-m", "eagle_train", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=timeout,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out = p.stdout + p.stderr
    if kill is None:
        assert p.returncode == 0, out[-6000:]
    else:
        site, _, sig = kill.partition("=")
        sig = sig or "SIGKILL"
        # SIGINT ends a Python process as KeyboardInterrupt, which eagle_train turns into 130
        want = 130 if sig == "SIGINT" else -signal.Signals[sig]
        assert p.returncode == want, f"no {sig} at {site}: rc {p.returncode}\n{out[-6000:]}"
        assert f"EAGLE_TEST_KILL_AT: {sig} at {site} " in out, out[-3000:]
    return out


# ---------------------------------------------------------------------------------------------
# Training


def train_overrides(env: dict, out: Path) -> dict:
    """An EAGLE-2 run (input noise: the RNG state must survive the restart too), 8 optimizer
    steps, a checkpoint every 2, the newest 2 kept."""
    return {
        "stage": "train", "preset": "none", "draft": "eagle2", "model.path": str(env["target_dir"]),
        "model.name": "tiny", "capture_dir": str(env["capture"]), "workdir": str(out),
        "head_dir": str(out / "head"), "tokenmap_dir": str(out / "tokenmaps"), "device": "cpu",
        "train.wandb.mode": "disabled", "train.batch_size": 4, "train.max_length": 64, "train.lr": 3e-3,
        "train.warmup_ratio": 0.1, "train.bf16": False, "train.log_every": 1, "train.save_every": 2,
        "train.keep_checkpoints": 2, "train.max_steps": 8,
    }


def compose(overrides: dict):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from eagle_train.pipeline import prepare_config

    with initialize_config_dir(version_base=None, config_dir=str(REPO / "conf")):
        return prepare_config(hydra_compose("config", overrides=[f"{k}={v}" for k, v in overrides.items()]))


def checkpoints(head: Path) -> list[str]:
    return sorted(p.name for p in (head / "checkpoints").iterdir())


def log_steps(head: Path) -> list[dict]:
    return [json.loads(x) for x in (head / "train_log.jsonl").read_text().splitlines()]


def test_training_killed_mid_step_and_mid_checkpoint_resumes_to_the_same_weights(env, tmp_path):
    ref_over = train_overrides(env, tmp_path / "ref")
    summary_ref, _ = _train(compose(ref_over))  # uninterrupted, in this process
    assert summary_ref["finished"] and summary_ref["step"] == 8

    out = tmp_path / "killed"
    over = train_overrides(env, out)
    args = [f"{k}={v}" for k, v in over.items()]
    head = out / "head"

    # 1. Mid-step: the 5th micro-batch's gradients are computed, the weights not yet updated.
    run_cli(args, tmp_path, kill="train_backward:5")
    assert checkpoints(head) == ["step_2", "step_4"]
    assert [r["step"] for r in log_steps(head)] == [1, 2, 3, 4]

    # 2. Mid-checkpoint: resumed at 4, the step-6 checkpoint is written but not renamed into place.
    text = run_cli(args, tmp_path, kill="ckpt_write:1")
    assert "resuming from" in text and "step_4" in text
    assert checkpoints(head) == ["step_2", "step_4", "step_6.partial"]
    partial = head / "checkpoints" / "step_6.partial"
    assert (partial / "model.safetensors").is_file() and not (partial / "trainer_state.json").exists()

    # 3. The half-written checkpoint is ignored (resumed from 4 again) and deleted; to the end, with
    # the same weights and the same log as the uninterrupted run.
    text = run_cli(args, tmp_path)
    assert "removed leftovers of an interrupted run: step_6.partial" in text
    assert "resuming from" in text and "(step 4/8)" in text
    assert checkpoints(head) == ["step_6", "step_8"]  # keep_checkpoints=2
    summary = json.loads((head / "train_summary.json").read_text())
    assert summary["finished"] and summary["step"] == 8
    assert summary["tokens_total"] == summary_ref["tokens_total"]
    ref, got = _head_params(tmp_path / "ref" / "head"), _head_params(head)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    ref_log, got_log = log_steps(tmp_path / "ref" / "head"), log_steps(head)
    assert [r["step"] for r in got_log] == list(range(1, 9))
    assert [r["loss"] for r in got_log] == [r["loss"] for r in ref_log]
    # The fp32 training state too (the saved head is bf16): the last checkpoints agree exactly.
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "ref" / "head" / "checkpoints" / "step_8" / "model.safetensors"))
    b = load_file(str(head / "checkpoints" / "step_8" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_stopped_by_sigterm_or_sigint_saves_its_step_and_resumes_to_the_same_weights(env, tmp_path):
    """A deadline's SIGTERM (and Ctrl-C's SIGINT) mid-step: the step finishes, a checkpoint and the
    head of that step are saved although save_every is off, the process dies of the signal; the
    same command resumes and ends with an uninterrupted run's weights."""
    from safetensors.torch import load_file

    ref_over = train_overrides(env, tmp_path / "ref")
    summary_ref, _ = _train(compose(ref_over))
    out = tmp_path / "stopped"
    over = dict(train_overrides(env, out), **{"train.save_every": 0})
    args = [f"{k}={v}" for k, v in over.items()]
    head = out / "head"

    text = run_cli(args, tmp_path, kill="train_backward:3=SIGTERM")
    assert "train: stopped by SIGTERM at step 3/8" in text, text[-3000:]
    assert checkpoints(head) == ["step_3"]
    assert [r["step"] for r in log_steps(head)] == [1, 2, 3]
    summary = json.loads((head / "train_summary.json").read_text())
    assert not summary["finished"] and summary["stopped_by"] == "SIGTERM" and summary["step"] == 3
    # the saved head is the training state of step 3 (in bf16), in the head's own layout
    ckpt = load_file(str(head / "checkpoints" / "step_3" / "model.safetensors"))
    saved = _head_params(head)
    assert saved and (head / "config.json").is_file()
    assert all(torch.equal(v, ckpt[f"head.{k}"].to(v.dtype)) for k, v in saved.items())

    text = run_cli(args, tmp_path, kill="train_step:2=SIGINT")  # resumed at 3, stops at 5
    assert "(step 3/8)" in text and "train: stopped by SIGINT at step 5/8" in text, text[-3000:]
    assert checkpoints(head) == ["step_3", "step_5"]

    text = run_cli(args, tmp_path)
    assert "(step 5/8)" in text
    summary = json.loads((head / "train_summary.json").read_text())
    assert summary["finished"] and summary["step"] == 8 and "stopped_by" not in summary
    assert summary["tokens_total"] == summary_ref["tokens_total"]
    ref, got = _head_params(tmp_path / "ref" / "head"), _head_params(head)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_stop_on_signal_defers_the_first_signal_only_and_restores_the_handlers():
    from eagle_train.train import StopOnSignal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (xdist's workers ignore it)
    try:
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signum == signal.SIGINT  # noted, nothing raised
            with pytest.raises(KeyboardInterrupt):  # the second acts at once
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        # an ignored signal stays ignored (a background job's SIGINT): no stop, nothing raised
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signum is None
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_checkpoint_leftovers_are_cleaned_and_never_resumed_from(tmp_path):
    """What a kill can leave in checkpoints/: a half-written or half-deleted folder, or a step_N
    without its state. None counts as complete; all are removed."""
    from eagle_train.train import complete_checkpoints, discard_dir, remove_checkpoint_leftovers

    root = tmp_path / "checkpoints"
    for name, state in [("step_2", True), ("step_4", True), ("step_6.partial", False),
                        ("step_8.partial", True), ("step_3.discarded", True), ("step_10", False)]:
        (root / name).mkdir(parents=True)
        (root / name / "model.safetensors").write_bytes(b"x")
        if state:
            (root / name / "trainer_state.json").write_text("{}")
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 4]
    removed = remove_checkpoint_leftovers(tmp_path)
    assert sorted(removed) == ["step_10", "step_3.discarded", "step_6.partial", "step_8.partial"]
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]
    discard_dir(root / "step_2")
    assert sorted(p.name for p in root.iterdir()) == ["step_4"]


# ---------------------------------------------------------------------------------------------
# Capture


CAPTURE = {
    "stage": "capture", "preset": "quick", "data": "mtbench_dummy", "model.name": "tiny-chat",
    "capture.limit": 6, "capture.max_turns": 1, "capture.max_new_tokens_per_turn": 8,
    "capture.batch_size": 2, "capture.shard_size": 2, "capture.dtype": "fp32", "capture.store_dtype": "fp32",
    "capture.aux_layers": "[1,2,3]", "eval.num_samples": 2, "device": "cpu",
}


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama (hidden 64, 4 layers) with the default model's tokenizer and chat
    template: real conversations render and generate in milliseconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("chat_target")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                      tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = LlamaForCausalLM(cfg)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, out / name)
    return out


def capture_samples(directory: Path, split: str = "train") -> dict[int, dict]:
    """sample id -> everything stored for it (tokens, mask, states, conversation)."""
    from eagle_train.shards import CaptureDataset

    ds = CaptureDataset(directory, split=split)
    return {ds.sample_ids[i]: dict(ds[i], conversation=ds.conversation(i)) for i in range(len(ds))}


def test_capture_killed_anywhere_loses_and_duplicates_nothing(chat_target, tmp_path):
    from eagle_train import capture
    from eagle_train.shards import read_manifest

    ref_over = dict(CAPTURE, **{"model.path": str(chat_target), "workdir": str(tmp_path / "ref")})
    capture.run(compose(ref_over))  # uninterrupted, in this process
    ref_dir = tmp_path / "ref" / "capture"
    ref = capture_samples(ref_dir)
    assert len(ref) == 6 and read_manifest(ref_dir)["complete"]

    workdir = tmp_path / "killed"
    over = dict(CAPTURE, **{"model.path": str(chat_target), "workdir": str(workdir)})
    args = [f"{k}={v}" for k, v in over.items()]
    cap = workdir / "capture"

    def state() -> tuple[list[str], int]:
        return sorted(p.name for p in cap.glob("shard-*")), len(read_manifest(cap)["shards"])

    # 1. Mid-generation of the second shard's batch: shard 0 is stored.
    run_cli(args, tmp_path, kill="capture_generate:2")
    assert state() == (["shard-00000.safetensors"], 1)
    # 2. Mid-shard-write: shard 1 is written to its temp file, not renamed.
    run_cli(args, tmp_path, kill="shard_write:1")
    assert state() == (["shard-00000.safetensors", "shard-00001.safetensors.tmp"], 1)
    # 3. Between shard and manifest: shard 2 is in place, the manifest does not list it yet.
    text = run_cli(args, tmp_path, kill="shard_commit:2")
    assert "removed leftovers of an interrupted run: shard-00001.safetensors.tmp" in text
    assert state() == ([f"shard-0000{i}.safetensors" for i in range(3)], 2)
    # 4. Mid-manifest-write after shard 2 (writes 1 and 2 are both splits' plans): its temp file
    # is written, not renamed; the orphan shard 2 of run 3 was deleted and written again.
    text = run_cli(args, tmp_path, kill="atomic_write:manifest.json:3")
    assert "removed leftovers of an interrupted run: shard-00002.safetensors" in text
    assert state() == ([f"shard-0000{i}.safetensors" for i in range(3)], 2)
    assert len(list(cap.glob("manifest.json.*.tmp"))) == 1
    # 5. To the end.
    run_cli(args, tmp_path)

    final = read_manifest(cap)
    ids = [sid for s in final["shards"] for sid in s["sample_ids"]]
    assert final["complete"] and len(ids) == len(set(ids)) == 6 and sorted(ids) == final["planned_ids"]
    assert [s["file"] for s in final["shards"]] == [f"shard-0000{i}.safetensors" for i in range(3)]
    assert sorted(p.name for p in cap.iterdir() if p.name.startswith(("shard-", "manifest"))) == [
        "manifest.json", "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    for split in ("train", "heldout"):
        want = ref if split == "train" else capture_samples(ref_dir, split)
        got = capture_samples(cap, split)
        assert sorted(got) == sorted(want), split
        for sid, w in want.items():
            g = got[sid]
            assert g["conversation"] == w["conversation"], sid
            for key in ("input_ids", "loss_mask", "hidden", "aux"):
                assert torch.equal(g[key], w[key]), (split, sid, key)
    assert [s["tokens"] for s in final["shards"]] == [s["tokens"] for s in read_manifest(ref_dir)["shards"]]
