"""The default target's Linear shapes at M rows in bf16 (a plain step is 1 row, a verify of the
CPU default tree 4, of the GPU default tree 16, prefill chunks more): oneDNN's prepacked bf16
Linear (cpu_linears="onednn"), torch's F.linear and our AVX-512 kernel (cpu_linears="avx512_bf16",
eagle_infer/kernels/bf16_linear.cpp) on fp32 FMAs ("ours"), on vdpbf16ps ("ours_dot") and on AMX
tiles where the CPU has them ("ours_amx"), the fp32 weights on the AVX2 kernel (cpu_linears="avx2", the
fp32 default on AVX2 CPUs: "fp32"), and
the same kernel on the weights made int8 (`--quantization int8`: "int8", "int8_dot", "int8_amx"), in one
process. Each shape runs over as many distinct
weights as fill `--mb` MB, more than the last-level cache holds (260 MB reported on the 2-core
Xeon this was written on), so the weights stream from memory as in a decode step; the read rate
is reported beside the time. Also reports each kernel's mean error against float64. The kernels
take turns within each shape, so this VM's drift hits them alike. `--baseline SOURCE` adds another
build of the kernel (another version of bf16_linear.cpp) as "baseline" / "baseline_dot" / "baseline_amx" (and
"baseline_int8" / "baseline_int8_dot" where it has int8_linear), in the same process, and says
whether its rows equal ours bit for bit: how a change to the kernel is measured per shape.

    python scripts/probe_bf16_linear.py --rows 1 4 16 64 512 --json results/probe_bf16_linear.json
    python scripts/probe_bf16_linear.py --model-path /tmp/shapes/llama-3.2-1b --rows 1  # its shapes
    git show HEAD~1:eagle_infer/kernels/bf16_linear.cpp > /tmp/before.cpp
    python scripts/probe_bf16_linear.py --rows 1 9 17 --baseline /tmp/before.cpp \
        --kernels ours_dot baseline_dot
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle_infer import cpu_linears
from eagle_infer.bench import measure_read_bandwidth, median_seconds
from eagle_infer.kernels import avx2_linear, bf16_linear
from eagle_infer.quantize import quantize_weight


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """cpu_linears.OneDNNLinear's call."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def on_amx(fn, set_amx=bf16_linear.set_amx):
    """fn() with the kernel's dot calls on AMX tiles (set_amx: the switch of ours, or of the
    baseline's build)."""
    set_amx(True)
    try:
        return fn()
    finally:
        set_amx(False)


def load_baseline(source: str) -> None:
    """Build and load `source` (a version of bf16_linear.cpp) as torch.ops.eagle_baseline."""
    from eagle_infer.kernels.avx2_linear import build_copy

    build_copy("eagle_bf16_linear_baseline", Path(source).read_text(), "eagle_baseline",
               bf16_linear.AVX512_FLAGS if bf16_linear.avx512_bf16_supported() else [])


SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
          "down_proj": (576, 1536), "lm_head": (49152, 576)}


