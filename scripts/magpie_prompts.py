"""Fresh user prompts written by the target itself (Magpie: Xu et al. 2024, arXiv:2406.08464),
as a JSONL that `stage=capture` and scripts/gpu_grow.sh read like scripts/segment_prompts.py's.

Issue #14's data has run out: ShareGPT's first turns are all answered, and neither their later
turns (segment 8) nor sampled answers to them (segment 14) raised the head's first-answer tau.
An instruction-tuned target, given its chat template up to the start of a user turn and nothing
else, samples a user message from what it was tuned on; the capture then answers each one
greedily, on-policy. So a grow segment can have prompts no head has seen, as many as a machine
can write, at the cost of the prompts' diversity (exact and normalised duplicates are dropped and
counted; the summary reports distinct word bigrams).

Each kept prompt is one record {"id", "messages": [user, assistant "."], "source": "magpie"}; ids
start at --id-base, far above ShareGPT's, so a segment's range stays distinguishable. Generation
stops a prompt at the end of its turn; one cut at --max-new-tokens is dropped (a user turn that
never ended). Progress on stderr, a JSON summary beside the output (`<out>.summary.json`); a
killed run resumes where it stopped (same command), with the same seeds; resumed with a smaller
--n it ends with the first n prompts it kept.

    .venv/bin/python scripts/magpie_prompts.py --n 2048 --out data/magpie/prompts-0.jsonl.xz
    python3 scripts/magpie_prompts.py --device cuda --batch 512 --n 20000 --seed 1 --out /tmp/m.jsonl.xz
"""
from __future__ import annotations

import argparse
import json
import lzma
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_infer.default_model import resolve_model_path  # noqa: E402
from eagle_infer.errors import UserError  # noqa: E402
from eagle_infer.generate import generate  # noqa: E402
from eagle_infer.loader import eos_ids, load_model, load_tokenizer  # noqa: E402
from eagle_infer.sampling import SamplingParams  # noqa: E402
from eagle_train.shards import atomic_write_bytes, atomic_write_text  # noqa: E402

SENTINEL = "\x00MAGPIE\x00"


