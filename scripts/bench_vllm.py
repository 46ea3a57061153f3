"""The same decoding benchmark as `python -m eagle_infer.bench` (MT-bench, or `--prompts FILE`),
run through vLLM for CPU (the engine to beat on this hardware): plain decoding and with our EAGLE
heads.

    python scripts/bench_vllm.py                                  # plain + shipped EAGLE-3 head, k=3
    python scripts/bench_vllm.py --heads heads/SmolLM2-135M-Instruct-eagle3 \
        heads/SmolLM2-135M-Instruct-eagle2 --num-speculative-tokens 3 --ours --json results/bench_vllm.json

vLLM pins its own torch and transformers, so it runs in its own virtual environment
(`scripts/vllm_env.sh` builds it once). This file plays two parts: run with the project's
Python it tokenizes the prompts exactly as our bench does (chat template, first MT-bench
turns), starts one vLLM engine per configuration (`eagle_infer/vllm_client.py`: a worker
process run by the vLLM environment's Python), and writes one JSON whose fields follow our bench's: per method
`tokens`, `seconds`, `tokens_per_s`, `per_prompt`, plus `warmup_s` (engine start-up and first
request, never inside tokens/s) and, with a head, `acceptance_length` (tau = accepted drafts
per round + 1) and `accept_rate_per_position` from vLLM's own spec-decode counters
(`vllm:spec_decode_num_drafts`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`).
vLLM drafts chains only: k draft tokens per round. `--ours` runs our bench on the same prompts
in the same sitting (plain, and chain drafting with the same k) and adds its numbers;
`--llamacpp` adds llama.cpp's plain decoding of the target's Q4_1 GGUF (scripts/bench_llamacpp.py).
`--ngram K` adds prompt lookup without a head: vLLM's ngram method (chains of K, matches of 1-4
tokens) and, with `--ours`, ours (the bench's `--ngram K`, taking turns with our plain).
`--structured-output` (as our bench's: json | regex:PATTERN | json_schema:FILE) decodes under that
grammar in every engine (vLLM's `structured_outputs`: json_object, regex, json; both with
xgrammar), stopping where the grammar ends (at its stop token, EOS ignored or not).
`--batch-size B`: B prompts at a time, in order, in every engine (one vLLM `generate` call per
batch, as our bench's calls; vLLM always drafts, so our chain at B > 1 speculates at every batch
size too, while our default tree keeps the server's batch defaults).
vLLM runs on every core with Intel's OpenMP preloaded (`eagle_infer.vllm_client.vllm_cpu_env`,
recorded as `vllm_env`): its own default keeps a core for its scheduler, one of two here;
`VLLM_CPU_OMP_THREADS_BIND=auto` in the environment gives that default back.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from eagle_infer.tree import NGRAM_MAX  # noqa: E402
from eagle_infer.vllm_worker import PER_POS, SPEC_COUNTERS  # noqa: E402  (stdlib-only module)

# ---------------------------------------------------------------------------------------
# Driver (the project's environment); vLLM runs in eagle_infer/vllm_worker.py.


def head_method(head_dir: Path) -> str:
    """vLLM's method name for a head folder: eagle3 for EAGLE-3 configs, else eagle."""
    cfg = json.loads((head_dir / "config.json").read_text())
    eagle3 = ("LlamaForCausalLMEagle3" in cfg.get("architectures", [])
              or cfg.get("speculators_model_type") == "eagle3")
    return "eagle3" if eagle3 else "eagle"


