"""Two CPU Linear backends (load_model's cpu_linears) timed in one process, interleaved, on the
same prompts: plain and speculative decoding with the default head, compiled. VMs of one kind
differ by 20-50% from run to run, so a comparison between two bench runs misleads; here each
round times every backend back to back and the medians are reported. A backend named with
":sdpa" runs attention on torch's SDPA instead of kernels/avx2_attention (which the "avx2"
backend turns on).

    python scripts/ab_cpu_linears.py --backends avx2 inductor --rounds 3 --json results/ab.json
    python scripts/ab_cpu_linears.py --backends avx2 avx2:sdpa --json results/ab_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from eagle_infer.bench import bench_plain, bench_spec, load_prompts, machine_info
from eagle_infer.default_model import default_head_path
from eagle_infer.heads import load_head_for
from eagle_infer.kernels import avx2_attention
from eagle_infer.loader import load_model, load_tokenizer
from eagle_infer.tree import TreeConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=["avx2", "inductor"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", type=int, nargs=3, default=[3, 4, 4], metavar=("STEPS", "TOPK", "TOKENS"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(None)
    prompts = load_prompts(None, args.num_prompts, tok)
    tree = TreeConfig(*args.tree)
    runs = {}
    for b in args.backends:  # load, compile and warm every backend first
        model = load_model(None, "fp32", "cpu", cpu_linears=b.split(":")[0])
        # the attention kernel is a process-wide switch that compiled graphs guard on: set per run
        attention = avx2_attention.enabled() and not b.endswith(":sdpa")
        avx2_attention.enable(attention)
        head = load_head_for(default_head_path("eagle3"), model)
        plain = bench_plain(model, prompts[:1], 8, compile_steps=True)
        spec = bench_spec(model, head, prompts[:1], 8, tree, compile_steps=True)
        runs[b] = {"model": model, "head": head, "attention": attention,
                   "warmup_s": {"plain": plain.warmup_s, "spec": spec.result.warmup_s},
                   "plain": [], "spec": [], "tau": None}
        print(f"{b}: warm-up {runs[b]['warmup_s']}", flush=True)
    want = None
    for r in range(args.rounds):
        for b, run in runs.items():
            avx2_attention.enable(run["attention"])
            p = bench_plain(run["model"], prompts, args.max_new_tokens, compile_steps=True)
            s = bench_spec(run["model"], run["head"], prompts, args.max_new_tokens, tree, compile_steps=True)
            run["plain"].append(p.tokens_per_s)
            run["spec"].append(s.result.tokens_per_s)
            run["tau"] = round(s.stats.acceptance_length(), 3)
            want = want or p.outputs  # the first plain run's tokens, for every backend and round
            assert p.outputs == want and s.result.outputs == want, b
            print(f"round {r} {b}: plain {p.tokens_per_s:.1f} tok/s, spec {s.result.tokens_per_s:.1f} "
                  f"(tau {run['tau']})", flush=True)
    out = {"machine": machine_info("fp32", "cpu"), "prompts": args.num_prompts,
           "max_new_tokens": args.max_new_tokens, "tree": args.tree, "rounds": args.rounds, "backends": {}}
    for b, run in runs.items():
        plain, spec = statistics.median(run["plain"]), statistics.median(run["spec"])
        out["backends"][b] = {"plain_tokens_per_s": round(plain, 2), "spec_tokens_per_s": round(spec, 2),
                              "spec_vs_plain": round(spec / plain, 3), "tau": run["tau"],
                              "plain_runs": [round(x, 2) for x in run["plain"]],
                              "spec_runs": [round(x, 2) for x in run["spec"]], "warmup_s": run["warmup_s"],
                              "attention": "avx2" if run["attention"] else "sdpa"}
        print(f"{b}: plain {plain:.1f}, spec {spec:.1f} tok/s ({spec / plain:.2f}x plain), tau {run['tau']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
