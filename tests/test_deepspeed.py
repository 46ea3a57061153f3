"""DeepSpeed ZeRO-2 for real, on CPU: two processes through ``accelerate launch --use_deepspeed
--deepspeed_config_file conf/deepspeed/zero2.json`` (DeepSpeed's CPU accelerator, gloo) follow
the loss trajectory of the plain two-process accelerate run (DDP), write DeepSpeed checkpoints
(one optimizer partition per process), and a run SIGKILLed after a checkpoint resumes from it to
the same end.

The tiny target and capture are test_train's (hidden 64, 12 samples); 4 optimizer steps of 2
accumulated micro-batches with gradient clipping on, so DeepSpeed's "auto" accumulation and
clipping must follow train.grad_accum / train.grad_clip for the trajectories to agree.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import DRAFT_VOCAB, tiny_env

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
pytestmark = pytest.mark.slow  # three launches of two processes (still run in CI)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(launcher: list[str], env: dict, out: Path, kill: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", "2",
           "--main_process_port", str(free_port()), "-m", "eagle_train",
           "stage=train", "preset=none", f"model.path={env['target_dir']}", "model.name=tiny",
           f"capture_dir={env['capture']}", f"workdir={out}", f"head_dir={out / 'head'}", "device=cpu",
           "train.wandb.mode=disabled", f"train.max_steps={STEPS}", "train.batch_size=2",
           "train.grad_accum=2", "train.max_length=48", "train.bf16=false", "train.save_every=2",
           "train.log_every=1", "train.lr=3e-3", "train.grad_clip=0.05",
           f"draft.draft_vocab_size={DRAFT_VOCAB}", "draft.ttt_steps=2"]
    penv = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    penv.pop("EAGLE_TEST_KILL_AT", None)
    if kill:
        penv["EAGLE_TEST_KILL_AT"] = kill
    return subprocess.run(cmd, cwd=out.parent, env=penv, capture_output=True, text=True, timeout=300)


def losses(head: Path) -> list[float]:
    recs = [json.loads(x) for x in (head / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    return [r["loss"] for r in recs]


def test_deepspeed_zero2_matches_ddp_and_resumes_after_sigkill(tmp_path):
    import deepspeed  # noqa: F401  (the test extra installs it: missing, this fails rather than skips)

    env = tiny_env(tmp_path / "env")
    ddp, ds = tmp_path / "ddp", tmp_path / "ds"
    ddp.mkdir()
    ds.mkdir()

    p = launch(["--multi_gpu"], env, ddp)  # plain accelerate: torchrun + DDP over gloo
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]

    # DeepSpeed, each process SIGKILLing itself right after step 3: the last checkpoint is step 2.
    launcher = ["--use_deepspeed", "--deepspeed_config_file", str(REPO / "conf/deepspeed/zero2.json")]
    p = launch(launcher, env, ds, kill="train_step:3")
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "EAGLE_TEST_KILL_AT: SIGKILL at train_step:3" in out, out[-5000:]
    ckpts = sorted(x.name for x in (ds / "head" / "checkpoints").iterdir())
    assert ckpts == ["step_2"]
    # A DeepSpeed checkpoint: ZeRO-2 optimizer state partitioned over the two processes.
    zero = ds / "head" / "checkpoints" / "step_2" / "pytorch_model"
    assert sorted(x.name for x in zero.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    p = launch(launcher, env, ds)  # the same command again: resumes from step 2
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert "resuming from" in out and "step 2/4" in out
    summary = json.loads((ds / "head" / "train_summary.json").read_text())
    assert summary["finished"] and summary["step"] == STEPS and summary["num_processes"] == 2

    # Same loss trajectory as DDP (steps 1-2 before the kill, 3-4 after the resume) ...
    want, got = losses(ddp / "head"), losses(ds / "head")
    assert max(abs(a - b) / abs(a) for a, b in zip(want, got)) < 1e-4, (want, got)
    assert len(set(want)) == STEPS  # (the loss moves: the comparison means something)
    # ... and the same fp32 weights at the end.
    ref = load_file(str(ddp / "head" / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    zero = ds / "head" / "checkpoints" / f"step_{STEPS}" / "pytorch_model"
    states = torch.load(zero / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    trained = [k for k in ref if k.startswith("head.") and "embed" not in k]
    assert trained and set(trained) <= set(states)
    for k in trained:
        torch.testing.assert_close(states[k].float(), ref[k].float(), atol=2e-5, rtol=1e-4, msg=k)
