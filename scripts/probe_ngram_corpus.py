"""What a corpus of served requests buys NGRAM, replayed offline: the target answers prompts
greedily (compiled, EOS ignored), then each answer is replayed round by round as NgramDecoder
would decode it, its chains looked up in its own history alone or beside the prompts and answers
of the requests before it (eagle_infer.ngram.lookup_chain, the decoder's own rule), and the
rounds are counted: plain steps (no match), verifies and their accepted drafts. No timing: the
speed proxy prices a verify at --verify-cost plain steps.

    python scripts/probe_ngram_corpus.py --num-prompts 40 --json results/ngram_corpus_replay.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle_infer.bench import load_prompts, machine_info  # noqa: E402
from eagle_infer.default_model import resolve_model_path  # noqa: E402
from eagle_infer.generate import generate  # noqa: E402
from eagle_infer.loader import default_device, dtype_name, load_model, load_tokenizer, resolve_dtype  # noqa: E402
from eagle_infer.ngram import DEFAULT_CORPUS_TOKENS, Corpus, NgramIndex, lookup_chain  # noqa: E402
from eagle_infer.tree import NGRAM_MAX  # noqa: E402


def replay(prompts: list[list[int]], answers: list[list[int]], k: int, capacity: int, cost: float) -> dict:
    """Rounds of NgramDecoder's lookups over the known answers, greedy acceptance against them."""
    corpus = Corpus(NGRAM_MAX, capacity)
    plain = verifies = accepted = 0
    for prompt, answer in zip(prompts, answers):
        own, i = NgramIndex(NGRAM_MAX), 1  # the first token comes from the prefill
        history = prompt + answer[:1]
        while i < len(answer):
            own.extend(history[len(own.tokens):])
            chain, n = lookup_chain(own, corpus, k, min_match=1)
            if n == 0:
                plain, step = plain + 1, 1
            else:
                a = next((j for j, t in enumerate(chain) if i + j >= len(answer) or answer[i + j] != t), k)
                verifies, accepted, step = verifies + 1, accepted + a, a + 1
            history += answer[i:i + step]
            i += step
        corpus.add(prompt + answer)
    tokens = plain + verifies + accepted
    return {"plain_rounds": plain, "verify_rounds": verifies, "accepted": accepted,
            "tau": round(1 + accepted / max(verifies, 1), 3),
            "speed_proxy": round(tokens / (plain + cost * verifies), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=None, help="as the bench's (default: MT-bench first turns)")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--chain", type=int, default=6, help="k, the chain's length")
    ap.add_argument("--verify-cost", type=float, default=1.15, help="a verify's cost in plain steps")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = default_device()
    dtype = dtype_name(resolve_dtype(args.dtype, device))
    folder = resolve_model_path("default")
    prompts = load_prompts(args.prompts, args.num_prompts, load_tokenizer(folder))
    model = load_model(folder, dtype, device)
    answers = [generate(model, [p], args.max_new_tokens, eos_token_ids=[], compile=True)[0] for p in prompts]
    report = {"settings": vars(args), "machine": machine_info(dtype, device), "modes": {
        "own history": replay(prompts, answers, args.chain, 0, args.verify_cost),
        "with the corpus": replay(prompts, answers, args.chain, DEFAULT_CORPUS_TOKENS, args.verify_cost)}}
    for mode, row in report["modes"].items():
        print(f"{mode}: {row}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