def shapes_of(model_path: str) -> dict[str, tuple[int, int]]:
    """(out, in) of a target's Linears as our layers run them (q/k/v and gate/up fused), from its
    config.json."""
    from eagle_infer.loader import read_hf_config, resolve_model_path
    from eagle_infer.model import ModelConfig

    c = ModelConfig.from_hf(read_hf_config(resolve_model_path(model_path)))
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"qkv_proj": (q + 2 * kv, c.hidden_size), "o_proj": (c.hidden_size, q),
            "gate_up_proj": (2 * c.intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    ap.add_argument("--mb", type=float, default=400, help="MB of distinct weights a shape")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline", metavar="SOURCE", help="another bf16_linear.cpp to time beside ours")
    ap.add_argument("--kernels", nargs="+",
                    help="only these (ours ours_dot ours_amx int8 int8_dot int8_amx onednn torch fp32 "
                         "baseline baseline_dot baseline_amx baseline_int8 baseline_int8_dot)")
    ap.add_argument("--model-path", help="a target folder whose Linear shapes to time "
                                          "(default: the default target's)")
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = shapes_of(args.model_path) if args.model_path else SHAPES
    torch.set_num_threads(args.threads)
    bf16_linear.load()
    dot = bf16_linear.avx512_bf16_supported()  # the AVX2 build has the FMA loop only
    onednn_bf16 = torch.bfloat16 in cpu_linears.packable_dtypes()
    amx = bf16_linear.set_amx(True)
    bf16_linear.set_amx(False)  # "ours_dot" / "int8_dot": vdpbf16ps; "ours_amx" / "int8_amx": AMX
    if args.baseline:
        load_baseline(args.baseline)
    out = {"threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "avx512_bf16": bf16_linear.avx512_bf16_supported(), "cpu_vendor": bf16_linear.cpu_vendor(),
           "dot_default": bf16_linear.dot_default(), "multiply_default": bf16_linear.multiply_default(),
           "amx": amx, "baseline": args.baseline, "model_path": args.model_path,
           "read_gb_s": round(measure_read_bandwidth() / 1e9, 1), "shapes": {}}
    print(f"read bandwidth (a sum over 256 MB, best of 5): {out['read_gb_s']} GB/s")
    for name, (n, k) in shapes.items():
        copies = max(2, int(args.mb * 1e6 // (n * k * 2)))
        weights = [(torch.randn(n, k) * 0.05).bfloat16() for _ in range(copies)]
        ours_w = [bf16_linear.pack(w) for w in weights]
        int8_w = [bf16_linear.pack_int8(*quantize_weight(w)) for w in weights]
        onednn_w = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights] if onednn_bf16 else []
        fp32_w = [avx2_linear.pack(w.float()) for w in weights] if avx2_linear.supported() else []
        mb = copies * n * k * 2 / 1e6
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            calls = {
                "ours": lambda x=x: [bf16_linear.bf16_linear(x, w, n) for w in ours_w],  # noqa: B023
                "ours_dot": lambda x=x: [bf16_linear.bf16_linear(x, w, n, True) for w in ours_w],  # noqa: B023
                "int8": lambda x=x: [bf16_linear.int8_linear(x, w, s, n) for w, s in int8_w],  # noqa: B023
                "int8_dot": lambda x=x: [bf16_linear.int8_linear(x, w, s, n, True) for w, s in int8_w],  # noqa: B023
                "onednn": lambda x=x: [onednn(x, w) for w in onednn_w],  # noqa: B023
                "torch": lambda x=x: [F.linear(x, w) for w in weights],  # noqa: B023
                "fp32": lambda x=x: [avx2_linear.avx2_linear(x.float(), w, n) for w in fp32_w],  # noqa: B023
            }
            if not dot:
                calls = {kn: fn for kn, fn in calls.items() if not kn.endswith("_dot")}
            if not onednn_bf16:  # oneDNN has no bf16 Linear without native bf16
                del calls["onednn"]
            if not fp32_w:
                del calls["fp32"]
            if amx:  # the dot calls on AMX tiles, the switch flipped around them
                calls["ours_amx"] = lambda x=x: on_amx(  # noqa: B023
                    lambda: [bf16_linear.bf16_linear(x, w, n, True) for w in ours_w])  # noqa: B023
                calls["int8_amx"] = lambda x=x: on_amx(  # noqa: B023
                    lambda: [bf16_linear.int8_linear(x, w, s, n, True) for w, s in int8_w])  # noqa: B023
            if args.baseline:
                baseline = torch.ops.eagle_baseline.bf16_linear
                calls["baseline"] = lambda x=x: [baseline(x, w, n) for w in ours_w]  # noqa: B023
                calls["baseline_dot"] = lambda x=x: [baseline(x, w, n, True) for w in ours_w]  # noqa: B023
                if amx and hasattr(torch.ops.eagle_baseline, "bf16_linear_set_amx"):
                    calls["baseline_amx"] = lambda x=x: on_amx(  # noqa: B023
                        lambda: [baseline(x, w, n, True) for w in ours_w],  # noqa: B023
                        torch.ops.eagle_baseline.bf16_linear_set_amx)
                if hasattr(torch.ops.eagle_baseline, "int8_linear"):
                    base8 = torch.ops.eagle_baseline.int8_linear
                    calls["baseline_int8"] = lambda x=x: [base8(x, w, s, n) for w, s in int8_w]  # noqa: B023
                    calls["baseline_int8_dot"] = lambda x=x: [base8(x, w, s, n, True) for w, s in int8_w]  # noqa: B023
            if args.kernels:
                calls = {name: fn for name, fn in calls.items() if name in args.kernels}
            want = F.linear(x.double(), weights[0].double())
            row = {"weights_mb": round(mb, 1)}
            # the kernels take turns, one timed pass each a repetition: drift hits all alike
            seconds = {kernel: [] for kernel in calls}
            for _ in range(args.reps):
                for kernel, fn in calls.items():
                    seconds[kernel].append(median_seconds(fn, 1, 0 if seconds[kernel] else 2))
            for kernel, fn in calls.items():
                got = fn()[0]
                err = (got.double() - want).abs().mean().item()
                ms = 1e3 * statistics.median(seconds[kernel]) / copies
                weight_bytes = n * k * (1 if "int8" in kernel else 4 if kernel == "fp32" else 2)
                row[kernel] = {"ms_a_call": round(ms, 4), "gb_s": round(weight_bytes / 1e6 / ms, 1),
                               "mean_abs_err": float(f"{err:.3g}")}
                if kernel.startswith("baseline"):  # a rework of the kernel keeps its bits
                    dot = kernel.endswith(("_dot", "_amx"))
                    ours = (bf16_linear.int8_linear(x, *int8_w[0], n, dot) if "int8" in kernel
                            else on_amx(lambda: bf16_linear.bf16_linear(x, ours_w[0], n, True))  # noqa: B023
                            if kernel.endswith("_amx")
                            else bf16_linear.bf16_linear(x, ours_w[0], n, dot))
                    row[kernel]["equal_to_ours"] = torch.equal(got, ours)
            out["shapes"].setdefault(name, {})[m] = row
            times = "  ".join(f"{kn} {row[kn]['ms_a_call']:7.3f} ms ({row[kn]['gb_s']:5.1f} GB/s)"
                              for kn in calls)
            print(f"{name:13s} {n:5d}x{k:<5d} M={m:<3d} {times}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
