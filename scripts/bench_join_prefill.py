"""Requests joining together: one prefill per request vs `add_many` (a forward per group of
similar prompt lengths). Prints and writes JSON: the best of --repeats for each way.

    OMP_NUM_THREADS=1 python scripts/bench_join_prefill.py --json results/bench_join_prefill.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eagle_infer.default_model import ensure_default_model
from eagle_infer.engine import PlainDecoder
from eagle_infer.loader import default_device, load_model
from eagle_infer.sampling import SamplingParams
from eagle_infer.speculative import Sequence_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[40, 60, 80, 50, 70, 90, 30, 64])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = default_device()
    model = load_model(ensure_default_model(), dtype="fp32", device=device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in args.lengths]
    dec = PlainDecoder(model, max_batch=len(prompts), max_seq_len=512)
    times: dict[str, list[float]] = {"one_by_one": [], "together": []}
    for _ in range(args.repeats):
        for mode, seconds in times.items():
            seqs = [Sequence_(p, SamplingParams(), 4, set()) for p in prompts]
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            if mode == "together":
                dec.add_many(seqs)
            else:
                for s in seqs:
                    dec.add(s)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t)
            for s in list(dec.seqs):
                dec.cancel(s)
    out = {"device": device, "prompt_lengths": args.lengths,
           **{f"{k}_s": round(min(v), 4) for k, v in times.items()}}
    out["speedup"] = round(out["one_by_one_s"] / out["together_s"], 3)
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
