"""Capture stage: stored states match the target, the loss mask covers the regenerated answers,
a capture killed mid-run resumes without losing or duplicating samples and reproduces the
uninterrupted run, and a capture refuses other settings or another model with a clear error.

The default target runs at tiny limits (4 MT-bench-dummy conversations, one turn, 8 new
tokens, batch 2, fp32 so stored states can be compared tightly).
"""

from __future__ import annotations

import json
import lzma
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle_infer.errors import UserError

REPO = Path(__file__).resolve().parents[1]
# One turn of 8 tokens for 4 train conversations, 2 per batch and per shard (2 shards).
CAPTURE_OVERRIDES = [
    "preset=quick", "data=mtbench_dummy", "capture.limit=4", "capture.max_turns=1",
    "capture.max_new_tokens_per_turn=8", "capture.batch_size=2", "capture.shard_size=2",
    "capture.dtype=fp32", "capture.store_dtype=fp32", "eval.num_samples=0",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Single-threaded torch in this module: tiny matrices gain nothing from a second thread,
    lose a lot when other jobs share the cores, and the subprocesses run the same way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from eagle_train.pipeline import prepare_config

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return prepare_config(hydra_compose("config", overrides=overrides))


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # One thread: identical numbers in every process (the resumed run must reproduce the
    # uninterrupted one), and no slow-down when other jobs share the cores.
    env["OMP_NUM_THREADS"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


@pytest.fixture(scope="module")
def reference_capture(tmp_path_factory, default_model_fp32, tokenizer):
    """An uninterrupted capture (in-process, the shared default model), plus one heldout sample."""
    from eagle_train import capture

    workdir = tmp_path_factory.mktemp("ref_capture")
    cfg = compose([*CAPTURE_OVERRIDES[:-1], "eval.num_samples=1", f"workdir={workdir}"])
    return cfg, capture.run(cfg, model=default_model_fp32, tokenizer=tokenizer)


def test_stored_states_match_a_fresh_forward(reference_capture, default_model_fp32, tokenizer):
    from eagle_infer.model import causal_mask
    from eagle_train.shards import CaptureDataset

    cfg, result = reference_capture
    model = default_model_fp32
    ds = CaptureDataset(cfg.capture_dir, model=model)
    assert ds.complete and len(ds) == 4 and sorted(ds.sample_ids) == ds.sample_ids
    N = model.config.num_layers
    aux_ids = model.config.eagle3_layer_ids()
    assert ds.aux_layer_ids == aux_ids == [2, 15, 27]
    from eagle_train.data import load_conversations

    originals = load_conversations("mtbench_dummy", limit=8)
    model.setup_cache(1, 512)
    for i in range(len(ds)):
        item = ds[i]
        ids, mask = item["input_ids"], item["loss_mask"]
        T = len(ids)
        assert item["hidden"].shape == (T, 576) and item["aux"].shape == (T, 3 * 576)
        pos = torch.arange(T)[None]
        _, hidden = model(ids[None], pos, pos, causal_mask(torch.zeros(1, dtype=torch.long), T, T),
                          hidden_layers=[*aux_ids, N], compute_logits=False)
        torch.testing.assert_close(item["hidden"], hidden[-1][0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(item["aux"], torch.cat(hidden[:-1], -1)[0], atol=1e-3, rtol=1e-4)

        # The loss mask covers exactly the regenerated answer (+ its end-of-turn token when
        # the model ended the answer itself); the prompt is the dataset's user turn.
        conv = ds.conversation(i)
        assert [m["role"] for m in conv][-2:] == ["user", "assistant"]
        answer = conv[-1]["content"]
        masked = ids[mask].tolist()
        truncated = item["sample_id"] in ds.manifest["shards"][i // 2]["truncated_ids"]
        expect = tokenizer.decode(masked, skip_special_tokens=False)
        assert expect == answer + ("" if truncated else "<|im_end|>")
        assert masked and not mask[: T - len(masked) - 2].any()  # nothing before the answer
        # The prompt is the dataset's; the answer is the model's own text.
        original = originals[item["sample_id"]]
        assert conv[0] == original[0] and answer != original[1]["content"]
    assert result["stats"].gen_tokens > 0

    held = CaptureDataset(cfg.capture_dir, split="heldout")
    assert len(held) == 1 and held.sample_ids[0] not in ds.sample_ids


def test_heldout_answers_are_the_targets_greedy_ones(reference_capture, default_model_fp32, tokenizer):
    """capture.heldout_temperature=0 (the default): the held-out answer is the target's greedy
    continuation, so stage=eval's chain runs on what greedy decoding produces; train samples."""
    from eagle_infer.generate import generate
    from eagle_train.data import render_prompt
    from eagle_train.evaluate import heldout_answers
    from eagle_train.shards import CaptureDataset

    cfg, _ = reference_capture
    held, train = CaptureDataset(cfg.capture_dir, split="heldout"), CaptureDataset(cfg.capture_dir)
    assert held.manifest["settings"]["temperature"] == 0.0
    assert train.manifest["settings"]["temperature"] == float(cfg.capture.temperature) == 0.7
    assert heldout_answers(held.manifest["settings"]) == "greedy"
    assert heldout_answers(train.manifest["settings"]) == "sampled at T=0.7"
    conv = held.conversation(0)
    eos = held.manifest["eos_token_ids"]
    out = generate(default_model_fp32, [render_prompt(tokenizer, conv[:-1])], 8, eos_token_ids=eos)[0]
    out = out[:-1] if out[-1] in eos else out
    assert tokenizer.decode(out, skip_special_tokens=True) == conv[-1]["content"]


def test_capture_is_deterministic_and_resumable_after_sigkill(reference_capture, tmp_path,
                                                              default_model_fp32, tokenizer):
    """SIGKILL right after the first shard lands; the rerun finishes with every sample once and
    the same data as the uninterrupted reference run."""
    from eagle_train.shards import CaptureDataset, read_manifest

    ref_cfg, _ = reference_capture
    workdir = tmp_path / "run"
    args = ["stage=capture", *CAPTURE_OVERRIDES, f"workdir={workdir}"]
    manifest = workdir / "capture" / "manifest.json"
    log = open(tmp_path / "killed.log", "w")  # a file, not a pipe nobody drains
    proc = subprocess.Popen([sys.executable, "-m", "eagle_train", *args], cwd=tmp_path, env=cli_env(),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if manifest.is_file() and json.loads(manifest.read_text())["shards"]:
                break
            time.sleep(0.05)
        assert proc.poll() is None, ("capture ended before it could be killed: "
                                     + (tmp_path / "killed.log").read_text())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
    killed = read_manifest(workdir / "capture")
    assert len(killed["shards"]) == 1 and not killed["complete"]
    # Leftovers a kill can leave: a half-written shard and one renamed before its manifest.
    (workdir / "capture" / "shard-00001.safetensors.tmp").write_bytes(b"partial")
    (workdir / "capture" / "shard-00007.safetensors").write_bytes(b"orphan")

    # Restart (in-process, sharing the already loaded target: the resume logic is the same).
    from eagle_train import capture

    cfg = compose([*CAPTURE_OVERRIDES, f"workdir={workdir}"])
    assert not capture.is_complete(cfg)
    capture.run(cfg, model=default_model_fp32, tokenizer=tokenizer)
    final = read_manifest(workdir / "capture")
    ids = [sid for s in final["shards"] for sid in s["sample_ids"]]
    ref = CaptureDataset(ref_cfg.capture_dir)
    assert final["complete"] and len(ids) == len(set(ids)) == 4
    assert sorted(ids) == ref.sample_ids == final["planned_ids"]
    assert sorted(p.name for p in (workdir / "capture").glob("shard-*")) == [
        "shard-00000.safetensors", "shard-00001.safetensors"]
    # The CLI saved the resolved config beside the capture and kept Hydra's files apart.
    assert f"capture_dir: {workdir / 'capture'}" in (workdir / "capture" / "config.yaml").read_text()
    assert len(list((workdir / "hydra").glob("capture-*/.hydra/config.yaml"))) == 1
    # Same seed, same data: the resumed capture equals the uninterrupted one token for token.
    ds = CaptureDataset(workdir / "capture")
    for i in range(len(ds)):
        j = ref.sample_ids.index(ds.sample_ids[i])
        assert torch.equal(ds.tokens(i)[0], ref.tokens(j)[0])
        assert torch.equal(ds.tokens(i)[1], ref.tokens(j)[1])
    # Run again: nothing left to do (the model is not even loaded), nothing touched.
    before = {p.name: p.stat().st_mtime_ns for p in (workdir / "capture").glob("shard-*")}
    assert capture.is_complete(cfg)
    assert capture.run(cfg)["stats"].samples == 0
    assert {p.name: p.stat().st_mtime_ns for p in (workdir / "capture").glob("shard-*")} == before


def test_capture_dataset_errors(reference_capture, tmp_path):
    from eagle_train.shards import CaptureDataset, pad_collate

    cfg, _ = reference_capture
    with pytest.raises(UserError, match="capture directory not found"):
        CaptureDataset(tmp_path / "nope")
    with pytest.raises(UserError, match="no manifest.json"):
        CaptureDataset(tmp_path)
    with pytest.raises(UserError, match="hidden size 576 != 64"):
        CaptureDataset(cfg.capture_dir, hidden_size=64)
    with pytest.raises(UserError, match="vocab size 49152 != 256"):
        CaptureDataset(cfg.capture_dir, vocab_size=256)
    ds = CaptureDataset(cfg.capture_dir, hidden_size=576, vocab_size=49152)
    batch = pad_collate([ds[0], ds[1]])
    T = max(ds.lengths()[:2])
    assert batch["input_ids"].shape == (2, T) and batch["hidden"].shape == (2, T, 576)
    assert batch["attention_mask"].sum().item() == sum(ds.lengths()[:2])


def test_capture_refuses_other_settings_and_skips_bad_records(reference_capture, tmp_path):
    from eagle_train import capture

    cfg, _ = reference_capture
    other = compose([*CAPTURE_OVERRIDES, "capture.temperature=0.2", f"workdir={Path(cfg.workdir)}"])
    with pytest.raises(UserError, match=r"other settings \(temperature: 0.7 -> 0.2\)"):
        capture.run(other)
    # Only the held-out split differs: the message names its folder and how to keep it.
    other = compose([*CAPTURE_OVERRIDES[:-1], "eval.num_samples=1", "capture.heldout_temperature=0.7",
                     f"workdir={Path(cfg.workdir)}"])
    with pytest.raises(UserError, match=r"heldout was made with other settings \(temperature: 0.0 -> 0.7\).*"
                                        r"to keep this split instead: capture.heldout_temperature=0.0"):
        capture.run(other)

    job = capture.plan_conversation(3, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                                    regenerate=True, max_turns=None)
    assert [m["role"] for m in job.messages] == ["user", "assistant", "user", "assistant"]
    for conv, reason in [([], "empty"), ([{"role": "assistant", "content": "x"}], "no user turn")]:
        with pytest.raises(capture.Skip, match=reason):
            capture.plan_conversation(0, conv, regenerate=True, max_turns=None)
    with pytest.raises(capture.Skip, match="no assistant turn"):
        capture.plan_conversation(0, [{"role": "user", "content": "x"}], regenerate=False, max_turns=None)


def test_capture_offset_takes_a_disjoint_slice(reference_capture, tmp_path, default_model_fp32, tokenizer):
    from eagle_train import capture

    cfg, ref = reference_capture
    over = [*CAPTURE_OVERRIDES, "capture.regenerate=false", "capture.limit=2", "capture.offset=2",
            f"workdir={tmp_path}"]
    second = compose(over)
    out = capture.run(second, model=default_model_fp32, tokenizer=tokenizer)
    m = out["manifests"]["train"]
    assert m["offset"] == 2 and m["planned_ids"] == ref["manifests"]["train"]["planned_ids"][2:4]
    assert capture.is_complete(second)
    assert not capture.is_complete(compose([*over[:-2], "capture.offset=1", f"workdir={tmp_path}"]))
    with pytest.raises(UserError, match="capture.offset=10000 passes over all"):
        capture.run(compose([*over[:-2], "capture.offset=10000", f"workdir={tmp_path / 'x'}"]),
                    model=default_model_fp32, tokenizer=tokenizer)


def test_compiled_regeneration_stores_the_same_answers(tmp_path, tokenizer):
    """capture.compile=true (what auto picks on CUDA, there as CUDA graphs) regenerates through
    compiled decode steps: on a CPU, with a 2-layer target of the default vocabulary, the same
    answers as the eager steps, token for token. The default is eager; auto is eager on a CPU."""
    from test_speculative import tiny_target
    from torch._dynamo.utils import counters

    from eagle_train import capture
    from eagle_train.shards import CaptureDataset

    target = tiny_target(vocab=tokenizer.vocab_size, layers=2)
    over = [*CAPTURE_OVERRIDES, "capture.store_states=false", "capture.max_new_tokens_per_turn=12",
            "capture.aux_layers=[0,1,2]"]
    data = {}
    for flag in ("false", "true"):
        cfg = compose([*over, f"capture.compile={flag}", f"workdir={tmp_path / flag}"])
        assert capture.compile_generation(cfg, torch.device("cpu")) is (flag == "true")
        counters.clear()
        capture.run(cfg, model=target, tokenizer=tokenizer)
        assert (counters["stats"]["unique_graphs"] > 0) is (flag == "true")  # compiled, or eager
        ds = CaptureDataset(cfg.capture_dir)
        data[flag] = [ds[i]["input_ids"].tolist() for i in range(len(ds))]
    assert len(data["true"]) == 4 and data["true"] == data["false"]
    assert capture.compile_generation(compose(over), torch.device("cuda")) is False
    auto = compose([*over, "capture.compile=auto"])
    assert capture.compile_generation(auto, torch.device("cpu")) is False
    assert capture.compile_generation(auto, torch.device("cuda")) is True
    with pytest.raises(UserError, match="capture.compile must be auto, true or false, got 'yes'"):
        capture.compile_generation(compose([*over, "capture.compile=yes"]), torch.device("cpu"))


def test_online_capture_stores_tokens_only_and_online_states_match(reference_capture, tmp_path, monkeypatch,
                                                                   default_model_fp32, tokenizer):
    """capture.store_states=false: the same samples, tokens and masks only; OnlineStates gives a
    training batch the states the stored capture holds. A teacher-forced one loads no target."""
    from eagle_train import capture
    from eagle_train.shards import CaptureDataset, pad_collate
    from eagle_train.train import make_collate

    cfg, _ = reference_capture
    online_cfg = compose([*CAPTURE_OVERRIDES, "capture.store_states=false", f"workdir={tmp_path / 'on'}"])
    capture.run(online_cfg, model=default_model_fp32, tokenizer=tokenizer)
    stored, online = CaptureDataset(cfg.capture_dir), CaptureDataset(online_cfg.capture_dir)
    assert online.manifest["states"] is False and stored.manifest["states"] is True
    assert not online.has_states and online.aux_layer_ids == stored.aux_layer_ids
    assert online.manifest["settings"]["store_states"] is False
    assert len(online) == len(stored)
    for i in range(len(stored)):
        a, b = stored[i], online[i]
        assert "hidden" not in b and "aux" not in b
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    assert online.manifest["totals"]["bytes"] < stored.manifest["totals"]["bytes"] / 50

    states = capture.OnlineStates(default_model_fp32, online.aux_layer_ids, online.dtype)
    batch = states.fill(make_collate(512, keep_aux=True)([online[i] for i in range(len(online))]))
    want = pad_collate([stored[i] for i in range(len(stored))])
    torch.testing.assert_close(batch["hidden"], want["hidden"], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(batch["aux"], want["aux"], atol=1e-3, rtol=1e-4)
    assert not batch["hidden"][~batch["attention_mask"]].any()  # zero on padding, as stored batches

    # A stored capture is not resumed as an online one (nor the reverse).
    with pytest.raises(UserError, match=r"other settings \(store_states: None -> False\)"):
        capture.run(compose([*CAPTURE_OVERRIDES, "capture.store_states=false", f"workdir={cfg.workdir}"]))
    # Teacher-forced and online: tokenization only, no target loaded.
    monkeypatch.setattr("eagle_infer.loader.load_model", lambda *a, **k: pytest.fail("target loaded"))
    tf = compose([*CAPTURE_OVERRIDES, "capture.store_states=false", "capture.regenerate=false",
                  f"workdir={tmp_path / 'tf'}"])
    out = capture.run(tf, tokenizer=tokenizer)
    assert out["manifests"]["train"]["complete"] and out["manifests"]["train"]["totals"]["samples"] == 4



def test_segment_prompts_match_what_capture_plans(tmp_path, tokenizer):
    """scripts/segment_prompts.py (prompts for a capture on a machine without the dataset) keeps
    the training split's order from --offset, the first --max-turns user turns of each
    conversation with every answer blanked, as capture plans them, and leaves out exactly the
    conversations whose first prompt the capture would skip as too long."""
    from eagle_train.capture import Skip, plan_conversation
    from eagle_train.data import load_conversations, render_prompt, split_heldout

    out = tmp_path / "seg.jsonl.xz"  # what device_blobs.sh carries
    subprocess.run([sys.executable, "scripts/segment_prompts.py", "--source", "mtbench_dummy",
                    "--offset", "100", "--limit", "60", "--max-length", "37", "--max-turns", "2",
                    "--out", str(out)], check=True, capture_output=True)
    recs = [json.loads(line) for line in lzma.decompress(out.read_bytes()).decode().splitlines()]
    convs = load_conversations("mtbench_dummy")
    train_idx, _ = split_heldout(list(range(len(convs))), 40, 0)
    expected = []
    for k in range(100, 160):
        try:
            job = plan_conversation(k, convs[train_idx[k]], regenerate=True, max_turns=2)
        except Skip:
            continue
        if len(render_prompt(tokenizer, job.messages[: job.slots[0]])) < 37:
            expected.append((k, job))
    assert 0 < len(expected) < 60  # some prompts are too long at 37 tokens: the filter is exercised
    assert [r["id"] for r in recs] == [k for k, _ in expected]
    assert any(len(job.slots) == 2 for _, job in expected), "no two-turn conversation: the data changed"
    # Read back as the GPU capture reads it (the .xz as data.source), each conversation plans as
    # from the dataset.
    back = load_conversations(out)
    for rec, conv, (k, want) in zip(recs, back, expected):
        got = plan_conversation(k, conv, regenerate=True, max_turns=2)
        assert got.slots == want.slots
        n = got.slots[0]
        assert render_prompt(tokenizer, got.messages[:n]) == render_prompt(tokenizer, want.messages[:n])
        assert [m for m in got.messages if m["role"] == "user"] == \
            [m for m in want.messages if m["role"] == "user"]
        assert all(m["content"] == "." for m in rec["messages"] if m["role"] == "assistant")


def test_segment_prompts_min_length_keeps_the_band_between(tmp_path, tokenizer):
    """--min-length with --max-length keeps only first prompts in [min, max) tokens: the long
    prompts a preset with a lower data.max_length skipped (segment 12's first answers)."""
    from eagle_train.capture import plan_conversation
    from eagle_train.data import load_conversations, render_prompt

    def ids(*extra: str) -> dict[int, int]:  # training index -> tokens of its first prompt
        out = tmp_path / f"seg{len(extra)}.jsonl"
        subprocess.run([sys.executable, "scripts/segment_prompts.py", "--source", "mtbench_dummy",
                        "--offset", "0", "--limit", "80", "--max-length", "60", *extra,
                        "--out", str(out)], check=True, capture_output=True)
        recs = [json.loads(line) for line in out.read_text().splitlines()]
        back = load_conversations(out)
        jobs = [(r["id"], plan_conversation(r["id"], c, regenerate=True, max_turns=1))
                for r, c in zip(recs, back)]
        return {k: len(render_prompt(tokenizer, job.messages[: job.slots[0]])) for k, job in jobs}

    every, band = ids(), ids("--min-length", "37")
    assert band and len(band) < len(every)  # both sides of 37 occur: the filter is exercised
    assert band == {k: n for k, n in every.items() if n >= 37}


def test_vllm_regeneration_on_a_cpu_prefills_whole_prompts(tmp_path, default_model_fp32, tokenizer,
                                                            monkeypatch):
    """capture.backend=vllm on a CPU starts vLLM without chunked prefill (vLLM 0.32 for CPU dies
    on a seeded sampled request prefilled in chunks: "CPU Generator does not use offset"), its
    token budget at least the context; capture.vllm_args' own enable_chunked_prefill is kept,
    and on CUDA nothing is added."""
    from eagle_infer import vllm_client
    from eagle_train.capture import Capturer

    started: list[dict] = []
    monkeypatch.setattr(vllm_client, "VLLMEngine", lambda folder, **kw: started.append(kw))

    def vllm_args(*over: str) -> dict:
        cfg = compose([*CAPTURE_OVERRIDES, "capture.backend=vllm", *over, f"workdir={tmp_path}"])
        cap = Capturer(cfg, None, tokenizer, [], default_model_fp32.config, {2})
        cap.start_vllm(tmp_path, torch.float32)
        return started.pop()

    got = vllm_args()
    assert got["enable_chunked_prefill"] is False and got["max_num_batched_tokens"] >= got["max_model_len"]
    small = "+capture.vllm_args.max_num_batched_tokens=512"
    got = vllm_args(small)  # raised to the context
    assert got["enable_chunked_prefill"] is False
    assert got["max_num_batched_tokens"] == got["max_model_len"] > 512
    got = vllm_args("+capture.vllm_args.enable_chunked_prefill=true", small)
    assert got["enable_chunked_prefill"] is True and got["max_num_batched_tokens"] == 512
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "enable_chunked_prefill" not in vllm_args()
