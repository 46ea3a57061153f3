"""Long prompts for the bench: first user turns of ShareGPT (the `sharegpt` builtin source) that
are between --min-tokens and --max-tokens long in the default target's tokenizer, taken from the
end of the file (the reference heads' captures start at its beginning), written as JSONL
records with `prompt` (and `tokens`), which `python -m eagle_infer.bench --prompts` reads. Most
are pasted documents or web-search results with a question about them (RAG-like): what a
verify's attention over a long cache costs shows there.

    python scripts/long_prompts.py --out data/long_prompts.jsonl
    python -m eagle_infer.bench --no-hf --dtype bf16 --prompts data/long_prompts.jsonl --num-prompts 8
"""

from __future__ import annotations

import argparse
import json

from eagle_infer.loader import load_tokenizer
from eagle_train.data import load_conversations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--min-tokens", type=int, default=900)
    ap.add_argument("--max-tokens", type=int, default=1400)
    args = ap.parse_args()
    tok = load_tokenizer(None)
    picked = []
    for conv in reversed(load_conversations("sharegpt")):
        first = conv[0]
        if first["role"] != "user" or not first["content"].isascii():
            continue
        n = len(tok(first["content"])["input_ids"])
        if args.min_tokens <= n <= args.max_tokens:
            picked.append({"prompt": first["content"], "tokens": n})
        if len(picked) == args.count:
            break
    with open(args.out, "w") as f:
        for rec in picked:
            f.write(json.dumps(rec) + "\n")
    print(f"wrote {len(picked)} prompts of {min(r['tokens'] for r in picked)}-"
          f"{max(r['tokens'] for r in picked)} tokens to {args.out}")


if __name__ == "__main__":
    main()
