"""Two CPU Linear backends (load_model's cpu_linears) timed in one process, interleaved, on the
same prompts: plain and speculative decoding with the default head (`--model-path`, `--draft`:
another target and head), compiled. VMs of one kind
differ by 20-50% from run to run, so a comparison between two bench runs misleads; here each
round times every backend back to back and the medians are reported. Suffixes take back one
thing the "avx2" backend turns on: ":sdpa" runs attention on torch's SDPA instead of
kernels/avx2_attention, ":py" compiles steps with Inductor's Python wrapper instead of its C++
one (cpu_linears.step_options); ":cpp" compiles them with the C++ wrapper where the default is
the Python one (e.g. bf16 "onednn"); they combine ("avx2:sdpa:py"). For "avx512_bf16", ":fma",
":dot" and ":amx" pick its multiply (kernels/bf16_linear.multiply_default: fp32 FMAs, vdpbf16ps or
AMX tiles); ":attnloops", ":attndot" and ":attnamx" compute bf16 attention's scores on
kernels/avx2_attention's AVX2 loops, vdpbf16ps or AMX tiles (avx2_attention.set_bf16_scores,
EAGLE_CPU_ATTENTION; else the CPU's default, default_bf16_scores). ":int8"
loads the target with weight-only int8 Linears (`--quantization int8`; with "avx512_bf16" on our
kernel, with the others on torch's and, compiled, Inductor's template). ":pylayers" keeps the
target's layers in Python where they would run as one C++ call (kernels/decoder_layers:
EAGLE_FUSED_LAYERS=0 for that load).

    python scripts/ab_cpu_linears.py --backends avx2 inductor --rounds 3 --json results/ab.json
    python scripts/ab_cpu_linears.py --backends avx2 avx2:sdpa --json results/ab_attention.json
    python scripts/ab_cpu_linears.py --backends avx2 avx2:py --json results/ab_cpp_wrapper.json
    python scripts/ab_cpu_linears.py --dtype bf16 --backends onednn onednn:cpp --json results/ab.json
    python scripts/ab_cpu_linears.py --dtype bf16 --backends avx512_bf16:fma avx512_bf16:dot
    python scripts/ab_cpu_linears.py --dtype bf16 --backends avx512_bf16 --also-trees 3 4 8 2 4 6
    python scripts/ab_cpu_linears.py --dtype bf16 --backends avx512_bf16 avx512_bf16:int8 onednn:int8
    python scripts/ab_cpu_linears.py --dtype bf16 --backends avx512_bf16 avx512_bf16:pylayers --tree 2 4 4
    python scripts/ab_cpu_linears.py --dtype bf16 --backends avx512_bf16:attnloops avx512_bf16:attndot \
        --prompts data/long_prompts.jsonl

`--also-trees` times more trees after `--tree` in every round, on the same model (one backend
suffices to compare trees); `--also-ngram K ...` times them with n-gram branches of K
(TreeConfig.ngram_branch), `--per-category N` on the first N prompts of each MT-bench category,
`--prompts FILE` on another prompt file's (bench.load_prompts: e.g. scripts/long_prompts.py's).

    python scripts/ab_cpu_linears.py --dtype bf16 --backends avx512_bf16 --tree 2 4 6 --also-ngram 4 6 \
        --per-category 2

`--also-separate` times each tree once more drafting at every round's start in a call of its
own (SpecDecoder's draft_ahead=False) rather than at the end of the round before. Within a
backend's round the methods (plain, each tree) take turns prompt by
prompt, in alternating order (bench.time_interleaved), so the VM's drift weighs on all alike.

    python scripts/ab_cpu_linears.py --dtype bf16 --backends avx512_bf16 --tree 2 4 4 --also-separate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace
from unittest import mock

import torch

import eagle_infer.generate
import eagle_infer.speculative
from eagle_infer import cpu_linears
from eagle_infer.bench import (
    load_prompts,
    machine_info,
    plain_decode_fn,
    spec_decode_fn,
    spec_seq_len,
    time_interleaved,
    warm_up,
)
from eagle_infer.default_model import default_head_path
from eagle_infer.heads import load_head_for
from eagle_infer.kernels import avx2_attention, bf16_linear, decoder_layers
from eagle_infer.loader import load_model, load_tokenizer
from eagle_infer.tree import TreeConfig


def with_fresh_code(cls: type, names: list[str]) -> type:
    """A subclass of cls whose methods `names` call cls's through new code objects: torch.compile
    keeps compiled graphs per code object and reuses them for every model of the same shapes, so
    a variant compiled with other settings needs code of its own."""
    ns: dict = {}
    for n in names:
        exec(f"def {n}(self, *args):\n    return _method(self, *args)", {"_method": getattr(cls, n)}, ns)
    return type(cls.__name__ + "Variant", (cls,), ns)


ORIGINAL = (eagle_infer.generate.CompiledDecode, eagle_infer.speculative.SpecDecoder,
            eagle_infer.generate.step_options)
STEPS = ["_draft_tree", "_verify_commit_greedy", "_greedy_round_ahead", "_verify_commit_sampled",
         "_sampled_round_ahead", "_verify", "_sampled_tail_only", "_sampled_tail_ahead", "_catch_up",
         "_plain_round_greedy"]  # what SpecDecoder.compile compiles


def python_wrapper(*args) -> dict | None:
    """The default options without the C++ wrapper."""
    options = {k: v for k, v in (ORIGINAL[2](*args) or {}).items() if k != "cpp_wrapper"}
    return options or None


def cpp_wrapper(target, settings, mode) -> dict | None:
    """The default options with the C++ wrapper wherever Inductor's default mode runs unfrozen."""
    if mode is not None or settings is not None:
        return None
    return {**(ORIGINAL[2](target, settings, mode) or {}), "cpp_wrapper": True}


