"""What a sampled distribution costs eagerly: logits_to_probs (temperature, top-p) on the target's
own verify logits, a round's rows at once (what a speculative round with top-p makes between its
two graphs) and one row (what a plain step makes), plus one row sampled (sampling.sample). The
logits come from a sampled speculative run of the default target and head on MT-bench prompts,
so the rows are as peaked as the target's answers (how many reach top-p within 64 and 1,024
candidates is reported). Run it at two revisions to weigh a change to sampling.py.

    python scripts/probe_top_p.py --temperature 0.7 --top-p 0.95 --json results/x.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import eagle_infer.speculative as speculative
from eagle_infer.bench import load_prompts, machine_info
from eagle_infer.default_model import default_head_path, ensure_default_model
from eagle_infer.heads import load_head_for
from eagle_infer.loader import load_model, load_tokenizer
from eagle_infer.sampling import SamplingParams, logits_to_probs, sample
from eagle_infer.tree import TreeConfig


def ms_per_call(fn, items: list, repeats: int) -> float:
    for x in items[:10]:
        fn(x)
    t = time.perf_counter()
    for _ in range(repeats):
        for x in items:
            fn(x)
    return (time.perf_counter() - t) / (repeats * len(items)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = ensure_default_model()
    target = load_model(path, "bf16", "cpu")
    head = load_head_for(default_head_path(), target)
    prompts = load_prompts(None, args.num_prompts, load_tokenizer(path))
    rounds: list[torch.Tensor] = []  # each round's verify logits [1, N, V]
    made = speculative.sampling_probs

    def keep(logits: torch.Tensor, params):
        rounds.append(logits.clone())
        return made(logits, params)

    # the round of two graphs makes its distributions here (every round: at a temperature alone
    # too, whose rounds are one graph otherwise)
    speculative.sampling_probs = keep
    in_graph = SamplingParams.graph_distribution
    SamplingParams.graph_distribution = property(lambda self: False)
    params = SamplingParams(args.temperature, args.top_p, seed=0)
    tree = TreeConfig.default_for("cpu", dtype="bf16")
    for p in prompts:
        speculative.generate_speculative(target, head, [p], args.max_new_tokens, [params], tree=tree)
    speculative.sampling_probs, SamplingParams.graph_distribution = made, in_graph
    rows = [r[:, :1] for r in rounds]
    probs = [torch.softmax(r[0].float() / args.temperature, -1) for r in rounds]
    reach = {k: sum(int((p.topk(k, -1).values.sum(-1) >= args.top_p).sum()) for p in probs)
             for k in (64, 1024)}
    setting = (args.temperature, args.top_p)
    out = {
        "machine": machine_info("bf16", "cpu"), "args": vars(args) | {"json": str(args.json)},
        "rounds": len(rounds), "nodes": rounds[0].shape[1], "vocab": rounds[0].shape[-1],
        "rows_within": {str(k): v for k, v in reach.items()}, "rows": sum(p.shape[0] for p in probs),
        "round_ms": ms_per_call(lambda r: logits_to_probs(r, *setting), rounds, args.repeats),
        "row_ms": ms_per_call(lambda r: logits_to_probs(r, *setting), rows, args.repeats),
        "row_sampled_ms": ms_per_call(lambda r: sample(logits_to_probs(r[0], *setting)), rows, args.repeats),
    }
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
