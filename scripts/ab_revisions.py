"""The bench at two code revisions, run alternately in fresh processes, medians per revision: how a
kernel change is measured on a VM whose speed drifts by 20-25% within minutes (two bench runs
minutes apart mislead; rounds that alternate share the drift, and the order flips every round).
Each revision runs from a git worktree ("WORKTREE" = the working tree as it is) with its own
torch extensions directory, so neither rebuilds the other's C++ ops; Inductor's caches are
shared (they key on the code).

    python scripts/ab_revisions.py --revs HEAD WORKTREE --rounds 3 --json results/ab.json -- \\
        --no-hf --dtype bf16 --num-prompts 5 --max-new-tokens 128 \\
        --sweep --sweep-steps 3 --sweep-topk 4 --sweep-draft-tokens 4 8 16

Everything after `--` goes to `python -m eagle_infer.bench` (add `--sweep ...` for trees).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checkout(rev: str, where: Path) -> Path:
    """A directory holding `rev`'s code: the repository itself for WORKTREE, else a detached git
    worktree under `where`."""
    if rev == "WORKTREE":
        return ROOT
    path = where / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev],
                   check=True, capture_output=True)
    return path


def describe(rev: str) -> str:
    """The commit a revision name stands for (WORKTREE: HEAD's, "+changes" if the tree differs)."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True).stdout.strip()

    if rev != "WORKTREE":
        return git("rev-parse", "--short", rev) or rev
    return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain") else "")


def bench_once(code: Path, ext_dir: Path, bench_args: list[str], out: Path) -> dict:
    """One bench process from `code` (its eagle_infer first on the path); returns its JSON."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir), "PYTHONPATH": str(code)}
    cmd = [sys.executable, "-m", "eagle_infer.bench", *bench_args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench at {code} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def summary(run: dict) -> dict:
    """The numbers compared: plain tokens/s, and per tree (and NGRAM's chain) tokens/s, τ and
    verify / plain step."""
    trees = {}
    # a sweep's rows, or the one tree a plain bench run reports with the same keys at its top level
    for row in run.get("sweep") or ([run] if run.get("tree") else []):
        t = row["tree"]
        trees[f"{t['num_steps']}/{t['eagle_topk']}/{t['num_draft_tokens']}"] = {
            "tokens_per_s": row["tokens_per_s"], "tau": row["acceptance_length"],
            "verify_vs_plain_step": row.get("verify_vs_plain_step")}
    if run.get("ngram"):  # --ngram K: prompt lookup without a head, under its method's name
        ngram = run["ngram"]
        trees[ngram["method"]] = {"tokens_per_s": ngram["tokens_per_s"], "tau": ngram["acceptance_length"],
                                  "verify_vs_plain_step": None}
    return {"plain_tokens_per_s": run["plain_tokens_per_s"], "trees": trees,
            "mem_read_bandwidth_gb_s": run.get("mem_read_bandwidth_gb_s")}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revs", nargs=2, default=["HEAD", "WORKTREE"], metavar=("A", "B"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if "--json" in bench_args:
        ap.error("--json goes before `--` (the bench's own JSON files are temporary)")
    with tempfile.TemporaryDirectory(prefix="ab_revisions_") as tmp:
        tmp_path = Path(tmp)
        codes = {rev: checkout(rev, tmp_path) for rev in args.revs}
        runs: dict[str, list[dict]] = {rev: [] for rev in args.revs}
        try:
            for r in range(args.rounds):
                # the order flips every round: the first of two back-to-back processes was ahead
                # in 9 of 11 pairs at one tree, whichever revision it ran (docs/measurements.md,
                # "k in chunks")
                for rev in args.revs if r % 2 == 0 else args.revs[::-1]:
                    i = args.revs.index(rev)
                    ext = Path(tempfile.gettempdir()) / f"ab_revisions_ext_{i}"
                    result = summary(bench_once(codes[rev], ext, bench_args, tmp_path / f"{i}_{r}.json"))
                    runs[rev].append(result)
                    trees = ", ".join(f"{k} {v['tokens_per_s']:.1f} (verify {v['verify_vs_plain_step']})"
                                      for k, v in result["trees"].items())
                    print(f"round {r} {rev}: plain {result['plain_tokens_per_s']:.1f} tok/s, {trees}",
                          flush=True)
        finally:
            for code in codes.values():
                if code != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(code)],
                                   capture_output=True)
    out = {"revs": {rev: describe(rev) for rev in args.revs},
           "bench_args": bench_args, "rounds": args.rounds, "runs": runs, "medians": {}}
    for rev, rs in runs.items():
        plain = statistics.median(x["plain_tokens_per_s"] for x in rs)
        med = {"plain_tokens_per_s": round(plain, 2), "trees": {}}
        for name in rs[0]["trees"]:
            med["trees"][name] = {
                key: round(statistics.median(x["trees"][name][key] for x in rs), 3)
                if rs[0]["trees"][name][key] is not None else None
                for key in ("tokens_per_s", "tau", "verify_vs_plain_step")}
        out["medians"][rev] = med
        trees = ", ".join(f"{k} {v['tokens_per_s']:.1f} (verify {v['verify_vs_plain_step']})"
                          for k, v in med["trees"].items())
        print(f"{rev} medians: plain {med['plain_tokens_per_s']:.1f} tok/s, {trees}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
