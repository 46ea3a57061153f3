"""The fused decoder-layers op against another revision of itself, in one process: the same step's
arguments (the default target or --model-path's, one sequence, T new rows at kv length S) through today's
`eagle::decoder_layers` and through decoder_layers.cpp as it was at --baseline (built under the
namespace eagle_old, registered on the same weights), calls alternating one by one (A B B A ...);
prints whether the outputs are bit-identical and the median ms a call. A VM's speed drifts within
minutes, so two builds are compared in one process, call after call, rather than run apart (rounds
of 20-30 calls each still swung by +-3% here where single calls alternating agreed to 1%).

    python scripts/probe_decoder_layers.py --baseline e244ffd --quantization int8 --kv 200 --rows 1 4
    python scripts/probe_decoder_layers.py --baseline a1d3a18 --kv 100 300 600 1200 --rows 1
    git show HEAD:eagle_infer/kernels/bf16_linear.cpp > /tmp/linear_before.cpp
    python scripts/probe_decoder_layers.py --baseline HEAD --linear-baseline /tmp/linear_before.cpp
    python scripts/probe_decoder_layers.py --baseline HEAD --attention-baseline --batch 32 --spread --kv 1024

`--batch B` steps B sequences at once (each its own cache row); `--spread` gives them lengths from a
quarter of the kv length up to all of it, as a batch's rows are (each attends its own slots, the
rest of the kv length masked); `--attention-baseline` builds the baseline's avx2_attention.cpp too
(as eagle_old::..., its bf16 scores set as today's are) and has the baseline layers call it, so an
attention kernel's change is measured in the whole step.

The baseline's source must build against today's kernels (the ops it calls must still exist).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def build_baseline(rev: str, linear_source: str | None = None, attention: bool = False) -> None:
    """Build decoder_layers.cpp at `rev` as the library eagle_old_layers (ops eagle_old::...); with
    `linear_source` (a version of bf16_linear.cpp) that Linear kernel is built too, as
    eagle_baseline::..., and the baseline layers call it instead of today's; with `attention`,
    avx2_attention.cpp at `rev` likewise (as eagle_old::...)."""
    from probe_bf16_linear import load_baseline  # this folder: the script's own sys.path entry

    from eagle_infer.kernels import decoder_layers
    from eagle_infer.kernels.avx2_linear import build_copy, source_at

    # The baseline calls today's Linear and attention libraries through kernel_calls.h: built
    # against today's header, a revision with another one would pass its structs in a layout
    # the kernels do not read (e.g. before f33dfaa AttentionCall had no head size).
    calls = decoder_layers.SOURCE.with_name("kernel_calls.h")
    if source_at(rev, calls) != calls.read_text():
        raise SystemExit(f"kernel_calls.h differs between {rev} and now: the two builds cannot share today's "
                         "kernels; compare with a revision that has today's kernel_calls.h")
    src = source_at(rev, decoder_layers.SOURCE)
    name = "eagle_old_layers"
    if linear_source:
        from eagle_infer.kernels import bf16_linear

        load_baseline(linear_source)  # ops eagle_baseline::..., as probe_bf16_linear.py --baseline
        # its own AMX switch, which today's calls have on where they multiply on the tiles
        torch.ops.eagle_baseline.bf16_linear_set_amx(bf16_linear.amx_on())
        old = '"eagle::bf16_linear_panels"'
        if old not in src:
            raise SystemExit(f"decoder_layers.cpp at {rev} does not name {old}")
        src, name = src.replace(old, '"eagle_baseline::bf16_linear_panels"'), "eagle_old_layers_linear"
    if attention:
        from eagle_infer.kernels import avx2_attention

        kernel = source_at(rev, avx2_attention.SOURCE)
        # its kv_write is registered for eagle_infer's op, which today's library already implements
        kernel = kernel[:kernel.index("TORCH_LIBRARY_IMPL(eagle_infer")]
        build_copy("eagle_old_attention", kernel, "eagle_old")
        torch.ops.eagle_old.avx2_attention_set_bf16_scores(avx2_attention.bf16_scores())
        src, name = src.replace('"eagle::avx2_attention', '"eagle_old::avx2_attention'), f"{name}_attention"
    build_copy(name, src, "eagle_old")


def step_arguments(model, T: int, kv: int, batch: int = 1, spread: bool = False) -> tuple:
    """The arguments model.forward hands the op for T new rows of `batch` sequences at kv length kv,
    each sequence as long as that (its last T slots new), or with `spread` from kv / 4 up to kv."""
    from eagle_infer.model import causal_mask

    saved = {}
    real = torch.ops.eagle.decoder_layers

    def keep(*args):
        saved["args"] = args
        return real(*args)

    torch.ops.eagle.decoder_layers = keep
    try:
        ends = torch.linspace(kv // 4, kv, batch).long() if spread else torch.full((batch,), kv)
        starts = (ends - T).clamp(min=0)
        pos = starts[:, None] + torch.arange(T)
        with torch.no_grad():
            model(torch.full((batch, T), 5), pos, pos, causal_mask(starts, T, kv))
    finally:
        torch.ops.eagle.decoder_layers = real
    return saved["args"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision of decoder_layers.cpp to compare with")
    ap.add_argument("--linear-baseline", metavar="SOURCE",
                    help="a version of bf16_linear.cpp the baseline's Linears run (a Linear kernel's "
                         "change measured in the whole step)")
    ap.add_argument("--attention-baseline", action="store_true",
                    help="the baseline's layers call the baseline revision's attention kernel too")
    ap.add_argument("--batch", type=int, default=1, help="sequences a step")
    ap.add_argument("--spread", action="store_true", help="the sequences' lengths from kv / 4 up to kv")
    ap.add_argument("--model-path", default=None, help="target folder (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--quantization", default="none", choices=["none", "int8"])
    ap.add_argument("--kv", type=int, nargs="+", default=[200])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--calls", type=int, default=300, help="calls of each build, alternating")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from eagle_infer.kernels import decoder_layers
    from eagle_infer.loader import load_model

    model = load_model(args.model_path, dtype=args.dtype, quantization=args.quantization)
    if model.fused_layers is None:
        raise SystemExit("the target's layers are not on the fused op here (Linears off our kernels?)")
    build_baseline(args.baseline, args.linear_baseline, args.attention_baseline)
    tensors, kinds, dims, local, eps, query_factor, _ = decoder_layers.stack_arguments(model)  # attach's
    # revisions before Dec 8 register 13 tensors a layer (no norms around the MLP), 5 dims, and
    # take no sliding layers' tables (Llama's layers only)
    local_tables = len(torch.ops.eagle_old.register_stack.default._schema.arguments) == 6
    if local_tables:
        old_id = torch.ops.eagle_old.register_stack(tensors, kinds, dims, local, eps, query_factor)
    else:
        if local or dims[5] or dims[6] or query_factor != 1.0 or any(t.numel() for t in tensors[5::15]):
            raise SystemExit(f"the baseline {args.baseline} computes Llama's layers only")
        llama = [t for i, t in enumerate(tensors) if i % 15 not in (5, 6)]
        old_id = torch.ops.eagle_old.register_stack(llama, kinds, dims[:5], eps)
    # revisions before Dec 7 name the stack by an int argument, later ones by a one-value tensor
    by_int = str(torch.ops.eagle_old.decoder_layers.default._schema.arguments[0].type) == "int"
    model.setup_cache(args.batch, max(2 * max(args.kv), 256))
    model.cache.kv.normal_()  # the slots before the new rows: values, not whatever memory held
    results = []
    for kv in args.kv:
        for T in args.rows:
            new_args = step_arguments(model, T, kv, args.batch, args.spread)
            old_args = (old_id if by_int else torch.tensor(old_id),
                        *(new_args[1:] if local_tables else new_args[1:5] + new_args[8:]))
            identical = torch.equal(torch.ops.eagle.decoder_layers(*new_args),
                                    torch.ops.eagle_old.decoder_layers(*old_args))
            builds = (("baseline", torch.ops.eagle_old.decoder_layers, old_args),
                      ("now", torch.ops.eagle.decoder_layers, new_args))
            ms = {"baseline": [], "now": []}
            for i in range(2 * args.calls):
                name, op, a = builds[(i + i // 2) % 2]  # A B B A: neither build always goes first
                t = time.perf_counter()
                op(*a)
                ms[name].append((time.perf_counter() - t) * 1e3)
            row = {"batch": args.batch, "rows": T, "kv": kv, "spread": args.spread, "identical": identical,
                   **{f"{k}_ms": round(statistics.median(v), 3) for k, v in ms.items()}}
            row["speedup"] = round(row["baseline_ms"] / row["now_ms"], 3)
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        out = {"baseline": args.baseline, "linear_baseline": args.linear_baseline,
               "attention_baseline": args.attention_baseline,
               "model_path": args.model_path, "dtype": args.dtype,
               "quantization": args.quantization,
               "threads": torch.get_num_threads(), "calls": args.calls, "results": results}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print("wrote", args.json)


if __name__ == "__main__":
    main()
