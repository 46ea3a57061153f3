"""scripts/magpie_prompts.py: user prompts sampled from the target's own chat template."""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

from script_module import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "magpie_prompts.py"


def _module():
    return load_script("magpie_prompts")


def test_pre_query_template_is_where_a_real_prompt_puts_its_user_message(tokenizer):
    from eagle_train.data import render_prompt

    mod = _module()
    prefix = mod.pre_query_ids(tokenizer)
    text = tokenizer.decode(prefix)
    assert text.endswith("<|im_start|>user\n") and text.startswith("<|im_start|>system\n")
    real = render_prompt(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    assert real[: len(prefix)] == prefix and len(real) > len(prefix)

    assert mod.normalise("  What's   UP?! ") == mod.normalise("what s up") == "what s up"
    assert mod.distinct_bigrams(["a b c", "a b c"]) == 0.5
    assert mod.distinct_bigrams(["a b c", "c d e"]) == 1.0


ARGS = ["--n", "6", "--batch", "3", "--max-new-tokens", "48", "--min-chars", "1"]


def _main(out: Path, monkeypatch, capsys) -> str:
    """The script in this process (what needs no kill); returns its stderr."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *ARGS, "--out", str(out)])
    _module().main()
    return capsys.readouterr().err


def _run(out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The script in a subprocess, for a run the test kills."""
    return subprocess.run([sys.executable, str(SCRIPT), *ARGS, "--out", str(out)], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "EAGLE_TEST_THREADS": "1", **(env or {})})


def test_prompts_written_deduplicated_and_a_killed_run_resumes_to_the_same_file(tmp_path, monkeypatch,
                                                                                 capsys):
    from eagle_train.data import load_conversations

    whole = tmp_path / "whole.jsonl.xz"
    _main(whole, monkeypatch, capsys)
    records = [json.loads(line) for line in lzma.decompress(whole.read_bytes()).decode().splitlines()]
    assert len(records) == 6
    assert [r["id"] for r in records] == list(range(10_000_000, 10_000_006))
    texts = [r["messages"][0]["content"] for r in records]
    assert all(t.strip() == t and t for t in texts) and len(set(texts)) == 6
    assert all(r["messages"][1] == {"role": "assistant", "content": "."} for r in records)
    summary = json.loads(Path(f"{whole}.summary.json").read_text())
    assert summary["n"] == 6 and summary["sampled"] >= 6 and summary["sampled"] % 3 == 0
    assert summary["kept"] == 6
    assert summary["unfinished"] + summary["short"] + summary["duplicate"] <= summary["sampled"] - 6
    convs = load_conversations(str(whole))  # what stage=capture and gpu_grow.sh read
    assert [c[0]["content"] for c in convs] == texts

    # Killed after the second batch's prompts were appended, before its counts were saved: the
    # rerun drops that batch's lines and draws it again with the same seeds.
    cut = tmp_path / "cut.jsonl.xz"
    r = _run(cut, {"EAGLE_TEST_KILL_AT": "atomic_write:cut.jsonl.xz.partial.json:2"})
    assert r.returncode != 0 and "SIGKILL at atomic_write" in r.stderr
    assert not cut.exists() and cut.with_name(cut.name + ".partial.json").exists()
    assert "resuming at" in _main(cut, monkeypatch, capsys)
    assert lzma.decompress(cut.read_bytes()) == lzma.decompress(whole.read_bytes())
    assert not cut.with_name(cut.name + ".partial.jsonl").exists()
    assert "nothing to do" in _main(cut, monkeypatch, capsys)  # a finished file is left alone