WRAPPERS = {
    "default": ORIGINAL,
    "py": (with_fresh_code(ORIGINAL[0], ["_step"]), with_fresh_code(ORIGINAL[1], STEPS), python_wrapper),
    "cpp": (with_fresh_code(ORIGINAL[0], ["_step"]), with_fresh_code(ORIGINAL[1], STEPS), cpp_wrapper),
}


def use_wrapper(wrapper: str) -> None:
    """Compiled steps built from here on (the bench builds them per model and per decoder) use
    Inductor's Python wrapper ("py"), its C++ one ("cpp") or the default (cpu_linears.step_options)."""
    decode, decoder, choice = WRAPPERS[wrapper]
    eagle_infer.generate.CompiledDecode, eagle_infer.speculative.SpecDecoder = decode, decoder
    eagle_infer.generate.step_options = eagle_infer.speculative.step_options = choice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=["avx2", "inductor"])
    ap.add_argument("--model-path", default=None, help="target folder (default: the embedded SmolLM2)")
    ap.add_argument("--draft", default=None, help="head folder (default: the shipped EAGLE-3 head)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", type=int, nargs=3, default=[3, 4, 4], metavar=("STEPS", "TOPK", "TOKENS"))
    ap.add_argument("--also-trees", type=int, nargs="*", default=[], metavar="STEPS TOPK TOKENS",
                    help="more trees (three numbers each) timed after --tree in every round")
    ap.add_argument("--ngram-branch", type=int, default=0, metavar="K",
                    help="the n-gram branch of --tree and --also-trees (TreeConfig.ngram_branch)")
    ap.add_argument("--also-ngram", type=int, nargs="*", default=[], metavar="K",
                    help="also time --tree and each of --also-trees with each of these n-gram "
                         "branches, named 'S/K/N+gK'")
    ap.add_argument("--per-category", type=int, default=None, metavar="N",
                    help="the first N MT-bench prompts of each category in place of --num-prompts")
    ap.add_argument("--prompts", default=None, help="prompt file (bench.load_prompts); default MT-bench")
    ap.add_argument("--also-separate", action="store_true",
                    help="also time every tree with its draft phase at each round's start "
                         "(draft_ahead=False), named 'S/K/N separate'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model_path)
    prompts = load_prompts(args.prompts, args.num_prompts, tok, args.per_category)
    tree = TreeConfig(*args.tree, args.ngram_branch)
    if len(args.also_trees) % 3:
        ap.error("--also-trees takes three numbers a tree")
    also_trees = [TreeConfig(*t, args.ngram_branch) for t in zip(*[iter(args.also_trees)] * 3)]
    with_ngram = [replace(t, ngram_branch=k) for t in [tree, *also_trees] for k in args.also_ngram
                  if k != t.ngram_branch]
    also = {t.label(): (t, True) for t in also_trees + with_ngram}
    if args.also_separate:
        also.update({f"{name} separate": (t, False)
                     for name, (t, _) in [(tree.label(), (tree, True)), *also.items()]})
    runs = {}
    for b in args.backends:  # load, compile and warm every backend first
        backend, *off = b.split(":")
        # the kernel's multiply: fp32 FMAs, vdpbf16ps (":dot") or AMX tiles, else its default
        multiply = (next((m for m in ("fma", "dot", "amx") if m in off), None)
                    or bf16_linear.multiply_default())
        multiply = "vdpbf16ps" if multiply == "dot" else multiply
        dot = multiply != "fma"
        quantization = "int8" if "int8" in off else "none"
        # the multiply for the model and its head, and fused or Python layers, for this load only
        load_env = {bf16_linear.DOT_ENV: multiply,
                    decoder_layers.ENV: "0" if "pylayers" in off else "1"}
        with mock.patch.dict(os.environ, load_env):
            model = load_model(args.model_path, args.dtype, "cpu", cpu_linears=backend,
                               quantization=quantization)
            # AMX is a process-wide switch of the kernel's dot calls, which this load set: per run,
            # like attention
            amx = cpu_linears.bf16_multiply(model) == "amx"
            # the attention kernel is a process-wide switch that compiled graphs guard on: set per run
            attention = avx2_attention.enabled() and "sdpa" not in off
            avx2_attention.enable(attention)
            scores = next((m[len("attn"):] for m in off if m in ("attnloops", "attndot", "attnamx")),
                          avx2_attention.default_bf16_scores())
            bf16_attention = attention and args.dtype == "bf16"
            attention_scores = avx2_attention.set_bf16_scores(scores) if bf16_attention else None
            wrapper = "py" if "py" in off else "cpp" if "cpp" in off else "default"
            use_wrapper(wrapper)
            head = load_head_for(args.draft or default_head_path("eagle3"), model)
        # the longest prompt at full length: the cache (and its graphs) at the rounds' size
        # one decode function per method, each warmed up (compiled) on the shortest and the longest
        # prompt; a round times them prompt by prompt in alternating order (time_interleaved)
        fns = {"plain": plain_decode_fn(model, args.max_new_tokens, compile_steps=True)}
        stats = {}
        trees = [("spec", (tree, True)), *also.items()]
        seq_len = max(spec_seq_len(prompts, args.max_new_tokens, t) for _, (t, _) in trees)  # shared caches
        for name, (t, ahead) in trees:
            fns[name], stats[name], _ = spec_decode_fn(model, head, prompts, args.max_new_tokens, t,
                                                       compile_steps=True, draft_ahead=ahead,
                                                       max_seq_len=seq_len)
        warmup_s = {name: round(warm_up(fn, prompts), 2) for name, fn in fns.items()}
        runs[b] = {"also": {name: {"spec": [], "tau": None} for name in also},
                   "fns": fns, "stats": stats, "model": model, "attention": attention,
                   "attention_scores": attention_scores, "wrapper": wrapper,
                   "dot": dot, "amx": amx, "quantization": quantization, "warmup_s": warmup_s,
                   "plain": [], "spec": [], "tau": None}
        print(f"{b}: warm-up {runs[b]['warmup_s']}", flush=True)
    want: dict[str, list] = {}  # each run's tokens, for its next rounds
    for r in range(args.rounds):
        for b, run in runs.items():
            avx2_attention.enable(run["attention"])
            if run["attention_scores"]:
                avx2_attention.set_bf16_scores(run["attention_scores"])
            if bf16_linear.supported():
                bf16_linear.set_amx(run["amx"])
            use_wrapper(run["wrapper"])
            for st in run["stats"].values():
                st.__init__()
            res = time_interleaved(run["fns"], prompts)
            p, s = res["plain"], res["spec"]
            run["plain"].append(p.tokens_per_s)
            run["spec"].append(s.tokens_per_s)
            run["tau"] = round(run["stats"]["spec"].acceptance_length(), 3)
            # fp32: every backend's tokens, plain and speculative, are the first plain run's; bf16
            # rounds differently per kernel and per row count, so each run keeps its own tokens
            if args.dtype == "fp32":
                want.setdefault("plain", p.outputs)
                assert p.outputs == want["plain"] and s.outputs == want["plain"], b
            else:
                assert want.setdefault(b, p.outputs) == p.outputs, b
                assert want.setdefault(b + " spec", s.outputs) == s.outputs, b
            line = (f"round {r} {b}: plain {p.tokens_per_s:.1f} tok/s, spec {s.tokens_per_s:.1f} "
                    f"(tau {run['tau']})")
            for name in also:
                run["also"][name]["spec"].append(res[name].tokens_per_s)
                run["also"][name]["tau"] = round(run["stats"][name].acceptance_length(), 3)
                line += f", {name} {res[name].tokens_per_s:.1f} (tau {run['also'][name]['tau']})"
            print(line, flush=True)
    out = {"machine": machine_info(args.dtype, "cpu"), "prompts": len(prompts), "prompt_file": args.prompts,
           "prompt_tokens": [len(p) for p in prompts],
           "per_category": args.per_category,
           "max_new_tokens": args.max_new_tokens, "tree": tree.label(), "rounds": args.rounds, "backends": {}}
    for b, run in runs.items():
        plain, spec = statistics.median(run["plain"]), statistics.median(run["spec"])
        also_trees = {name: {"spec_tokens_per_s": round(statistics.median(a["spec"]), 2),
                             "spec_runs": [round(x, 2) for x in a["spec"]], "tau": a["tau"]}
                      for name, a in run["also"].items()}
        out["backends"][b] = {"plain_tokens_per_s": round(plain, 2), "spec_tokens_per_s": round(spec, 2),
                              "spec_vs_plain": round(spec / plain, 3), "tau": run["tau"],
                              "plain_runs": [round(x, 2) for x in run["plain"]],
                              "spec_runs": [round(x, 2) for x in run["spec"]], "warmup_s": run["warmup_s"],
                              "attention": ((run["attention_scores"] or "loops") if run["attention"]
                                            else "sdpa"),
                              "inductor_wrapper": run["wrapper"], "bf16_dot": run["dot"],
                              "quantization": run["quantization"],
                              "fused_layers": run["model"].fused_layers is not None,
                              "also_trees": also_trees}
        print(f"{b}: plain {plain:.1f}, spec {spec:.1f} tok/s ({spec / plain:.2f}x plain), tau {run['tau']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