def pre_query_ids(tokenizer) -> list[int]:
    """The chat template rendered up to where a user's message begins (the template's default
    system turn included, as every real prompt has it)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in text:
        raise UserError("the chat template does not place the user's message verbatim: no pre-query "
                        "template to prompt the target with")
    return list(tokenizer(text[: text.index(SENTINEL)], add_special_tokens=False)["input_ids"])


def normalise(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def distinct_bigrams(texts: list[str]) -> float:
    """Distinct word bigrams over all bigrams: 1.0 when no two prompts share a phrase."""
    grams, total = set(), 0
    for t in texts:
        w = normalise(t).split()
        pairs = list(zip(w, w[1:]))
        grams.update(pairs)
        total += len(pairs)
    return len(grams) / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded default target)")
    ap.add_argument("--n", type=int, required=True, help="prompts to keep")
    ap.add_argument("--out", type=Path, required=True, help=".jsonl or .jsonl.xz")
    ap.add_argument("--batch", type=int, default=64, help="prompts sampled at a time")
    ap.add_argument("--temperature", type=float, default=1.0, help="Magpie's: 1.0, top-p 1.0")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="a user turn not ended by then is dropped")
    ap.add_argument("--min-chars", type=int, default=12, help="shorter prompts are dropped")
    ap.add_argument("--seed", type=int, default=0, help="row i of a run draws from seed * 10**7 + i")
    ap.add_argument("--id-base", type=int, default=10_000_000, help="first record id (+ seed * 10**7)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="fp32 / bf16 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="compiled decode steps (generate(compile=True))")
    a = ap.parse_args()
    if a.n <= 0 or a.batch <= 0:
        raise SystemExit(f"error: --n and --batch must be > 0, got {a.n} and {a.batch}")

    if a.out.exists():
        print(f"magpie: {a.out} exists; nothing to do (remove it to write it again)", file=sys.stderr)
        return
    # Kept prompts go to <out>.partial.jsonl after every batch, then the counts to
    # <out>.partial.json: a killed run resumes from there, drawing the seeds it would have drawn.
    partial = a.out.with_name(a.out.name + ".partial.jsonl")
    state_file = a.out.with_name(a.out.name + ".partial.json")
    counts = {"sampled": 0, "unfinished": 0, "short": 0, "duplicate": 0, "kept": 0, "generated_tokens": 0}
    kept: list[str] = []
    if state_file.exists():
        counts = json.loads(state_file.read_text())
        lines = partial.read_text().splitlines()[: counts["kept"]]  # a line past the state: unrecorded
        kept = [json.loads(line)["messages"][0]["content"] for line in lines]
        partial.write_text("".join(line + "\n" for line in lines))
        print(f"magpie: resuming at {counts['kept']} kept of {counts['sampled']} sampled", file=sys.stderr)
    else:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("")
    seen = {normalise(t) for t in kept}
    first = a.id_base + a.seed * 10**7

    folder = resolve_model_path(a.model)
    tok = load_tokenizer(folder)
    dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    model = load_model(folder, dtype=dtype, device=a.device)
    prefix = pre_query_ids(tok)
    eos = sorted(eos_ids(model.config, tok))  # load_model's config has generation_config.json's
    t0, tokens0 = time.perf_counter(), counts["generated_tokens"]
    while len(kept) < a.n:
        base = a.seed * 10**7 + counts["sampled"]
        params = [SamplingParams(a.temperature, a.top_p, 0, base + i) for i in range(a.batch)]
        outs = generate(model, [prefix] * a.batch, a.max_new_tokens, params, eos_token_ids=eos,
                        compile=a.compile)
        counts["sampled"] += a.batch
        new = []
        for out in outs:
            counts["generated_tokens"] += len(out)
            if not out or out[-1] not in eos:
                counts["unfinished"] += 1
                continue
            text = tok.decode(out[:-1], skip_special_tokens=True).strip()
            key = normalise(text)
            if len(text) < a.min_chars:
                counts["short"] += 1
            elif key in seen:
                counts["duplicate"] += 1
            elif len(kept) < a.n:
                seen.add(key)
                kept.append(text)
                msgs = [{"role": "user", "content": text}, {"role": "assistant", "content": "."}]
                new.append({"id": first + len(kept) - 1, "messages": msgs, "source": "magpie"})
        with partial.open("a") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new))
        counts["kept"] = len(kept)
        atomic_write_text(state_file, json.dumps(counts) + "\n")
        rate = (counts["generated_tokens"] - tokens0) / (time.perf_counter() - t0)
        print(f"\rmagpie: {len(kept)}/{a.n} kept of {counts['sampled']} sampled ({rate:.0f} tokens/s)",
              end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    # A run resumed with a smaller --n keeps the first n (the counts stay those of all sampled).
    kept = kept[: a.n]
    text = "".join(line + "\n" for line in partial.read_text().splitlines()[: a.n]).encode()
    lens = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in kept]
    summary = {
        "model": str(folder), "n": len(kept), **counts, "temperature": a.temperature, "top_p": a.top_p,
        "max_new_tokens": a.max_new_tokens, "seed": a.seed, "ids": [first, first + len(kept) - 1],
        "mean_prompt_tokens": sum(lens) / max(len(lens), 1), "distinct_bigrams": distinct_bigrams(kept),
        "device": a.device, "dtype": dtype, "pre_query_template": tok.decode(prefix),
    }
    Path(f"{a.out}.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    atomic_write_bytes(a.out, lzma.compress(text) if a.out.suffix == ".xz" else text)
    partial.unlink()
    state_file.unlink()
    print(f"magpie: {len(kept)} prompts ({summary['mean_prompt_tokens']:.0f} tokens on average, distinct "
          f"bigrams {summary['distinct_bigrams']:.2f}) from {counts['sampled']} sampled: "
          f"{counts['unfinished']} unfinished, {counts['short']} short, {counts['duplicate']} duplicates "
          f"-> {a.out}")


if __name__ == "__main__":
    main()