def run_vllm(model: str, prompts: list[list[int]], *, head: Path | None, k: int, max_new_tokens: int,
             dtype: str, ignore_eos: bool, enforce_eager: bool, python: str | None = None,
             llm_args: dict | None = None, one_call: bool = False, batch_size: int = 1,
             structured_outputs: dict | None = None, spec: dict | None = None) -> dict:
    """One vLLM configuration in its own worker process: outputs, timings, spec counters.
    llm_args: more vllm.LLM arguments (the bench leaves vLLM's defaults). one_call: all prompts
    in one batch and no warm-up call, for checks of outputs and acceptance, not of speed (the
    interop tests: 4 prompts x 64 tokens took 21 s one by one on the 2-core EPYC). batch_size:
    prompts per generate call, in order (the warm-up call has as many); seconds are per call.
    structured_outputs: vLLM's StructuredOutputsParams fields (e.g. {"json": schema}); the grammar's
    end then stops a sequence, so EOS is not ignored. spec: vLLM's speculative config itself (its
    ngram method: no head), else the head's."""
    from eagle_infer.bench import batches
    from eagle_infer.vllm_client import VLLMEngine

    if head is not None:
        spec = {"method": head_method(head), "model": str(head), "num_speculative_tokens": k}
    max_len = max(256, max(len(p) for p in prompts) + max_new_tokens + k + 8)
    params = {"temperature": 0.0, "max_tokens": max_new_tokens, "ignore_eos": ignore_eos}
    if structured_outputs:
        params |= {"structured_outputs": structured_outputs, "ignore_eos": False}
    with VLLMEngine(model, dtype=dtype, speculative_config=spec, enforce_eager=enforce_eager,
                    max_model_len=max_len, python=python, **(llm_args or {})) as llm:
        first = prompts[:batch_size]  # warm-up, as our bench: one call of a batch's size
        first_s = 0.0 if one_call else llm.generate(first, [params] * len(first))[1]
        warmup_s = llm.startup_s + first_s
        before = llm.spec_counts()
        if one_call:
            outputs, secs = llm.generate(prompts, [params] * len(prompts))
            seconds = [secs / len(prompts)] * len(prompts)
        else:
            outputs, seconds = [], []
            for batch in batches(prompts, batch_size):  # batch after batch, as our bench
                out, secs = llm.generate(batch, [params] * len(batch))
                outputs.extend(out)
                seconds.append(secs)
        after = llm.spec_counts()
    result: dict = {"outputs": outputs, "seconds": seconds, "warmup_s": warmup_s, "env": llm.env}
    if spec:
        delta = {k_: after[k_] - before[k_] for k_ in SPEC_COUNTERS}
        pos = [a - b for a, b in zip(after[PER_POS], before[PER_POS] or [0] * len(after[PER_POS]))]
        result["spec"] = {**delta, "accepted_per_pos": pos}
    return result


def summarize(raw: dict, k: int, batch_size: int = 1) -> dict:
    """Our bench's fields for one vLLM run (per_prompt at batch 1, else per_batch)."""
    from eagle_infer.bench import batches

    tokens = sum(len(o) for o in raw["outputs"])
    secs = sum(raw["seconds"])
    per_call = [{"tokens": sum(len(o) for o in c), "seconds": round(s, 4)}
                for c, s in zip(batches(raw["outputs"], batch_size), raw["seconds"])]
    out = {"tokens": tokens, "seconds": round(secs, 4), "tokens_per_s": round(tokens / secs, 3),
           "per_prompt" if batch_size == 1 else "per_batch": per_call, "warmup_s": round(raw["warmup_s"], 2)}
    if "spec" in raw:
        s = raw["spec"]
        drafts = s["vllm:spec_decode_num_drafts"]
        out.update({
            "num_speculative_tokens": k,
            "num_drafts": drafts,
            "num_draft_tokens": s["vllm:spec_decode_num_draft_tokens"],
            "num_accepted_tokens": s["vllm:spec_decode_num_accepted_tokens"],
            "accepted_per_pos": s["accepted_per_pos"],
            "acceptance_length": round(1 + s["vllm:spec_decode_num_accepted_tokens"] / drafts, 3)
            if drafts else None,
            "accept_rate_per_position": [round(a / drafts, 4) for a in s["accepted_per_pos"]]
            if drafts else [],
        })
    return out


def cpu_info() -> dict:
    from eagle_infer.loader import cpuinfo_field

    flags = cpuinfo_field("flags")
    return {"cpu": cpuinfo_field("model name") or platform.processor(), "cpu_count": os.cpu_count(),
            "cpu_family_model": f"{cpuinfo_field('cpu family')}/{cpuinfo_field('model')}",
            "avx512f": " avx512f" in flags,
            "avx512_bf16": " avx512_bf16" in flags, "amx_bf16": " amx_bf16" in flags,
            "python": platform.python_version()}


def spec_entry(r: dict) -> dict:
    """The fields of our bench's speculative report that the sitting's JSON keeps: tokens/s,
    tau, TTFT / TPOT, and the run's own plain decoding with a round's cost against its TPOT."""
    spec = next(m for name, m in r["methods"].items() if name != "plain")
    keep = ("tree", "acceptance_length", "accept_rate_per_position", "plain_tokens_per_s", "plain_step_ms",
            "verify_vs_plain_step", "draft_step_vs_plain_step", "round_vs_plain_step")
    return {"tokens_per_s": r["tokens_per_s"], "ttft_ms": spec.get("ttft_ms"), "tpot_ms": spec.get("tpot_ms"),
            "speedup_vs_ours_plain": r["speedup_vs_plain"], **{k: r.get(k) for k in keep}}


