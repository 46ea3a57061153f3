"""Plain decoding sampled at a temperature, compiled, two ways alternating in one process (the
machine's drift weighs on both alike): each step's token drawn inside its compiled graph (the
default: CompiledDecode's sampled step) against the graph's logits sampled eagerly after it
(pick_tokens: SamplingParams.graph_distribution off for the run). Default target, MT-bench
prompts, seeded: both ways must draw the same tokens (checked).

    python scripts/probe_plain_sampled.py --temperature 0.7 --json results/x.json

`--plain-rounds B`: the speculative decoder's rounds without drafts instead (what the server
runs above --speculative-disable-by-batch-size): the shipped EAGLE-3 head, B prompts decoded
together, every round without drafts (disable_by_batch_size 0), each bonus drawn in the round's
graph (_plain_round_sampled) against the eager round's distributions and walk after its verify.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eagle_infer.bench import load_prompts, machine_info
from eagle_infer.default_model import default_head_path, ensure_default_model
from eagle_infer.generate import generate
from eagle_infer.heads import load_head_for
from eagle_infer.loader import load_model, load_tokenizer
from eagle_infer.sampling import SamplingParams
from eagle_infer.speculative import SpecDecoder, generate_speculative
from eagle_infer.tree import TreeConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4, help="passes over the prompts each way, alternating")
    ap.add_argument("--plain-rounds", type=int, default=0, metavar="B",
                    help="the speculative decoder's rounds without drafts, B prompts at once")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = ensure_default_model()
    target = load_model(path, args.dtype, "cpu")
    prompts = load_prompts(None, args.num_prompts, load_tokenizer(path))
    in_graph = SamplingParams.graph_distribution
    B = args.plain_rounds
    if B:
        head = load_head_for(default_head_path("eagle3"), target)
        tree = TreeConfig.default_for("cpu", dtype=args.dtype)  # unused: no round drafts
        dec = SpecDecoder(target, head, tree, max_batch=B, max_seq_len=1024,
                          disable_by_batch_size=0).compile()

    def run(way: str) -> tuple[float, list[list[int]]]:
        SamplingParams.graph_distribution = in_graph if way == "in_graph" else property(lambda self: False)
        outs, start = [], time.perf_counter()
        for i in range(0, len(prompts), max(B, 1)):
            batch = prompts[i:i + max(B, 1)]
            params = [SamplingParams(temperature=args.temperature, seed=i + j) for j in range(len(batch))]
            if B:
                outs += generate_speculative(target, dec.head, batch, args.max_new_tokens, params,
                                             decoder=dec, tree=dec.tree, eos_token_ids=[])[0]
            else:
                outs += generate(target, batch, args.max_new_tokens, params[0], eos_token_ids=[],
                                 compile=True)
        return sum(len(o) for o in outs) / (time.perf_counter() - start), outs

    for way in ("in_graph", "eager"):  # compiles both graphs, untimed
        run(way)
    speed: dict[str, list[float]] = {"in_graph": [], "eager": []}
    outputs = {}
    for r in range(args.rounds):
        for way in ("in_graph", "eager") if r % 2 == 0 else ("eager", "in_graph"):
            tok_s, outputs[way] = run(way)
            speed[way].append(round(tok_s, 2))
            print(f"round {r} {way}: {tok_s:.1f} tokens/s", flush=True)
    SamplingParams.graph_distribution = in_graph
    same = outputs["in_graph"] == outputs["eager"]
    medians = {way: statistics.median(s) for way, s in speed.items()}
    what = f"rounds without drafts, batch {B}" if B else "plain steps"
    print(f"{what}, {args.dtype}, temperature {args.temperature}, {len(prompts)} prompts x "
          f"{args.max_new_tokens}, "
          f"{torch.get_num_threads()} threads: in-graph {medians['in_graph']:.1f}, "
          f"eager {medians['eager']:.1f} tokens/s (medians of {args.rounds}); same tokens: {same}")
    if args.json:
        record = {"machine": machine_info(args.dtype, "cpu"), "args": vars(args) | {"json": str(args.json)},
                  "tokens_per_s": speed, "medians": medians, "same_tokens": same}
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
