"""A prefill's time on long prompts two ways, alternating in one process so that the machine's drift
weighs on both alike: `--compare attention` (default): its causal attention on our kernel
(kernels/avx2_attention's causal_attention, "ours") against SDPA's causal kernel ("before");
`--compare linears`: every bf16 / int8 Linear call on our kernel ("ours", cpu_linears.BF16_MAX_ROWS
unlimited) against torch's above 512 rows ("before": F.linear in bf16, the dequantized fp32 GEMM
for int8 weights). With --profile, where one prefill's time goes (torch profiler, "ours").
`--chunk N`: each prompt prefilled N tokens a call (chunked prefill; a chunk past the first is a
causal attention past the slots its row holds, which "before" runs on SDPA with the mask).
Default target, default CPU Linears for the dtype.

    python scripts/probe_prefill.py --json results/probe_prefill_amd_zen4.json
    python scripts/probe_prefill.py --chunk 256
    python scripts/probe_prefill.py --compare linears --quantization int8 --profile
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eagle_infer import cpu_linears, quantize
from eagle_infer.generate import chat_prompt_ids, ensure_cache, prefill
from eagle_infer.kernels import avx2_attention
from eagle_infer.loader import load_model, load_tokenizer


def set_way(compare: str, ours: bool) -> None:
    """Put the prefill on "ours" or "before" for the comparison."""
    if compare == "attention":
        avx2_attention.enable(ours)
    else:
        rows = 1 << 62 if ours else 512
        cpu_linears.Bf16Linear.max_rows = quantize.BF16_MAX_ROWS = rows


def prefill_prompt(model, prompt: list[int], chunk: int) -> None:
    """The prompt's prefill, whole (chunk 0) or `chunk` tokens a call."""
    if not chunk:
        prefill(model, [prompt])
        return
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        prefill(model, [prompt[:end]], start=[start], logits=end == len(prompt))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="data/long_prompts.jsonl", help="JSONL with a 'prompt' a line")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--quantization", default="none", choices=["none", "int8"])
    ap.add_argument("--compare", default="attention", choices=["attention", "linears"])
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompts each way, alternating")
    ap.add_argument("--chunk", type=int, default=0, help="prefill N tokens a call (0: whole)")
    ap.add_argument("--profile", action="store_true", help="also a torch profile of one prefill")
    ap.add_argument("--json")
    args = ap.parse_args()

    model = load_model(dtype=args.dtype, quantization=args.quantization)
    tokenizer = load_tokenizer()
    lines = Path(args.prompts).read_text().splitlines()[: args.num_prompts]
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": json.loads(line)["prompt"]}])
               for line in lines]
    ensure_cache(model, 1, max(len(p) for p in prompts) + 64)
    was = avx2_attention.enabled(), cpu_linears.Bf16Linear.max_rows
    seconds: dict[str, list[float]] = {"ours": [], "before": []}
    for r in range(args.rounds):
        for way in ("ours", "before") if r % 2 == 0 else ("before", "ours"):
            set_way(args.compare, way == "ours")
            prefill_prompt(model, prompts[0], args.chunk)  # warm
            start = time.perf_counter()
            for p in prompts:
                prefill_prompt(model, p, args.chunk)
            seconds[way].append((time.perf_counter() - start) / len(prompts))
            print(f"round {r} {way}: {seconds[way][-1]:.3f} s a prompt", flush=True)
    medians = {way: statistics.median(s) for way, s in seconds.items()}
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.dtype}{' int8 weights' if args.quantization == 'int8' else ''}, "
          f"{torch.get_num_threads()} threads, {args.compare}, chunks of {args.chunk or 'all'}: "
          f"prefill {medians['before']:.3f} s a prompt before, {medians['ours']:.3f} s ours "
          f"(medians of {args.rounds})")
    table = None
    if args.profile:
        set_way(args.compare, True)
        with torch.profiler.profile() as prof:
            prefill_prompt(model, prompts[0], args.chunk)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        print(table)
    avx2_attention.enable(was[0])
    cpu_linears.Bf16Linear.max_rows = quantize.BF16_MAX_ROWS = was[1]
    if args.json:
        Path(args.json).write_text(json.dumps({
            "prompts": args.prompts, "prompt_tokens": [len(p) for p in prompts], "dtype": args.dtype,
            "quantization": args.quantization, "compare": args.compare, "chunk": args.chunk,
            "threads": torch.get_num_threads(),
            "seconds_a_prompt": seconds, "medians": medians, "profile": table}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
