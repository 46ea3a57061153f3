"""What per-request n-gram hit rates could buy at most: each prompt's tree scored by hit rates
measured on that prompt's own greedy answer (the oracle: known before it is written, smoothed
toward the global table as (hits + s * global) / (chains + s)), against the global table
(eagle_infer/tree.py NGRAM_HIT_RATE). τ only, eager, so no timing noise: if the oracle barely moves
τ, a running per-request estimate (which must learn the rates as the answer goes) moves it less.

    python scripts/probe_ngram_oracle.py --smoothing 4 --json results/ngram_oracle.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from calibrate_ngram import hit_table

import eagle_infer.tree as tree_module
from eagle_infer.bench import load_prompts, machine_info
from eagle_infer.default_model import default_head_path
from eagle_infer.generate import generate
from eagle_infer.heads import load_head_for
from eagle_infer.loader import load_model, load_tokenizer
from eagle_infer.speculative import generate_speculative


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=2, help="MT-bench prompts of each category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--smoothing", type=float, nargs="+", default=[4.0, 0.5])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--json")
    args = ap.parse_args()
    tok = load_tokenizer(None)
    model = load_model(None, args.dtype)
    head = load_head_for(default_head_path("eagle3"), model)
    prompts = load_prompts(None, 1, tok, args.per_category)
    tree = tree_module.TreeConfig.from_flags(None, None, None, "cpu", "none", args.dtype, None)
    table = tree_module.NGRAM_HIT_RATE
    places = len(table[0])
    answers = [generate(model, [p], args.max_new_tokens, eos_token_ids=[])[0] for p in prompts]
    tables = {"global": [table] * len(prompts)}
    for s in args.smoothing:
        tables[f"oracle s={s}"] = []
        for p, a in zip(prompts, answers):
            reached, hit = hit_table([(p + a, len(p))], places)
            tables[f"oracle s={s}"].append(tuple(
                tuple(min(0.99, max(0.01, (hit[n][j] + s * table[n][j]) / (reached[n][j] + s)))
                      for j in range(places)) for n in range(len(table))))
    report = {}
    try:
        for name, per_prompt in tables.items():
            accepted = rounds = 0
            taus = []
            for p, t in zip(prompts, per_prompt):
                tree_module.NGRAM_HIT_RATE = t  # read by ngram_candidates at each (eager) round
                _, st = generate_speculative(model, head, [p], args.max_new_tokens, None, tree=tree,
                                             eos_token_ids=[])
                accepted += st.accepted_tokens
                rounds += st.row_rounds
                taus.append(round(st.acceptance_length(), 3))
            report[name] = {"tau": round(1 + accepted / rounds, 4), "per_prompt": taus}
            print(f"{name}: tau {report[name]['tau']}", flush=True)
    finally:
        tree_module.NGRAM_HIT_RATE = table
    if args.json:
        Path(args.json).write_text(json.dumps({
            "tree": tree.label(), "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
            "machine": machine_info(args.dtype, "cpu"), "results": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