def run_ours(args: argparse.Namespace, head: Path | None, tree: tuple[int, int, int] | str | None = None,
             quantization: str = "none") -> dict:
    """Our bench on the same prompts and settings (plain; chain drafting with the same k and no
    n-gram branch, or the draft tree `tree` = (num_steps, eagle_topk, num_draft_tokens), or
    "default": no tree flags, so the bench takes the tree a server runs with that quantization,
    n-gram branch included); quantization
    "int8": our target with int8 weights (vLLM's runs stay unquantized)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ours.json"
        cmd = [sys.executable, "-m", "eagle_infer.bench", "--model-path", args.model_path,
               "--num-prompts", str(args.num_prompts),
               *(["--prompts", args.prompts] if args.prompts else []),
               "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype, "--no-hf",
               "--quantization", quantization, "--batch-size", str(args.batch_size), "--json", str(out)]
        if head is None:
            cmd.append("--no-spec")
            if args.ngram and quantization == "none":
                cmd += ["--ngram", str(args.ngram)]
        else:
            cmd += ["--draft", str(head)]
            if tree != "default":
                k = args.num_speculative_tokens
                steps, topk, n = tree or (k, 1, k + 1)
                cmd += ["--num-steps", str(steps), "--eagle-topk", str(topk), "--num-draft-tokens", str(n)]
            if tree is None:  # chain drafting as vLLM's, without the CPU default's n-gram branch,
                # drafting at every batch size as vLLM does
                cmd += ["--ngram-branch", "0", "--speculative-disable-by-batch-size", str(args.batch_size),
                        "--speculative-batch-tree", "none"]
        if args.stop_at_eos:
            cmd.append("--stop-at-eos")
        if args.structured_output:
            cmd += ["--structured-output", args.structured_output]
        subprocess.run(cmd, check=True, cwd=ROOT)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default", help="HF folder; 'default' = embedded SmolLM2")
    ap.add_argument("--heads", nargs="*", default=None,
                    help="head folders to serve in vLLM (default: the shipped EAGLE-3 head)")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--prompts", default=None,
                    help="a .jsonl / .json prompt file as the bench takes (default: MT-bench first turns)")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1, help="prompts at a time, in order, in every engine")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="stop at EOS (default: ignore it, like our bench)")
    ap.add_argument("--structured-output", default=None, metavar="json | regex:PATTERN | json_schema:FILE",
                    help="decode under a grammar in all engines (as our bench; vLLM: structured_outputs)")
    ap.add_argument("--enforce-eager", action="store_true", help="skip vLLM's compilation (faster start)")
    ap.add_argument("--no-plain", action="store_true", help="skip vLLM's plain decoding")
    ap.add_argument("--ours", action="store_true", help="also run our bench on the same prompts")
    ap.add_argument("--ours-tree", nargs="+", default=None, metavar="STEPS TOPK N | default",
                    help="with --ours: also our tree drafting with each head (e.g. 2 4 4); 'default': "
                    "each run's CPU default (TreeConfig.default_for; `python -m eagle_infer.bench --help` "
                    "lists them)")
    ap.add_argument("--ours-int8", action="store_true",
                    help="with --ours: also our plain and tree (--ours-tree) decoding with int8 weights")
    ap.add_argument("--ngram", type=int, default=None, metavar="K",
                    help="also prompt lookup without a head, chains of K: vLLM's ngram method (matches "
                         "of 1-4 tokens) and, with --ours, ours (the bench's --ngram K, beside our plain)")
    ap.add_argument("--llamacpp", action="store_true",
                    help="also llama.cpp's plain decoding of the target's Q4_1 GGUF (bench_llamacpp.py)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.ours_tree and args.ours_tree != ["default"] and not (
            len(args.ours_tree) == 3 and all(v.isdigit() for v in args.ours_tree)):
        ap.error(f"--ours-tree takes three numbers (STEPS TOPK N) or 'default', "
                 f"not {' '.join(args.ours_tree)}")

    if args.llamacpp and args.model_path != "default":
        ap.error("--llamacpp runs the embedded default's Q4_1 GGUF only: drop it or --model-path")

    from eagle_infer.api_schema import STRUCTURED_KINDS
    from eagle_infer.bench import load_prompts, structured_output_arg
    from eagle_infer.default_model import default_head_path, resolve_model_path
    from eagle_infer.loader import load_tokenizer

    model = str(resolve_model_path(args.model_path))
    tokenizer = load_tokenizer(model)
    prompts = load_prompts(args.prompts, args.num_prompts, tokenizer)
    heads = ([Path(h) for h in args.heads] if args.heads is not None
             else [default_head_path("eagle3")])
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]
    k = args.num_speculative_tokens
    structured = None
    if args.structured_output:  # our kind and source as vLLM's field: json_object, regex or json
        kind, source = structured_output_arg(args.structured_output)
        field = next(f for f, ours in STRUCTURED_KINDS.items() if ours == kind)
        structured = {field: True if kind == "json" else source}
    common = dict(max_new_tokens=args.max_new_tokens, dtype=dtype, ignore_eos=not args.stop_at_eos,
                  enforce_eager=args.enforce_eager, k=k, batch_size=args.batch_size,
                  structured_outputs=structured)
    methods: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    # (name, head, vLLM's speculative config where no head gives it)
    runs = ([] if args.no_plain else [("vllm plain", None, None)]) + [(f"vllm {h.name} k{k}", h, None)
                                                                      for h in heads]
    if args.ngram:
        runs.append((f"vllm ngram k{args.ngram}", None, {
            "method": "ngram", "num_speculative_tokens": args.ngram, "prompt_lookup_min": 1,
            "prompt_lookup_max": NGRAM_MAX}))
    for name, head, ngram in runs:
        print(f"[bench_vllm] {name} ...", file=sys.stderr, flush=True)
        k_run = args.ngram if ngram else k
        raw = run_vllm(model, prompts, head=head, spec=ngram, **(common | {"k": k_run}))
        methods[name] = summarize(raw, k_run, args.batch_size)
        outputs[name] = raw["outputs"]
        print(f"[bench_vllm] {name}: {methods[name]['tokens_per_s']} tok/s"
              + (f", tau {methods[name]['acceptance_length']}" if head or ngram else ""), file=sys.stderr)

    if args.llamacpp:
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_llamacpp import run_llamacpp

        print("[bench_vllm] llama.cpp Q4_1 plain ...", file=sys.stderr, flush=True)
        methods["llama.cpp Q4_1 plain"], outputs["llama.cpp Q4_1 plain"] = run_llamacpp(
            prompts, args.max_new_tokens)

    result: dict[str, object] = {
        "engine": "vllm-cpu 0.32.0",
        "settings": {"model_path": model, "prompts": args.prompts or "MT-bench first turns",
                     "num_prompts": len(prompts),
                     "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": args.max_new_tokens,
                     "dtype": args.dtype, "batch_size": args.batch_size, "greedy": True,
                     "ignore_eos": not args.stop_at_eos, "num_speculative_tokens": k,
                     "enforce_eager": args.enforce_eager, "structured_output": args.structured_output},
        "machine": cpu_info(),
        "vllm_env": raw["env"] if runs else {},  # what vllm_cpu_env added (threads bound, OpenMP)
        "methods": methods,
        "outputs": outputs,
    }
    plain = methods.get("vllm plain")
    if plain:
        result["plain_tokens_per_s"] = plain["tokens_per_s"]
        for name, m in methods.items():
            if name != "vllm plain":
                m["speedup_vs_vllm_plain"] = round(m["tokens_per_s"] / plain["tokens_per_s"], 3)
                m["greedy_identical_to_vllm_plain"] = outputs[name] == outputs["vllm plain"]
    if args.ours:
        ours_plain = run_ours(args, None)
        result["ours"] = {"plain": ours_plain["methods"]["plain"]}
        if args.ngram:  # the bench's prompt lookup, taking turns with its own plain
            ng = ours_plain["ngram"]
            result["ours"][ng["method"]] = {"tokens_per_s": ng["tokens_per_s"],
                                            "acceptance_length": ng["acceptance_length"],
                                            "speedup_vs_ours_plain": ng["speedup_vs_plain"],
                                            "verify_rounds": ng["verify_rounds"],
                                            "plain_rounds": ng["plain_rounds"]}
        trees = [(f"chain k{k}", None)]
        if args.ours_tree == ["default"]:
            trees.append(("default tree", "default"))
        elif args.ours_tree:
            trees.append((f"tree {'/'.join(args.ours_tree)}", tuple(int(v) for v in args.ours_tree)))
        for h in heads:
            for label, tree in trees:
                result["ours"][f"{h.name} {label}"] = spec_entry(run_ours(args, h, tree))
        if args.ours_int8:  # plain, and the last of the drafting settings (the tree, if asked)
            result["ours"]["int8 plain"] = run_ours(args, None, quantization="int8")["methods"]["plain"]
            label, tree = trees[-1]
            for h in heads:
                r = run_ours(args, h, tree, quantization="int8")
                result["ours"][f"int8 {h.name} {label}"] = spec_entry(r) | {
                    "greedy_agreement_spec_vs_plain": r["greedy_agreement_spec_vs_plain"]}
    if args.ours and plain:
        for m in result["ours"].values():
            m["vs_vllm_plain"] = round(m["tokens_per_s"] / plain["tokens_per_s"], 3)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    rows = [*methods.items(), *[(f"ours {n}", m) for n, m in result.get("ours", {}).items()]]
    print("\n".join(f"{n}: {m['tokens_per_s']} tok/s" + (f", tau {m['acceptance_length']}"
                                                           if m.get("acceptance_length") else "")
                    for n, m in rows))


if __name__ == "__main__":
    main()
