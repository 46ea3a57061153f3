"""When does a short prompt that arrives during a long prompt's chunked prefill get its first
token? The server's engine (eagle_infer.server.build_engine, the flags below; eager steps by
default so that no compilation weighs), two requests decoding, then a long prompt
(data/long_prompts.jsonl's first) and, 50 ms later, a short one: each one's first token, in
seconds from the long one's arrival. Run it at two revisions to weigh a scheduling change.

    python scripts/probe_chunked_join.py --dtype bf16 --disable-torch-compile
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from eagle_infer.sampling import SamplingParams
from eagle_infer.server import Job, build_engine, build_parser

REPO = Path(__file__).resolve().parent.parent


async def first_tokens(engine, tokenizer, eos: set[int]) -> dict[str, float]:
    loop = asyncio.get_running_loop()

    def job(prompt: list[int], n: int) -> Job:
        return Job(prompt, SamplingParams(), n, [], eos, tokenizer, loop)

    long_prompt = json.loads((REPO / "data" / "long_prompts.jsonl").open().readline())["prompt"]
    short = tokenizer.encode("Name three colors.")
    running = [job(short, 400), job(short + [13], 400)]
    for r in running:
        engine.submit(r)
    for r in running:
        await r.events.get()  # decoding
    t0 = time.perf_counter()
    arrivals = {"long": job(tokenizer.encode(long_prompt), 4)}
    engine.submit(arrivals["long"])
    await asyncio.sleep(0.05)
    arrivals["short"] = job(short + [11], 4)
    engine.submit(arrivals["short"])
    out = {"long_prompt_tokens": len(arrivals["long"].seq.prompt)}

    async def first(name: str) -> None:
        await arrivals[name].events.get()
        out[f"{name}_first_token_s"] = round(time.perf_counter() - t0, 3)

    await asyncio.gather(*(first(name) for name in arrivals))
    for r in running:
        engine.cancel(r)
    return out


def main() -> None:
    args = build_parser().parse_args(["--max-running-requests", "4"] + sys.argv[1:])
    engine, tokenizer, eos, _ = build_engine(args)
    engine.start()
    try:
        print(json.dumps(asyncio.run(first_tokens(engine, tokenizer, eos))))
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
