"""Tool calls against vLLM's: the same chat requests with `tools` (a named function, "required"
with and without parallel calls, "auto" and "none") to our server (speculative with the shipped
EAGLE-3 head, and plain) and to vLLM for CPU's OpenAI server, plain, all fp32 (--dtype), greedy, with the
same chat template (conf/chat_templates/smollm2_tools.jinja) and tool-call parser (hermes).
Each answer is compared as (content, [(name, arguments)], finish_reason); call ids are random.
The tools say "strict": true, so that vLLM 0.32 pins their arguments to their schemas as we do
(without, it constrains only the call's envelope); forced calls are then written under the same
grammar in both: the hermes envelope around each tool's schema.

    python scripts/probe_vllm_tools.py --json results/vllm_tools_zen1.json
    python scripts/probe_vllm_tools.py --no-vllm --json results/tools_tau_zen1.json  # and τ per setting
    python scripts/probe_vllm_tools.py --no-vllm --dtype bf16 --json results/tools_tau_bf16_zen4.json
    python scripts/probe_vllm_tools.py --dtype bf16 --vllm-head --json results/tools_vs_vllm_bf16_zen4.json

Each server also gets a setting's tokens per second (its answers' completion tokens over their
wall time, one request at a time, after an untimed request of that setting: xgrammar's import and
the grammar's compilation are not timed). `--vllm-head` adds vLLM with our EAGLE-3 head (k=3).

vLLM runs in its own environment (scripts/vllm_env.sh), as in scripts/bench_server.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = ROOT / "conf" / "chat_templates" / "smollm2_tools.jinja"
TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The current weather in a city", "strict": True,
             "parameters": {"type": "object", "properties": {
                 "city": {"type": "string", "maxLength": 24},
                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                 "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {
             "name": "search_web", "description": "Search the web", "strict": True,
             "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40}},
                            "required": ["query"], "additionalProperties": False}}}]
QUESTIONS = ["What's the weather like in Paris today?", "Is it going to rain in Tokyo?",
             "Find recent news about electric cars.", "Who won the last football world cup?",
             "How warm is it in Cairo, in fahrenheit?", "Tell me a joke about cats."]
CHOICES: dict[str, Any] = {"named": {"type": "function", "function": {"name": "get_weather"}},
                           "required": "required", "required-single": "required", "auto": "auto",
                           "none": "none"}


def answer(url: str, model: str, question: str, setting: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "tools": TOOLS,
            "tool_choice": CHOICES[setting], "max_tokens": max_tokens, "temperature": 0}
    if setting == "required-single":
        body["parallel_tool_calls"] = False
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        return {"status": r.status_code, "error": r.text[:300]}
    choice = r.json()["choices"][0]
    msg = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    spec = r.json()["usage"].get("speculative")  # ours: rounds and accepted drafts
    return {"content": msg.get("content") or "", "calls": calls, "finish_reason": choice["finish_reason"],
            "tokens": r.json()["usage"]["completion_tokens"], "seconds": round(seconds, 4),
            **({"speculative": spec} if spec else {})}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Answers alike: content, calls and finish reason (not the speculative statistics)."""
    return all(a.get(k) == b.get(k) for k in ("content", "calls", "finish_reason", "status"))


def servers(args: argparse.Namespace) -> list[tuple[str, list[str] | None, list[str], dict[str, str]]]:
    from eagle_infer.default_model import resolve_model_path
    from eagle_infer.vllm_client import vllm_cpu_env, vllm_python

    tools = ["--chat-template", str(TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    ours = ["--dtype", args.dtype, "--context-length", "2048"] + tools
    python = vllm_python()
    model = str(resolve_model_path("default"))
    vllm = ([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model],
            ["--dtype", {"fp32": "float32", "bf16": "bfloat16"}[args.dtype], "--max-model-len", "2048",
             "--max-num-seqs", "4",
             "--served-model-name", MODEL] + tools,
            # a KV cache of 4 GiB, not most of the machine (its default), which other processes share
            vllm_cpu_env(python) | {"VLLM_CPU_KVCACHE_SPACE": "4"})
    from eagle_infer.default_model import default_head_path

    head = {"method": "eagle3", "model": str(default_head_path("eagle3")), "num_speculative_tokens": 3}
    vllm_spec = (vllm[0], vllm[1] + ["--speculative-config", json.dumps(head)], vllm[2])
    return [("ours-spec", None, ours + ["--speculative-algorithm", "EAGLE3"], {}),
            ("ours-plain", None, ours + ["--speculative-algorithm", "NONE"], {}),
            ("vllm", *vllm), ("vllm-spec", *vllm_spec)][: 4 if args.vllm_head else 3 if args.vllm else 2]


def main() -> None:
    from eagle_infer.launch import ServerProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="results/vllm_tools.json")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="both servers' (in bf16 answers may differ with the kernels' rounding)")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="ours only (spec against plain)")
    ap.add_argument("--vllm-head", action="store_true", help="also vLLM with our EAGLE-3 head, k=3")
    args = ap.parse_args()
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name, program, flags, env in servers(args):
        server = ServerProcess(flags, Path(args.json).with_suffix(f".{name}.log"), env=env, program=program)
        t0 = time.time()
        try:
            server.wait_ready(900)
            print(f"{name}: ready in {time.time() - t0:.0f} s", file=sys.stderr)
            out[name] = {}
            for s in CHOICES:
                answer(server.url, MODEL, QUESTIONS[0], s, 8)  # untimed: imports, the grammar's compilation
                out[name][s] = [answer(server.url, MODEL, q, s, args.max_tokens) for q in QUESTIONS]
        finally:
            server.stop()
    names = list(out)
    summary = {}
    for s in CHOICES:
        row = {f"{a}=={b}": sum(same(x, y) for x, y in zip(out[a][s], out[b][s]))
               for i, a in enumerate(names) for b in names[i + 1:]}
        row["calls"] = [len(x.get("calls", [])) for x in out[names[0]][s]]
        for name in names:  # one request at a time: tokens over wall time, as a client sees it
            done = [x for x in out[name][s] if "tokens" in x]
            row[f"{name}_tokens_per_s"] = round(sum(x["tokens"] for x in done)
                                                / max(sum(x["seconds"] for x in done), 1e-9), 2)
        rounds = [x["speculative"] for x in out[names[0]][s] if "speculative" in x]
        if rounds:  # the speculative server's acceptance length over the setting's answers
            accepted, n = sum(x["accepted_tokens"] for x in rounds), sum(x["rounds"] for x in rounds)
            row["tau"] = round(1 + accepted / n, 3)
        summary[s] = row
        print(s, row, file=sys.stderr)
    Path(args.json).write_text(json.dumps({"questions": QUESTIONS, "tools": TOOLS, "settings": CHOICES,
                                           "max_tokens": args.max_tokens, "summary": summary,
                                           "answers": out}, indent=1) + "\n")
    print(f"written: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
