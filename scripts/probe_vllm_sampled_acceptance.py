"""How much vLLM for CPU accepts when it samples: its acceptance length (from its spec-decode
counters) with our head (the shipped EAGLE-3 one, or --draft), or its own n-gram drafts, greedy
and at temperatures, on the same MT-bench prompts, seeded (request i with seed i).

    python scripts/probe_vllm_sampled_acceptance.py --json results/vllm_sampled_eagle3.json
    python scripts/probe_vllm_sampled_acceptance.py --method ngram --json results/vllm_sampled_ngram.json

vLLM runs in its own environment (scripts/vllm_env.sh) through eagle_infer.vllm_client.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle_infer.bench import load_prompts
from eagle_infer.default_model import default_head_path, resolve_model_path
from eagle_infer.loader import load_tokenizer
from eagle_infer.vllm_client import VLLMEngine

DRAFTS, ACCEPTED, PER_POS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                             "vllm:spec_decode_num_accepted_tokens_per_pos")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=["head", "ngram"], default="head")
    ap.add_argument("--draft", default=None, help="head folder (default: the shipped EAGLE-3 head)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    folder = resolve_model_path(None)
    prompts = load_prompts(None, args.num_prompts, load_tokenizer(folder))
    if args.method == "head":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_vllm import head_method  # vLLM's method name for the head's config

        head = Path(args.draft or default_head_path("eagle3"))
        spec = {"method": head_method(head), "model": str(head), "num_speculative_tokens": args.k}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    rows = []
    with VLLMEngine(folder, dtype=args.dtype, speculative_config=spec) as engine:
        for t in args.temperatures:
            before = engine.spec_counts()
            params = [{"temperature": t, "seed": i, "max_tokens": args.max_tokens, "ignore_eos": True}
                      for i in range(len(prompts))]
            _, seconds = engine.generate(prompts, params)
            after = engine.spec_counts()
            drafts, accepted = after[DRAFTS] - before[DRAFTS], after[ACCEPTED] - before[ACCEPTED]
            per_pos = [a - b for a, b in zip(after[PER_POS], before[PER_POS] or [0] * len(after[PER_POS]))]
            row = {"temperature": t, "acceptance_length": round(1 + accepted / max(drafts, 1), 3),
                   "drafts": drafts, "accepted_per_position": per_pos, "seconds": round(seconds, 2)}
            print(row, flush=True)
            rows.append(row)
    if args.json:
        report = {"config": vars(args) | {"speculative_config": spec}, "vllm_env_added": engine.env,
                  "results": rows}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
