"""What the server's engine costs over decoding on the decoder directly, without HTTP: the
decoder `eagle_infer.server.build_engine` builds from the server's flags (loaded in a thread that
exits, as the server loads it), one request at a time, two ways taking turns request by request
(the machine's drift weighs on both alike), both on one long-lived thread:

    direct   add the prompt, step until it ends (bench_server --direct's way);
    engine   a Job submitted to the Engine and its iterations run (Engine._loop's: detokenizing
             each token, metrics, the job's events pushed to an asyncio loop running in another
             thread, as uvicorn's).

One thread for both: libgomp keeps an OpenMP team for every thread that ran a parallel region,
and a second team alive slows every parallel region of the process (eagle_infer.server's
in_own_thread), so a side on another thread would measure that instead.

    python scripts/probe_engine_overhead.py --mode none --num-prompts 10 --json results/x.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

from eagle_infer import server as srv
from eagle_infer.bench import load_prompts, machine_info
from eagle_infer.sampling import SamplingParams
from eagle_infer.speculative import Sequence_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["none", "spec"], default="none")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--stream", action="store_true", help="the engine's jobs stream (an event per token)")
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    flags = ["--max-running-requests", "1", "--speculative-algorithm",
             "NONE" if args.mode == "none" else "EAGLE3", *args.server_arg]
    engine, tok, _, _ = srv.in_own_thread(srv.build_engine, srv.build_parser().parse_args(flags), True)
    dec = engine.dec
    prompts = load_prompts(None, args.num_prompts, tok)
    loop = asyncio.new_event_loop()  # uvicorn's: receives the jobs' events, runs no torch op
    threading.Thread(target=loop.run_forever, name="event-loop", daemon=True).start()

    step_s, steps = [0.0], [0]
    step = dec.step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        step_s[0] += time.perf_counter() - t0
        steps[0] += 1
        return out

    dec.step = timed_step

    def direct(prompt: list[int]) -> list[int]:
        seq = Sequence_(prompt, SamplingParams(), args.max_tokens, set())
        dec.add_many([seq])
        while dec.seqs:
            dec.step()
        return seq.output

    def via_engine(prompt: list[int]) -> list[int]:
        async def make() -> srv.Job:  # a Job's queue belongs to the loop
            return srv.Job(prompt, SamplingParams(), args.max_tokens, [], set(), engine.tokenizer, loop,
                           stream=args.stream)

        job = asyncio.run_coroutine_threadsafe(make(), loop).result()
        engine.submit(job)
        while not job.finished:  # Engine._loop's iterations, on this thread
            with engine.cond:
                cancels, admit = engine._take()
            engine._iteration(cancels, admit)
        return job.seq.output

    sides = {"direct": direct, "engine": via_engine}
    seconds, tokens = dict.fromkeys(sides, 0.0), dict.fromkeys(sides, 0)
    outputs: dict[str, list[list[int]]] = {s: [] for s in sides}
    in_step, rounds = dict.fromkeys(sides, 0.0), dict.fromkeys(sides, 0)

    def run_all() -> None:
        for i, prompt in enumerate(prompts):
            for side in list(sides)[:: 1 if i % 2 == 0 else -1]:
                before, calls, t0 = step_s[0], steps[0], time.perf_counter()
                out = sides[side](prompt)
                seconds[side] += time.perf_counter() - t0
                tokens[side] += len(out)
                outputs[side].append(out)
                in_step[side] += step_s[0] - before
                rounds[side] += steps[0] - calls
            speeds = ", ".join(f"{s} {tokens[s] / seconds[s]:.1f}" for s in sides)
            print(f"request {i}: {speeds} tokens/s", flush=True)

    decode_thread = threading.Thread(target=run_all, name="decode")
    decode_thread.start()
    decode_thread.join()
    result = {
        "mode": args.mode, "stream": args.stream, "flags": flags, "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "tok_per_s": {s: round(tokens[s] / seconds[s], 2) for s in sides},
        "engine_vs_direct": round(seconds["direct"] / seconds["engine"], 3),
        # outside the decoder's steps: the prefill, and the engine's own work (detokenizing, metrics)
        "outside_step_ms_per_token": {s: round(1000 * (seconds[s] - in_step[s]) / tokens[s], 3)
                                      for s in sides},
        # a step's cost apart from how many tokens it gave (bf16: the sides' answers may differ)
        "step_ms": {s: round(1000 * in_step[s] / rounds[s], 3) for s in sides},
        "tokens_per_step": {s: round(tokens[s] / rounds[s], 3) for s in sides},
        "same_tokens": outputs["engine"] == outputs["direct"],
        "machine": machine_info(str(dec.target.embed_tokens.weight.dtype).removeprefix("torch."), "cpu"),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
