"""`python -m eagle_train stage=publish`: the Hub-ready folder (weights, config, card, JSON, plots),
a model card whose numbers are eval.json's and the bench JSON's, nothing sent without a token,
and with one the real huggingface_hub client creating the repo and committing every file of the
folder, against a recording fake of the Hub's HTTP API on loopback (the calls it makes:
/api/repos/create, /api/validate-yaml, /api/models/<repo>/preupload/main and the NDJSON commit
/api/models/<repo>/commit/main, files base64-encoded when preupload answers "regular")."""

from __future__ import annotations

import base64
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml
from test_head_formats import assert_same, load, random_head

from eagle_infer.heads import save_head

REPO_ID = "acme/tiny-eagle3"
EVAL = {"acceptance_length": 1.6354321, "mean_accepted_drafts": 0.6354321,
        "accept_rate_per_position": [0.41234, 0.35678, 0.30001], "top1_per_position": [0.41234, 0.3, 0.28765],
        "num_start_positions": 400, "num_samples": 12, "num_tokens": 900, "unroll": 3,
        "capture": "/data/cap/heldout", "model": "tiny", "kind": "eagle3",
        "fingerprint": {"capture": "/data/cap", "num_samples": 12, "unroll": 3}}
BENCH = {"plain_tokens_per_s": 8.296, "tokens_per_s": 5.24, "speedup_vs_plain": 0.632,
         "acceptance_length": 1.43, "greedy_identical": True, "draft": "head",
         "settings": {"num_prompts": 5, "max_new_tokens": 128, "dtype": "fp32", "ignore_eos": True},
         "machine": {"device": "cpu", "cpu": "AMD EPYC", "torch_threads": 1, "dtype": "fp32"},
         "tree": {"num_steps": 7, "eagle_topk": 1, "num_draft_tokens": 8}}
SUMMARY = {"finished": True, "kind": "eagle3", "step": 40, "samples": 77, "tokens_total": 12345,
           "epochs_done": 1.0, "num_params": 4242, "final_loss": 3.21}
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models("llama")[0]


@pytest.fixture
def trained(target, tmp_path):
    """A head folder as the train and eval stages leave it, plus a bench JSON beside it."""
    head = random_head(target, "eagle3")
    d = save_head(head, tmp_path / "head", dtype=torch.float32)
    (d / "eval.json").write_text(json.dumps(EVAL))
    (d / "train_summary.json").write_text(json.dumps(SUMMARY))
    (d / "train_config.yaml").write_text(yaml.safe_dump({
        "data": {"name": "mtbench_dummy", "source": "mtbench_dummy"},
        "capture": {"regenerate": True, "temperature": 0.7, "max_new_tokens_per_turn": 96},
        "train": {"lr": 3e-4, "batch_size": 4, "init_from": None}}))
    (d / "acceptance.png").write_bytes(PNG)
    (d / "train_loss.png").write_bytes(PNG + b"loss")
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    return head, d


class FakeHub:
    """The Hub endpoints create_repo + upload_folder use, recording every request (loopback only)."""

    def __init__(self):
        self.calls: list[tuple[str, str, dict, bytes]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, obj, code=200):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.calls.append(("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                host = f"http://{self.headers['Host']}"
                if self.path == "/api/repos/create":
                    req = json.loads(body)
                    self._reply({"url": f"{host}/{req['organization']}/{req['name']}", "name": req["name"]})
                elif self.path == "/api/validate-yaml":
                    self._reply({})
                elif self.path.endswith("/preupload/main"):
                    files = json.loads(body)["files"]
                    self._reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                           for f in files]})
                elif self.path.endswith("/commit/main"):
                    self._reply({"commitUrl": f"{host}/{REPO_ID}/commit/{'a' * 40}", "commitOid": "a" * 40,
                                 "pullRequestUrl": None})
                else:
                    self._reply({"error": f"unexpected {self.path}"}, 404)

            def do_GET(self):
                hub.calls.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}, b""))
                self._reply({"error": f"unexpected {self.path}"}, 404)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def committed_files(self) -> dict[str, bytes]:
        commits = [c for c in self.calls if c[1].endswith("/commit/main")]
        assert len(commits) == 1, [c[1] for c in self.calls]
        out = {}
        for line in commits[0][3].decode().splitlines():
            op = json.loads(line)
            if op["key"] == "file":
                assert op["value"]["encoding"] == "base64"
                out[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
        return out


def publish(args: list[str], tmp_path: Path, tiny_model_dir, monkeypatch) -> int:
    from eagle_train.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [
        "eagle_train", "stage=publish", f"publish.repo_id={REPO_ID}", "publish.head=head",
        "publish.bench_json=bench.json", "publish.out=out", "publish.base_model=tiny/llama",
        f"model.path={tiny_model_dir('llama')}", "model.name=tiny", f"workdir={tmp_path}/wd",
        "hydra/job_logging=none", "hydra/hydra_logging=none", *args])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def card_numbers(card: str) -> dict:
    tau = float(re.search(r"τ = ([0-9.]+)", card).group(1))
    rows = {m.group(1): [float(x) for x in m.group(2).split(" | ")]
            for m in re.finditer(r"^\| (acceptance[^|]*|top-1 match) \| (.*) \|$", card, re.M)}
    speed = re.search(r"\*\*([0-9.]+)x\*\* plain decoding: ([0-9.]+) vs ([0-9.]+) tokens/s, "
                      r"runtime τ ([0-9.]+)", card)
    return {"tau": tau, "acc": rows["acceptance (previous ones accepted)"], "top1": rows["top-1 match"],
            "speed": [float(x) for x in speed.groups()]}


