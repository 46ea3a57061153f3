"""Cost of every Linear layer of the target at M rows (a plain step is M=1, a verify of a tree of
M-1 drafts is M rows): torch's F.linear on the weights as loaded (column-major fp32, MKL sgemm)
against oneDNN with weights prepacked for that M (what eagle_infer/cpu_linears.py does).
Issue #13: on a CPU the verify's cost relative to a plain step decides whether speculation pays.

    python scripts/probe_linear_backends.py --threads 2 --json results/linear_backends.json

Then the whole target forward at T tokens, loaded both ways (load_model's cpu_linears).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from eagle_infer.loader import load_model


def timed_ms(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {b: load_model(None, args.dtype, "cpu", cpu_linears=b) for b in ("torch", "onednn")}
    model = models["torch"]
    dtype = model.embed_tokens.weight.dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    out = {"cpu": platform.processor() or next((line.split(":")[1].strip() for line in flags.splitlines()
                                                  if line.startswith("model name")), ""),
           "avx512": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags, "dtype": args.dtype,
           "threads": args.threads, "linears": len(linears), "rows": {}}
    for m in args.rows:
        xs = [torch.randn(m, lin.in_features, dtype=dtype) for lin in linears]
        packed = [torch.ops.mkldnn._reorder_linear_weight(lin.weight.contiguous(), m) for lin in linears]
        for x, lin, w in zip(xs, linears, packed):  # same values, or the comparison means nothing
            torch.testing.assert_close(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                                       F.linear(x, lin.weight), rtol=tol, atol=tol)
        t_torch = timed_ms(lambda xs=xs: [F.linear(x, lin.weight) for x, lin in zip(xs, linears)], args.reps)
        t_onednn = timed_ms(lambda xs=xs, packed=packed: [
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for x, w in zip(xs, packed)],
            args.reps)
        out["rows"][m] = {"torch_ms": round(t_torch, 2), "onednn_prepacked_ms": round(t_onednn, 2)}
        print(f"M={m:2d}: torch {t_torch:7.2f} ms  oneDNN prepacked {t_onednn:7.2f} ms", flush=True)
    one = out["rows"].get(1, {}).get("torch_ms")
    if one:
        for r in out["rows"].values():
            r["torch_vs_plain_step"] = round(r["torch_ms"] / one, 2)
            r["onednn_vs_plain_step"] = round(r["onednn_prepacked_ms"] / one, 2)
    # The whole eager forward at T new tokens after a 128-token prefix (attention, norms, KV writes
    # included), as shipped: load_model(cpu_linears="torch") against load_model(cpu_linears="onednn")
    # (fp32: oneDNN for T > 1, torch's kernel at T = 1; bf16 where native: oneDNN at every T).
    from eagle_infer.model import causal_mask

    prefix, ctx = 128, 1024
    for mdl in models.values():
        mdl.setup_cache(1, ctx)
    for m in [r for r in args.rows if prefix + r <= ctx]:
        tok = torch.zeros(1, m, dtype=torch.long)
        pos = torch.arange(prefix, prefix + m)[None]
        mask = causal_mask(torch.tensor([prefix]), m, ctx)
        args_t = (tok, pos, pos, mask)
        t = {b: timed_ms(lambda mdl=mdl, a=args_t: mdl(*a, logits_at=None), args.reps)
             for b, mdl in models.items()}
        out["rows"][m]["forward_ms"] = round(t["torch"], 2)
        out["rows"][m]["forward_onednn_ms"] = round(t["onednn"], 2)
        print(f"forward T={m:2d}: cpu_linears=torch {t['torch']:7.2f} ms, onednn {t['onednn']:7.2f} ms",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
