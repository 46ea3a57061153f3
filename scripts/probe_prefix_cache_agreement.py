"""How often a prefix-cache hit changes a greedy answer in a low precision: MT-bench's two-turn
conversations, the second turn's prompt holding the first turn's answer. One speculative decoder
with the prefix cache answers both turns (the second takes the first's row over); a decoder
without it answers each second turn from a whole prefill. In fp32 they are the same tokens
(tests/test_prefix_cache.py); in bf16 a prefix's keys and values computed a token (or a round)
at a time differ in the last bits from a prefill's, so some answers part. Reports the identical
answers, the first differing position of the others, and the cached tokens.

    python scripts/probe_prefix_cache_agreement.py --dtype bf16 --num-prompts 10 --json results/x.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eagle_infer.bench import default_prompts_path
from eagle_infer.default_model import default_head_path
from eagle_infer.generate import chat_prompt_ids
from eagle_infer.heads import load_head_for
from eagle_infer.loader import load_model, load_tokenizer
from eagle_infer.sampling import SamplingParams
from eagle_infer.speculative import Sequence_, SpecDecoder
from eagle_infer.tree import TreeConfig


def answer(dec: SpecDecoder, prompt: list[int], n: int) -> Sequence_:
    seq = Sequence_(prompt, SamplingParams(), n, set())
    dec.add(seq)
    while dec.seqs:
        dec.step()
    return seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(None)
    target = load_model(None, args.dtype)
    head = load_head_for(default_head_path("eagle3"), target)
    tree = TreeConfig.from_flags(None, None, None, "cpu", "none", args.dtype, None)
    cached = SpecDecoder(target, head, tree, max_seq_len=2048, prefix_cache=True)
    with open(default_prompts_path()) as f:
        questions = [json.loads(line)["turns"] for line in f if line.strip()][: args.num_prompts]
    rows = []
    for first, second in questions:
        msgs = [{"role": "user", "content": first}]
        one = answer(cached, chat_prompt_ids(tok, msgs), args.max_new_tokens)
        msgs += [{"role": "assistant", "content": tok.decode(one.output, skip_special_tokens=True)},
                 {"role": "user", "content": second}]
        prompt = chat_prompt_ids(tok, msgs)
        hit = answer(cached, prompt, args.max_new_tokens)
        fresh_dec = SpecDecoder(target, head, tree, max_seq_len=2048)
        whole = answer(fresh_dec, prompt, args.max_new_tokens)
        parts = next((i for i, (a, b) in enumerate(zip(hit.output, whole.output)) if a != b), None)
        rows.append({"prompt_tokens": len(prompt), "cached_tokens": hit.prefix_hit,
                     "identical": parts is None, "first_difference": parts})
        print(f"prompt {len(prompt)}, cached {hit.prefix_hit}: "
              + ("identical" if parts is None else f"parts at token {parts}"), flush=True)
    same = sum(r["identical"] for r in rows)
    summary = {"dtype": args.dtype, "tree": tree.label(), "conversations": len(rows), "identical": same,
               "max_new_tokens": args.max_new_tokens, "rows": rows}
    print(f"{same} of {len(rows)} second turns identical with and without the prefix cache ({args.dtype})")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
