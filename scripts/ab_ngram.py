"""Prompt lookup without a head (eagle_infer.ngram) in several settings, taking turns prompt by
prompt in one process with plain decoding (compiled), so a drifting VM weighs on all alike:
chain lengths, shortest matches, and the chain's verify compiled or eager.

    python scripts/ab_ngram.py --configs k4m1 k4m2 k6m2 k4m1:eager --json results/ab_ngram.json
    python scripts/ab_ngram.py --prompts data/long_prompts.jsonl --num-prompts 8 --configs k4m2 k6m2

Each config kKmN[:eager][:own]: chains of K, matches of at least N tokens, `:eager` with the verify
run eagerly (the plain steps compiled either way), `:own` looking up in each request's own history
alone (no corpus of the requests served before); --temperature and --repetition-penalty decode
plain and every config that way (sampled: from one seed). Writes per config tokens/s (prefill
inside, as the bench), the ratio to plain, tau over the rounds that verified, and whether greedy
output equals plain's."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle_infer.bench import (  # noqa: E402
    load_prompts,
    machine_info,
    ngram_decode_fn,
    plain_decode_fn,
    time_interleaved,
    warm_up,
)
from eagle_infer.default_model import resolve_model_path  # noqa: E402
from eagle_infer.loader import default_device, dtype_name, load_model, load_tokenizer, resolve_dtype  # noqa: E402
from eagle_infer.sampling import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--prompts", default=None, help="as the bench's (default: MT-bench first turns)")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--configs", nargs="+", default=["k4m1", "k4m2", "k6m2"])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = default_device()
    dtype = dtype_name(resolve_dtype(args.dtype, device))
    folder = resolve_model_path(args.model_path)
    prompts = load_prompts(args.prompts, args.num_prompts, load_tokenizer(folder))
    model = load_model(folder, dtype, device)
    params = SamplingParams(temperature=args.temperature, repetition_penalty=args.repetition_penalty,
                            seed=0 if args.temperature > 0 else None)
    fns = {"plain": plain_decode_fn(model, args.max_new_tokens, compile_steps=True, params=params)}
    stats = {}
    for conf in args.configs:
        found = re.fullmatch(r"k(\d+)m(\d+)(:eager)?(:own)?", conf)
        if not found:
            ap.error(f"a config is kKmN[:eager][:own], not {conf}")
        k, m, eager = int(found[1]), int(found[2]), bool(found[3])
        fns[conf], stats[conf], dec = ngram_decode_fn(model, prompts, args.max_new_tokens, k, m,
                                                      params=params, compile_steps=True)
        if eager:
            dec.verify_fn = None
        if found[4]:
            dec.corpus.capacity = 0
    warmup = {name: round(warm_up(fn, prompts), 2) for name, fn in fns.items()}
    for st in stats.values():
        st.__init__()
    res = time_interleaved(fns, prompts)
    plain = res["plain"]
    report = {"settings": {"prompts": args.prompts or "MT-bench first turns", "num_prompts": len(prompts),
                           "max_new_tokens": args.max_new_tokens, "dtype": dtype, "ignore_eos": True,
                           "temperature": args.temperature, "repetition_penalty": args.repetition_penalty},
              "machine": machine_info(dtype, device), "warmup_s": warmup,
              "plain_tokens_per_s": round(plain.tokens_per_s, 3), "configs": {}}
    print(f"plain {plain.tokens_per_s:.1f} tok/s")
    for conf, st in stats.items():
        r = res[conf]
        row = {"tokens_per_s": round(r.tokens_per_s, 3),
               "vs_plain": round(r.tokens_per_s / plain.tokens_per_s, 3),
               "acceptance_length": round(st.acceptance_length(), 3), "verify_rounds": st.row_rounds,
               "plain_rounds": st.plain_rounds,
               "greedy_identical": r.outputs == plain.outputs if args.temperature == 0 else None}
        report["configs"][conf] = row
        print(f"{conf}: {row}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
