"""A vLLM engine behind a pipe: runs in vLLM's own virtual environment (scripts/vllm_env.sh), so
it imports the standard library and vllm only, never the rest of this package.

    <vllm-env>/bin/python eagle_infer/vllm_worker.py '<LLM kwargs as JSON>'

One JSON object per line on stdin, one answer per line on stdout (vLLM's own logging goes to
stderr):
    {"cmd": "generate", "prompts": [[ids]], "params": [{"temperature", "top_p", "seed",
     "max_tokens", "ignore_eos", "stop_token_ids"}]}   -> {"outputs": [[ids]], "seconds": s}
    {"cmd": "spec_counts"}                              -> vLLM's spec-decode counters so far
    {"cmd": "quit"}
The first line written is {"ready": true, "startup_s": s} once the engine is up.
`eagle_infer.vllm_client.VLLMEngine` is the other end.
"""

from __future__ import annotations

import json
import os
import sys
import time

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counts(llm) -> dict:
    """vLLM's spec-decode counters, summed over engines; per-position acceptance as a list."""
    out: dict = {name: 0 for name in SPEC_COUNTERS}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[m.name] += m.value
        elif m.name == PER_POS:
            per_pos = [a + b for a, b in zip(per_pos, m.values)] if per_pos else list(m.values)
    out[PER_POS] = per_pos
    return out


def main() -> None:
    # Run as a script, its own folder (eagle_infer/) would lead sys.path, and our subpackages
    # would shadow pip packages of the same name (transformers probes for `kernels`).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    # Answers go to the original stdout; anything vLLM (or its C++ side, or a child process)
    # writes to stdout lands on stderr instead, so it cannot corrupt them.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    t0 = time.perf_counter()
    llm = LLM(**json.loads(sys.argv[1]))
    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - t0}), file=reply, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "quit":
            break
        if req["cmd"] == "spec_counts":
            answer = spec_counts(llm)
        elif req["cmd"] == "generate":
            prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
            # structured_outputs came as a dict (JSON): vLLM's own type
            params = [SamplingParams(**{k: StructuredOutputsParams(**v) if k == "structured_outputs" else v
                                        for k, v in p.items()}) for p in req["params"]]
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            answer = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                      "seconds": time.perf_counter() - t}
        else:
            answer = {"error": f"unknown cmd {req['cmd']!r}"}
        print(json.dumps(answer), file=reply, flush=True)


if __name__ == "__main__":
    main()
