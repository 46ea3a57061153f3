"""Offline batches against vLLM's: the same OpenAI batch file (MT-bench's first turns as chat
requests, greedy, EOS ignored) through `python -m eagle_infer.run_batch` (EAGLE-3 by default, and
plain) and `vllm run-batch` (plain, and with our EAGLE-3 head), each a fresh process as a user runs
it, in one sitting.

    python scripts/bench_run_batch.py --num-prompts 80 --max-tokens 128 --json results/run_batch.json

Per run: `wall_s` (the whole command: start-up, compile and the batch), `batch_s` (the batch alone:
ours from its summary, vLLM's from its progress bar, whole seconds), tokens (completion tokens in
the results), tokens/s of each, and ours' acceptance length. vLLM runs in its own environment
(scripts/vllm_env.sh) on every core (eagle_infer.vllm_client.vllm_cpu_env).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

MODES = ("ours", "ours-plain", "vllm", "vllm-spec")


def batch_file(path: Path, questions: list[str], model: str, max_tokens: int) -> None:
    with open(path, "w") as f:
        for i, q in enumerate(questions):
            body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")


def command(mode: str, src: Path, out: Path, model: str, head: Path, k: int,
            ours_flags: list[str]) -> tuple[list[str], dict]:
    if mode.startswith("ours"):
        cmd = [sys.executable, "-m", "eagle_infer.run_batch", "-i", str(src), "-o", str(out),
               "--model-path", model, *ours_flags]
        return cmd + (["--speculative-algorithm", "NONE"] if mode == "ours-plain" else []), dict(os.environ)
    from bench_vllm import head_method

    from eagle_infer.vllm_client import vllm_cpu_env, vllm_python

    python = vllm_python()
    cmd = [python, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(out),
           "--model", model, "--dtype", "bfloat16", "--max-model-len", "2048",
           "--gpu-memory-utilization", "0.3"]  # of the RAM on a CPU: vLLM refuses a start without it free
    if mode == "vllm-spec":
        spec = {"method": head_method(head), "model": str(head), "num_speculative_tokens": k}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd, {**os.environ, **vllm_cpu_env(python)}  # (it returns only what it adds)


def batch_seconds(mode: str, log: str) -> float | None:
    """The batch's own seconds: our summary's, or vLLM's progress bar's last elapsed time."""
    if mode.startswith("ours"):
        m = re.search(r"requests in ([\d.]+) s", log)
        return float(m.group(1)) if m else None
    bars = re.findall(r"Running batch:\s+100%.*?\[(\d+):(\d+)(?::(\d+))?<", log)
    if not bars:
        return None
    a, b, c = bars[-1]
    return float(int(a) * 60 + int(b)) if not c else float(int(a) * 3600 + int(b) * 60 + int(c))


def run(mode: str, src: Path, workdir: Path, model: str, head: Path, k: int, ours_flags: list[str]) -> dict:
    out = workdir / f"{mode}.jsonl"
    out.unlink(missing_ok=True)
    cmd, env = command(mode, src, out, model, head, k, ours_flags)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                          timeout=1200)  # vLLM hangs when its engine core fails
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    results = [json.loads(line) for line in out.read_text().splitlines()]
    ok = [r for r in results if r["response"] and r["response"]["status_code"] == 200]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in ok)
    secs = batch_seconds(mode, proc.stdout)
    row = {"requests": len(results), "ok": len(ok), "tokens": tokens, "wall_s": round(wall, 1),
           "tokens_per_wall_s": round(tokens / wall, 1), "batch_s": secs,
           "tokens_per_batch_s": round(tokens / secs, 1) if secs else None}
    m = re.search(r"acceptance length ([\d.]+)", proc.stdout)
    if m:
        row["acceptance_length"] = float(m.group(1))
    print(f"{mode}: {row}", flush=True)
    return row


def main() -> None:
    from bench_vllm import cpu_info

    from eagle_infer.bench import default_prompts_path
    from eagle_infer.default_model import ensure_default_model
    from eagle_infer.server import DEFAULT_HEAD

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--num-speculative-tokens", type=int, default=3, help="vLLM's chain with our head")
    ap.add_argument("--ours-flags", default="", help="more flags of ours, e.g. '--max-running-requests 32'")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = str(ensure_default_model())
    questions = [json.loads(line)["turns"][0] for line in default_prompts_path().read_text().splitlines()
                 if line.strip()][:args.num_prompts]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "batch.jsonl"
        batch_file(src, questions, model, args.max_tokens)
        runs = {mode: run(mode, src, Path(tmp), model, DEFAULT_HEAD, args.num_speculative_tokens,
                          args.ours_flags.split()) for mode in args.modes}
    report = {"machine": cpu_info(), "num_prompts": len(questions), "max_tokens": args.max_tokens,
              "command": " ".join(sys.argv), "runs": runs}
    for ours in ("ours", "ours-plain"):  # each of ours against each other run
        for other in MODES:
            a, b = runs.get(ours), runs.get(other)
            if other != ours and a and b and a["tokens_per_batch_s"] and b["tokens_per_batch_s"]:
                report[f"{ours}_vs_{other}".replace("-", "_")] = {
                    "batch": round(a["tokens_per_batch_s"] / b["tokens_per_batch_s"], 2),
                    "wall": round(a["tokens_per_wall_s"] / b["tokens_per_wall_s"], 2)}
    print(json.dumps({k: v for k, v in report.items() if "_vs_" in k}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
