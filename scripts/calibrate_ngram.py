"""How often the n-gram branch's tokens are right (eagle_infer/tree.py, NGRAM_HIT_RATE): the
target answers prompts greedily (stopping at EOS), then at every answer position the lookup runs
on what came before (tree.ngram_lookup, the runtime's own function) and each proposed token is
checked against the answer, given the ones before it were right. Reported by the match's length
n and the token's place in the chain, with the counts behind each rate.

The prompts default to ones the target wrote itself (data/magpie), apart from the MT-bench
prompts the bench times:

    python scripts/calibrate_ngram.py --json results/ngram_hit_rate.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eagle_infer.bench import load_prompts, machine_info
from eagle_infer.generate import generate
from eagle_infer.loader import load_model, load_tokenizer
from eagle_infer.tree import NGRAM_MAX, ngram_lookup


def hit_table(contexts: list[tuple[list[int], int]], places: int) -> tuple[list[list[int]], list[list[int]]]:
    """(tokens, answer start) pairs -> reached[n - 1][i], hit[n - 1][i]: chains from a match of
    length n whose first i tokens were right, and of those, how many had token i right too."""
    reached = [[0] * places for _ in range(NGRAM_MAX)]
    hit = [[0] * places for _ in range(NGRAM_MAX)]
    for tokens, start in contexts:
        history = torch.tensor([tokens])
        for t in range(start, len(tokens) - 1):  # the root at t; the chain guesses t + 1 ..
            chain, n = ngram_lookup(history, torch.tensor([t]), places)
            if int(n) == 0:
                continue
            for i, guess in enumerate(chain[0].tolist()):
                if t + 1 + i >= len(tokens):
                    break
                reached[int(n) - 1][i] += 1
                if tokens[t + 1 + i] != guess:
                    break
                hit[int(n) - 1][i] += 1
    return reached, hit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="data/magpie/smollm2-135m-seed2.jsonl.xz")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--places", type=int, default=4, help="chain places reported")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(None)
    model = load_model(None, args.dtype)
    prompts = load_prompts(args.prompts, args.num_prompts, tok)
    eos = model.config.eos_token_ids
    contexts = []
    for i, p in enumerate(prompts):
        out = generate(model, [p], args.max_new_tokens, eos_token_ids=eos, compile=True)[0]
        contexts.append((p + out, len(p)))
        print(f"\ranswered {i + 1}/{len(prompts)}", end="", flush=True)
    print()
    reached, hit = hit_table(contexts, args.places)
    rates = [[round(h / r, 3) if r else None for h, r in zip(hs, rs)] for hs, rs in zip(hit, reached)]
    for n in range(NGRAM_MAX):
        print(f"match of {n + 1}: {reached[n][0]:5d} chains, "
              f"P(token i right | tokens before right) = {rates[n]}")
    answered = sum(len(t) - s for t, s in contexts)
    print(f"{len(prompts)} prompts, {answered} answer tokens")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "prompts": args.prompts, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "answer_tokens": answered, "dtype": args.dtype, "machine": machine_info(args.dtype, "cpu"),
            "hit_rate": rates, "reached": reached, "hit": hit}, indent=1) + "\n")


if __name__ == "__main__":
    main()
