"""A chat's next turn whose new text is longer than a chunk: how long its chunked prefill and join
take. The server's decoder (eagle_infer.server.build_engine, the flags below; eager steps by
default so that no compilation weighs) answers a long prompt (data/long_prompts.jsonl), then
takes a next turn, that prompt + its answer + 400 tokens of another long prompt, in
--chunked-prefill-size chunks as the engine writes them, and joins it: seconds from the first
chunk to the join, and the prompt tokens it took from the cache. Run it at two revisions to
weigh a change.

    python scripts/probe_chunked_next_turn.py --dtype bf16 --disable-torch-compile
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from eagle_infer.sampling import SamplingParams
from eagle_infer.server import build_engine, build_parser
from eagle_infer.speculative import Sequence_

REPO = Path(__file__).resolve().parent.parent
NEW_TOKENS = 400  # the next turn's new text


def main() -> None:
    args = build_parser().parse_args(["--max-running-requests", "4"] + sys.argv[1:])
    engine, tokenizer, _, _ = build_engine(args)
    dec, chunk = engine.dec, engine.chunk
    longs = [tokenizer.encode(json.loads(line)["prompt"])
             for line in (REPO / "data" / "long_prompts.jsonl").read_text().splitlines()]
    turns = []
    for i in range(6):
        first = Sequence_([500 + i] + longs[i], SamplingParams(), 16, set())
        dec.add(first)
        while dec.seqs:
            dec.step()
        nxt = Sequence_(first.prompt + first.output + longs[8 + i][:NEW_TOKENS], SamplingParams(), 1, set())
        start = time.perf_counter()
        while dec.rows.left_to_prefill(nxt) > chunk:
            dec.prefill_chunk(nxt, chunk)
        dec.add(nxt)
        turns.append({"prompt_tokens": len(nxt.prompt), "cached": nxt.prefix_hit,
                      "seconds": round(time.perf_counter() - start, 3)})
        while dec.seqs:
            dec.step()
    print(json.dumps({"chunk": chunk, "median_seconds": statistics.median(t["seconds"] for t in turns),
                      "turns": turns}))


if __name__ == "__main__":
    main()
