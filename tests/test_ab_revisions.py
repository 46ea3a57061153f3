"""scripts/ab_revisions.py: two revisions' bench runs alternate, each from its own checkout, and the
medians per revision are what it reports; the worktrees it made are gone afterwards."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from script_module import load_script

ROOT = Path(__file__).resolve().parent.parent


def worktrees() -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True)
    return out.stdout.splitlines()


def test_alternates_checkouts_and_reports_medians(tmp_path, monkeypatch):
    ab = load_script("ab_revisions")
    calls = []
    speeds = iter([70.0, 80.0, 60.0, 90.0, 75.0, 100.0])  # HEAD, WORKTREE; WORKTREE, HEAD; ...

    def fake_bench(code: Path, ext_dir: Path, bench_args: list[str], out: Path) -> dict:
        calls.append((code, ext_dir, bench_args))
        # the HEAD checkout holds HEAD's files, not the working tree's
        assert (code / "eagle_infer" / "bench.py").is_file()
        plain = next(speeds)
        return {"plain_tokens_per_s": plain, "mem_read_bandwidth_gb_s": 30.0, "sweep": [
            {"tree": {"num_steps": 3, "eagle_topk": 4, "num_draft_tokens": 8}, "tokens_per_s": plain * 1.2,
             "acceptance_length": 1.9, "verify_vs_plain_step": 1.2}]}

    monkeypatch.setattr(ab, "bench_once", fake_bench)
    before = worktrees()
    out = ab.main(["--revs", "HEAD", "WORKTREE", "--rounds", "3", "--json", str(tmp_path / "ab.json"),
                   "--", "--no-hf", "--num-prompts", "1"])
    assert worktrees() == before  # the HEAD worktree was removed
    assert [c[2] for c in calls] == [["--no-hf", "--num-prompts", "1"]] * 6
    head_code, tree_code = calls[0][0], calls[1][0]
    assert tree_code == ROOT and head_code != ROOT
    # the order flips every round, so neither revision is always the first of a pair
    assert [c[0] for c in calls[2:]] == [tree_code, head_code, head_code, tree_code]
    assert calls[0][1] != calls[1][1]  # an extensions directory each: neither rebuilds the other's ops
    assert out["medians"]["HEAD"]["plain_tokens_per_s"] == 75.0  # 70, 90, 75
    assert out["medians"]["WORKTREE"]["plain_tokens_per_s"] == 80.0  # 80, 60, 100
    assert out["medians"]["WORKTREE"]["trees"]["3/4/8"]["tokens_per_s"] == 96.0
    assert json.loads((tmp_path / "ab.json").read_text())["medians"] == out["medians"]
    assert len(out["revs"]["HEAD"]) >= 7  # the commit it measured, not the moving name
    assert out["revs"]["WORKTREE"].startswith(out["revs"]["HEAD"])
