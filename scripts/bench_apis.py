"""The same answers through each API a running server speaks, streamed, one request at a time:
OpenAI's chat completions, OpenAI's Responses API, Anthropic's Messages API and SGLang's
/generate (the last three are bridges over the chat or completions path: this measures what the
bridging costs). Rounds alternate the APIs, so a drifting machine weighs on each alike.

    python -m eagle_infer.server &
    python scripts/bench_apis.py --url http://localhost:30000 --json results/bench_apis.json

Each request asks for --max-tokens tokens greedily with EOS ignored (ignore_eos passes through
every API), so each API decodes the same tokens; tokens/s = tokens / wall time of the request
(time to its last event), medians over rounds, and each API's ratio to chat's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import httpx

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how photosynthesis works.",
           "Give five tips for learning a new language.", "Describe the water cycle.",
           "What makes a good team leader?"]


def requests_for(prompt: str, model: str, max_tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each API's streamed request for the prompt: (path, body)."""
    extra = {"temperature": 0, "ignore_eos": True}
    chat = [{"role": "user", "content": prompt}]
    return {
        "chat": ("/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": max_tokens,
                                          "stream": True} | extra),
        "responses": ("/v1/responses", {"model": model, "input": prompt, "max_output_tokens": max_tokens,
                                        "stream": True, "store": False} | extra),
        "messages": ("/v1/messages", {"model": model, "messages": chat, "max_tokens": max_tokens,
                                      "stream": True} | extra),
        # /generate takes a raw prompt: the chat template's text, from /tokenize
        "generate": ("/generate", {"stream": True, "sampling_params": {
            "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}),
    }


def timed(http: httpx.Client, url: str, path: str, body: dict[str, Any]) -> float:
    """Seconds from sending the request to its stream's last line."""
    start = time.perf_counter()
    with http.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            pass
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://localhost:30000")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    http = httpx.Client(timeout=600)
    model = http.get(args.url + "/v1/models").json()["data"][0]["id"]
    bodies = []
    for prompt in PROMPTS:
        each = requests_for(prompt, model, args.max_tokens)
        chat = {"messages": [{"role": "user", "content": prompt}]}
        each["generate"][1]["input_ids"] = http.post(args.url + "/tokenize", json=chat).json()["tokens"]
        bodies.append(each)
    apis = list(bodies[0])
    for each in bodies:  # a warm-up round: lazily built parts, and every prompt in the prefix cache
        for api in apis:
            timed(http, args.url, *each[api])
    rates: dict[str, list[float]] = {api: [] for api in apis}
    for r in range(args.rounds):
        order = apis if r % 2 == 0 else apis[::-1]
        for api in order:
            seconds = sum(timed(http, args.url, *each[api]) for each in bodies)
            rates[api].append(len(bodies) * args.max_tokens / seconds)
        print(f"round {r + 1}: " + ", ".join(f"{api} {rates[api][-1]:.1f}" for api in apis), flush=True)
    medians = {api: statistics.median(v) for api, v in rates.items()}
    out = {"url": args.url, "model": model, "prompts": len(bodies), "max_tokens": args.max_tokens,
           "rounds": args.rounds, "tokens_per_s": rates, "median_tokens_per_s": medians,
           "vs_chat": {api: round(m / medians["chat"], 3) for api, m in medians.items()}}
    print(json.dumps(out["median_tokens_per_s"]), json.dumps(out["vs_chat"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