def test_publish_without_token_writes_the_folder_and_uploads_nothing(trained, target, tmp_path,
                                                                     tiny_model_dir, monkeypatch, capsys):
    head, _ = trained
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert publish([], tmp_path, tiny_model_dir, monkeypatch) == 0
    assert hub.calls == []
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["README.md", "acceptance.png", "bench.json", "config.json", "eval.json",
                     "model.safetensors", "train_loss.png", "train_summary.json"]
    assert "would create acme/tiny-eagle3 (public) and upload 8 files" in capsys.readouterr().err
    assert_same(head, load(out, target), target)  # the weights are the head's

    card = (out / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == "tiny/llama" and meta["license"] == "apache-2.0"
    assert meta["library_name"] == "sglang"
    assert {"eagle3", "speculative-decoding"} <= set(meta["tags"])
    nums = card_numbers(card)
    assert nums["tau"] == round(EVAL["acceptance_length"], 4)
    assert nums["acc"] == [round(x, 4) for x in EVAL["accept_rate_per_position"]]
    assert nums["top1"] == [round(x, 4) for x in EVAL["top1_per_position"]]
    assert nums["speed"] == [BENCH["speedup_vs_plain"], BENCH["tokens_per_s"], BENCH["plain_tokens_per_s"],
                             BENCH["acceptance_length"]]
    assert "capture_dir=/data/cap" in card and "python -m eagle_infer.bench --num-prompts 5" in card
    assert "12345" in card and "mtbench_dummy" in card  # training tokens and data
    for serve in ("sglang.launch_server", "--speculative-algorithm EAGLE3", "vllm serve tiny/llama",
                  '"method": "eagle3"', "eagle_infer.server"):
        assert serve in card


def test_publish_with_token_commits_every_file(trained, tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token")
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert publish(["publish.private=true", "publish.format=speculators"], tmp_path, tiny_model_dir,
                       monkeypatch) == 0
    paths = [c[1] for c in hub.calls]
    assert paths[0] == "/api/repos/create"
    create = json.loads(hub.calls[0][3])
    assert [create[k] for k in ("organization", "name", "visibility")] == ["acme", "tiny-eagle3", "private"]
    assert all(c[2].get("authorization") == "Bearer hf_fake_token" for c in hub.calls)
    committed = hub.committed_files()
    out = tmp_path / "out"
    local = {p.name: p.read_bytes() for p in out.iterdir()}
    assert committed == local  # every file of the folder, byte for byte
    assert json.loads(local["config.json"])["speculators_model_type"] == "eagle3"
    card = local["README.md"].decode()
    assert yaml.safe_load(card.split("---")[1])["library_name"] == "vllm"
    assert f"vllm serve {REPO_ID}" in card


def test_publish_refuses_a_bad_repo_id_and_a_foreign_folder(trained, tmp_path, tiny_model_dir, monkeypatch,
                                                            capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert publish(["publish.repo_id=noslash"], tmp_path, tiny_model_dir, monkeypatch) == 2
    assert "give the Hub repository as ORG/NAME" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    assert publish([], tmp_path, tiny_model_dir, monkeypatch) == 2
    assert "was not written by stage=publish" in capsys.readouterr().err
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"


def test_publish_defaults_to_the_pipelines_own_head_eval_and_bench(target, tmp_path, tiny_model_dir,
                                                                   monkeypatch):
    """No publish.head: the pipeline's head_dir, with eval.json and acceptance.png from eval_dir and
    the pipeline's bench.json (its own shape: speedup, spec_tokens_per_s, tree as a list)."""
    from eagle_train.__main__ import main

    wd = tmp_path / "wd"
    save_head(random_head(target, "eagle3"), wd / "eagle3", dtype=torch.float32)
    (wd / "eval-eagle3").mkdir()
    (wd / "eval-eagle3" / "eval.json").write_text(json.dumps(EVAL))
    (wd / "eval-eagle3" / "acceptance.png").write_bytes(PNG)
    bench = {"head": str(wd / "eagle3"), "prompts": "MT-bench first turns 1..3", "max_new_tokens": 64,
             "tree": [3, 4, 4], "dtype": "fp32", "device": "cpu", "cpu": "Xeon", "threads": 1,
             "plain_tokens_per_s": 8.1, "spec_tokens_per_s": 11.8, "speedup": 1.457,
             "acceptance_length": 1.47, "greedy_identical": True}
    (wd / "bench.json").write_text(json.dumps(bench))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(sys, "argv", [
        "eagle_train", "stage=publish", f"publish.repo_id={REPO_ID}", "publish.base_model=tiny/llama",
        f"model.path={tiny_model_dir('llama')}", "model.name=tiny", f"workdir={wd}",
        "hydra/job_logging=none", "hydra/hydra_logging=none"])
    main()
    out = wd / "publish" / "tiny-eagle3"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "acceptance.png", "bench.json",
                                                     "config.json", "eval.json", "model.safetensors"]
    card = (out / "README.md").read_text()
    assert "3 MT-bench prompts x 64 new tokens" in card
    nums = card_numbers(card)
    assert nums["tau"] == round(EVAL["acceptance_length"], 4)
    assert nums["speed"] == [1.457, 11.8, 8.1, 1.47]
