"""`python -m eagle_train`: resolved configs beside each stage's outputs, paths relative to the
caller's directory, Hydra's run folder under the workdir, and the tokenmap stage from a
capture (FR-Spec maps + the EAGLE-3 draft vocabulary copied beside the capture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from eagle_train.pipeline import prepare_config

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return prepare_config(hydra_compose("config", overrides=overrides))


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "eagle_train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def run_main(args: list[str], monkeypatch) -> int:
    """`python -m eagle_train ARGS` in this process (the same entry point, minus interpreter start-up,
    which dominates on a busy machine); Hydra's logging set-up is left alone."""
    from eagle_train.__main__ import main

    quiet = ["hydra/job_logging=none", "hydra/hydra_logging=none"]
    monkeypatch.setattr(sys, "argv", ["eagle_train", *args, *quiet])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # restored afterwards (main sets it)
    try:
        main()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_capture_stage_saves_resolved_config_beside_outputs(tmp_path, monkeypatch):
    # Nothing to capture (limit 0, no held-out samples): exercises the CLI without the model.
    monkeypatch.chdir(tmp_path)
    rc = run_main(["stage=capture", "data=mtbench_dummy", "capture.limit=0", "eval.num_samples=0",
                   "workdir=rel/run"], monkeypatch)
    assert rc == 0
    workdir = tmp_path / "rel" / "run"  # relative to where the command ran
    saved = yaml.safe_load((workdir / "capture" / "config.yaml").read_text())
    assert saved["workdir"] == str(workdir)
    assert saved["capture_dir"] == str(workdir / "capture")
    # The quick preset (the default) keeps its token maps in the run, never over tokenmaps/.
    assert saved["tokenmap_dir"] == str(workdir / "tokenmaps")
    assert saved["stage"]["name"] == "capture" and saved["data"]["name"] == "mtbench_dummy"
    assert saved["capture"]["limit"] == 0 and "${" not in (workdir / "capture" / "config.yaml").read_text()
    manifest = json.loads((workdir / "capture" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["shards"] == []
    runs = list((workdir / "hydra").glob("capture-*"))
    assert len(runs) == 1 and (runs[0] / ".hydra" / "overrides.yaml").is_file()


def test_bad_override_is_one_error_line(tmp_path):
    r = cli(["capture.no_such_field=1"], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: Could not override 'capture.no_such_field'. To append to your config use "
        "+capture.no_such_field=1"]
    r = cli(["stage=no_such_stage"], cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: In 'config': Could not find 'stage/no_such_stage' Available options")


def test_user_error_in_a_stage_is_one_line_and_status_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = run_main(["stage=capture", "data.source=missing.jsonl", "workdir=w"], monkeypatch)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert [x for x in err.splitlines() if x.startswith("error:")] == [
        f"error: conversation file not found: {tmp_path / 'missing.jsonl'}"]
    assert not (tmp_path / "w" / "capture" / "config.yaml").exists()  # refused before any output


def _synthetic_capture(capture_dir: Path) -> torch.Tensor:
    """A tiny capture written with the real shard writer; returns the assistant token ids."""
    from eagle_train.shards import commit, new_manifest

    capture_dir.mkdir(parents=True)
    manifest = new_manifest("train", model_name="SmolLM2-135M-Instruct", hidden_size=8, vocab_size=49152,
                            num_layers=4, aux_layer_ids=[], store_dtype="bf16", eos_token_ids=[2],
                            settings={})
    g = torch.Generator().manual_seed(0)
    samples, assistant = [], []
    for sid in range(3):
        ids = torch.cat([torch.randint(100, 200, (20,), generator=g), torch.tensor([7, 7, 7, 9, 9, 2])])
        mask = torch.zeros(26, dtype=torch.uint8)
        mask[15:] = 1
        samples.append({"sample_id": sid, "input_ids": ids, "loss_mask": mask, "hidden": torch.randn(26, 8),
                        "aux": None, "messages": None})
        assistant.append(ids[15:])
    commit(capture_dir, manifest, samples, complete=True)
    return torch.cat(assistant)


def test_tokenmap_stage_from_a_capture(tmp_path, monkeypatch, capsys):
    from eagle_train.tokenmap import load_token_map

    tokens = _synthetic_capture(tmp_path / "w" / "capture")
    monkeypatch.chdir(tmp_path)
    rc = run_main(["stage=tokenmap", "workdir=w", "tokenmap_dir=maps", "tokenmap.sizes=[4,16]",
                   "draft.draft_vocab_size=64", "train.init_from=null"], monkeypatch)
    out = capsys.readouterr()
    assert rc == 0, out.err
    folder = tmp_path / "maps" / "SmolLM2-135M-Instruct"
    counts = torch.bincount(tokens, minlength=49152)
    for size in (4, 16):
        ids = load_token_map(folder / f"frspec_{size}.pt", 49152)
        assert len(ids) == size and 2 in ids.tolist()  # EOS forced in
        assert ids[:2].tolist() == [7, 9]  # most frequent first
        assert counts[ids].sum() <= counts.sum()
    from safetensors.torch import load_file

    copied = load_file(str(tmp_path / "w" / "capture" / "d2t_t2d_64.safetensors"))
    mined = load_file(str(folder / "d2t_t2d_64.safetensors"))
    assert torch.equal(copied["d2t"], mined["d2t"]) and torch.equal(copied["t2d"], mined["t2d"])
    d2t, t2d = copied["d2t"], copied["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (64,) and t2d.dtype == torch.bool and t2d.sum() == 64
    target = torch.arange(64) + d2t
    assert t2d[target].all() and t2d[tokens].all()  # every assistant token is in the draft vocab
    assert (folder / "config.yaml").is_file() and (folder / "summary.json").is_file()
    assert "frspec 4" in out.out + out.err  # coverage printed

    # The pipeline now sees the tokenmap stage as complete (and would skip it).
    from eagle_train.pipeline import tokenmap_is_complete

    cfg = compose(["stage=tokenmap", f"workdir={tmp_path / 'w'}", f"tokenmap_dir={tmp_path / 'maps'}",
                   "tokenmap.sizes=[4,16]", "draft.draft_vocab_size=64", "train.init_from=null"])
    assert tokenmap_is_complete(cfg)
    cfg.tokenmap.sizes = [4, 32]
    assert not tokenmap_is_complete(cfg)


def test_quick_preset_warm_starts_from_the_shipped_head_only_for_its_target(tmp_path):
    from eagle_infer.default_model import default_head_path

    for kind in ("eagle3", "eagle2"):
        cfg = compose([f"workdir={tmp_path}", f"draft={kind}"])  # quick is the default preset
        assert cfg.train.init_from == str(default_head_path(kind))
    assert compose([f"workdir={tmp_path}", "train.init_from=null"]).train.init_from is None
    other = tmp_path / "other-model"
    other.mkdir()
    cfg = compose([f"workdir={tmp_path}", f"model.path={other}", "model.name=other"])
    assert cfg.train.init_from is None  # no shipped head for another target: from scratch
    assert compose([f"workdir={tmp_path}", "preset=reference"]).train.init_from is None


def test_another_target_is_named_after_its_folder(tmp_path):
    """model.path to another target and no model.name: its runs, token maps and a published head's
    card carry the folder's name, not the embedded default's; model.name still overrides."""
    from eagle_train.export import target_hub_id

    other = tmp_path / "gemma-3-270m-it"
    other.mkdir()
    cfg = compose([f"model.path={other}"])
    assert cfg.model.name == "gemma-3-270m-it" and "/runs/gemma-3-270m-it/" in cfg.workdir
    assert target_hub_id(cfg) == "gemma-3-270m-it"
    assert compose([f"model.path={other}", "model.name=google/gemma-3-270m-it"]).model.name == \
        "google/gemma-3-270m-it"
    default = compose([])
    assert default.model.name == "SmolLM2-135M-Instruct" and "/runs/SmolLM2-135M-Instruct/" in default.workdir
    assert target_hub_id(default) == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_warm_started_tokenmap_keeps_the_heads_own_draft_vocab(tmp_path, monkeypatch, capsys):
    """The warm-start head's lm_head rows mean its own draft tokens: the tokenmap stage must hand
    train its d2t/t2d, not the vocabulary it mines (which here differs: three samples' tokens)."""
    from safetensors.torch import load_file

    from eagle_infer.default_model import default_head_path
    from eagle_infer.errors import UserError
    from eagle_train.pipeline import run_stage, tokenmap_is_complete

    _synthetic_capture(tmp_path / "w" / "capture")
    head = load_file(str(default_head_path("eagle3") / "model.safetensors"))
    args = [f"workdir={tmp_path / 'w'}", f"tokenmap_dir={tmp_path / 'maps'}", "tokenmap.sizes=[16]"]
    cfg = compose(["stage=tokenmap", *args])
    run_stage("tokenmap", cfg)
    used = load_file(str(tmp_path / "w" / "capture" / "d2t_t2d_8192.safetensors"))
    mined = load_file(str(tmp_path / "maps" / "SmolLM2-135M-Instruct" / "d2t_t2d_8192.safetensors"))
    assert torch.equal(used["d2t"], head["d2t"].long()) and torch.equal(used["t2d"], head["t2d"].bool())
    assert not torch.equal(mined["d2t"], used["d2t"])
    rec = json.loads((tmp_path / "w" / "capture" / "tokenmap.json").read_text())
    assert rec["draft_vocab_from"] == str(default_head_path("eagle3"))
    assert "warm-start head's own" in capsys.readouterr().err
    assert tokenmap_is_complete(cfg)
    # From scratch, the same outputs are not complete: the mined vocabulary must replace the head's.
    assert not tokenmap_is_complete(compose(["stage=tokenmap", *args, "train.init_from=null"]))
    # Another draft vocabulary size cannot warm-start from an 8192-token head.
    with pytest.raises(UserError, match=r"drafts over 8192 tokens .*train.init_from=null"):
        run_stage("tokenmap", compose(["stage=tokenmap", *args, "draft.draft_vocab_size=64"]))


def test_tokenmap_stage_without_capture_names_the_missing_capture(tmp_path):
    from eagle_infer.errors import UserError
    from eagle_train.pipeline import run_stage

    cfg = compose(["stage=tokenmap", f"workdir={tmp_path / 'w'}", f"tokenmap_dir={tmp_path / 'maps'}"])
    with pytest.raises(UserError, match=r"capture directory not found: .*w/capture \(run stage=capture"):
        run_stage("tokenmap", cfg)


@pytest.mark.parametrize("stage", ["train", "eval"])
def test_later_stage_modules_are_found_or_named(stage, tmp_path):
    from eagle_infer.errors import UserError
    from eagle_train.pipeline import stage_module

    try:
        mod = stage_module(stage)
    except UserError as e:
        assert "is missing" in str(e)
    else:
        assert callable(mod.run)


@pytest.mark.slow
def test_installed_wheel_finds_conf_and_reference_heads(tmp_path):
    """A wheel has no repository root: conf/, heads/ and the CPU kernel's C++ source must travel
    inside it, and an installed copy (here: outside any checkout) must compose the config and
    find the default head."""
    import shutil

    # Built from a fresh copy of what the wheel is made of: setuptools reuses a build/ folder
    # left in the checkout, which could still hold files the current pyproject would not ship.
    src, wheels, site = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        src.mkdir(exist_ok=True)
        shutil.copy(REPO / name, src / name)
    for name in ("eagle_infer", "eagle_train", "conf", "heads"):
        shutil.copytree(REPO / name, src / name, ignore=junk)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(wheels)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("eagle_spec-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    env.pop("HYDRA_FULL_ERROR", None)
    run = tmp_path / "elsewhere"
    run.mkdir()
    probe = ("import eagle_train.__main__ as m, json; "
             "from eagle_infer.default_model import default_head_path as h; "
             "from eagle_infer.kernels.avx2_linear import SOURCE; "
             "print(json.dumps([m.__file__, m.CONF_DIR, str(h('eagle3')), str(h('eagle2')), str(SOURCE)]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=run, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    module, conf, head3, head2, kernel = json.loads(out.stdout)
    for p in (module, conf, head3, head2, kernel):
        assert Path(p).resolve().is_relative_to(site.resolve()), p
    assert Path(kernel).is_file()
    for head in (head3, head2):
        assert (Path(head) / "model.safetensors").is_file() and (Path(head) / "config.json").is_file()
    job = subprocess.run([sys.executable, "-m", "eagle_train", "--cfg", "job", "stage=train", "draft=eagle2"],
                         cwd=run, env=env, capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    cfg = yaml.safe_load(job.stdout)
    assert cfg["draft"]["name"] == "eagle2" and cfg["stage"]["name"] == "train"


def test_pipeline_bench_measures_plain_vs_speculative(tmp_path, capsys):
    """The end-of-pipeline bench: speculative output = plain output (fp32 greedy), tau >= 1, a
    speedup and the CPU in bench.json and in the closing summary; 0 prompts turns it off."""
    from eagle_infer.default_model import default_head_path
    from eagle_train.pipeline import run_bench, summarize

    head = default_head_path("eagle3")
    args = [f"workdir={tmp_path}", f"head_dir={head}", "stage.bench.num_prompts=1",
            "stage.bench.max_new_tokens=6", "stage.bench.dtype=fp32", "stage.bench.compile=false"]
    cfg = compose(args)
    report = run_bench(cfg)
    assert report is not None and report["greedy_identical"] is True
    assert report["acceptance_length"] >= 1.0 and report["speedup"] > 0 and report["tree"] == [2, 4, 4]
    assert json.loads((tmp_path / "bench.json").read_text()) == report
    assert run_bench(cfg) == report  # a rerun finds it measured: skipped
    assert "already measured" in capsys.readouterr().err
    summarize(cfg, report)
    err = capsys.readouterr().err
    assert "warm-started from" in err and f"speedup {report['speedup']}x" in err and report["cpu"] in err
    assert run_bench(compose([*args, "stage.bench.num_prompts=0"])) is None


def test_the_pipeline_runs_end_to_end_on_a_gemma3_target(tmp_path, capsys):
    """Another architecture from one config: a tiny Gemma 3 (sliding layers, sandwich norms) with the
    default's tokenizer through capture, tokenmap, train, eval and the bench, its outputs under its
    folder's name, the head sized for it, speculative output = plain output (fp32 greedy)."""
    from script_module import load_script
    from test_train import reset_accelerate

    from eagle_train.pipeline import run_pipeline

    reset_accelerate()  # another test's in-process training set its own mixed precision

    sm = load_script("shape_model")
    sm.SHAPES["tiny-gemma3"] = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=32, vocab_size=49152, sliding_window=16,
                                    query_pre_attn_scalar=32, tie_word_embeddings=True,
                                    max_position_embeddings=2048)
    target = sm.write_target("tiny-gemma3", tmp_path / "tiny-gemma3")
    cfg = compose([f"workdir={tmp_path / 'run'}", f"model.path={target}", "capture.limit=3", "data.heldout=6",
                   "capture.max_new_tokens_per_turn=24", "eval.num_samples=2", "train.epochs=1",
                   "stage.bench.num_prompts=1", "stage.bench.max_new_tokens=8", "stage.bench.dtype=fp32",
                   "stage.bench.compile=false"])
    assert cfg.train.init_from is None and cfg.model.name == "tiny-gemma3"
    try:
        done = run_pipeline(cfg)
    finally:
        reset_accelerate()  # nor does this one's stay for the next
    assert set(done) == {"capture", "tokenmap", "train", "eval", "bench"}
    head = json.loads((Path(cfg.head_dir) / "config.json").read_text())
    assert head["hidden_size"] == 64 and head["head_dim"] == 32 and head["vocab_size"] == 49152
    assert (tmp_path / "run" / "tokenmaps" / "tiny-gemma3").is_dir()
    bench = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert bench["greedy_identical"] is True and bench["acceptance_length"] >= 1.0
    assert "trained from scratch" in capsys.readouterr().err
