"""Do penalties survive speculative decoding? Greedy decoding with OpenAI's frequency and presence
penalties and vLLM's repetition_penalty (and, apart, vLLM's bad_words and allowed_token_ids, and
a JSON schema as structured output), plain and speculative, in vLLM for CPU (with our EAGLE-3
head, k draft tokens) and in ours (the device's default tree), fp32, on the same MT-bench prompts.
Lossless means each engine's speculative output equals its own plain output with the same
settings; the penalized outputs must also differ from the unpenalized ones (the settings took
effect), else the comparison proves nothing.

    python scripts/probe_vllm_penalties.py --json results/vllm_penalties_zen1.json

vLLM runs in its own environment (scripts/vllm_env.sh), as in scripts/bench_vllm.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = {"none": {}, "penalties": {"frequency_penalty": 1.0, "presence_penalty": 0.5,
                                      "repetition_penalty": 1.2},
            # vLLM tokenizes bad_words itself (ours: the server's bad_words_ids); allowed: all
            # but the tokens of these marks
            "words": {"bad_words": ["the", "is", "and"], "allowed_token_ids": [".", ",", "\n"]},
            # structured outputs (vLLM: xgrammar by default; ours: grammar.Grammars)
            # (EOS ends these answers: the grammar's end is the EOS token)
            "json": {"structured_outputs": {"json": {
                "type": "object", "properties": {"answer": {"type": "string"},
                                                 "confidence": {"type": "number"}},
                "required": ["answer", "confidence"], "additionalProperties": False}}}}


def ours(settings: dict, tokenizer) -> dict:
    """SETTINGS in our SamplingParams' terms (and the allowed ids in vLLM's)."""
    from eagle_infer.server import bad_words_ids

    s = dict(settings)
    if "structured_outputs" in s:
        from eagle_infer.default_model import resolve_model_path
        from eagle_infer.grammar import Grammars
        from eagle_infer.loader import read_hf_config
        from eagle_infer.model import ModelConfig

        cfg = ModelConfig.from_hf(read_hf_config(resolve_model_path("default")))
        grammars = Grammars.for_tokenizer(tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        s["grammar"] = grammars.compile("json_schema", s.pop("structured_outputs")["json"])
    if "bad_words" in s:
        s["bad_words"] = bad_words_ids(tokenizer, s["bad_words"])
    if "allowed_token_ids" in s:
        marks = {t for m in s["allowed_token_ids"] for t in tokenizer.encode(m, add_special_tokens=False)}
        s["allowed_token_ids"] = [t for t in range(len(tokenizer)) if t not in marks]
    return s


def same(a: list[list[int]], b: list[list[int]]) -> int:
    """How many prompts' outputs are token-identical."""
    return sum(x == y for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--head", default=None, help="EAGLE-3 head folder (default: the shipped one)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"which of {', '.join(SETTINGS)} (none, the reference, always runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    settings = {k: v for k, v in SETTINGS.items() if k == "none" or k in args.settings.split(",")}

    from eagle_infer.bench import load_prompts
    from eagle_infer.default_model import default_head_path, resolve_model_path
    from eagle_infer.generate import generate
    from eagle_infer.heads import load_head_for
    from eagle_infer.loader import load_model, load_tokenizer
    from eagle_infer.sampling import SamplingParams
    from eagle_infer.speculative import generate_speculative
    from eagle_infer.tree import TreeConfig
    from eagle_infer.vllm_client import VLLMEngine

    folder = resolve_model_path("default")
    head_dir = Path(args.head) if args.head else default_head_path("eagle3")
    tokenizer = load_tokenizer(folder)
    prompts = load_prompts(None, args.num_prompts, tokenizer)
    T = args.max_new_tokens
    model = load_model(folder, "fp32", "cpu")
    head = load_head_for(head_dir, model)
    tree = TreeConfig.from_flags(None, None, None, "cpu", "none", "fp32", None)
    out: dict[str, dict[str, list[list[int]]]] = {"ours plain": {}, "ours spec": {}, "vllm plain": {},
                                                  "vllm spec": {}}
    taus: dict[str, float] = {}
    for name, s in settings.items():
        params = SamplingParams(**ours(s, tokenizer))
        eos = None if "structured_outputs" in s else []  # None: the model's
        out["ours plain"][name] = generate(model, prompts, T, params, eos_token_ids=eos)
        out["ours spec"][name], stats = generate_speculative(model, head, prompts, T, params, tree=tree,
                                                             eos_token_ids=eos)
        taus[f"ours {name}"] = round(stats.acceptance_length(), 3)
        print(f"ours {name}: done (tau {taus[f'ours {name}']})", file=sys.stderr)
    del model, head
    max_len = max(256, max(len(p) for p in prompts) + T + args.num_speculative_tokens + 8)
    k = args.num_speculative_tokens
    spec_cfg = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": k}
    for engine, spec in (("vllm plain", None), ("vllm spec", spec_cfg)):
        with VLLMEngine(folder, dtype="float32", speculative_config=spec, max_model_len=max_len) as llm:
            for name, s in settings.items():
                ignore_eos = "structured_outputs" not in s
                params = {"temperature": 0.0, "max_tokens": T, "ignore_eos": ignore_eos, **s}
                if "allowed_token_ids" in s:  # ids, not marks
                    params["allowed_token_ids"] = ours(s, tokenizer)["allowed_token_ids"]
                out[engine][name] = llm.generate(prompts, [params] * len(prompts))[0]
        print(f"{engine}: done", file=sys.stderr)

    n = len(prompts)
    report = {
        "prompts": n, "max_new_tokens": T, "dtype": "fp32", "settings": settings,
        "our_tree": tree.label(), "vllm_num_speculative_tokens": args.num_speculative_tokens,
        "head": str(head_dir), "tau": taus,
        # lossless: speculative = plain, each engine, with the same settings
        "spec_equals_plain": {f"{e} {name}": same(out[f"{e} spec"][name], out[f"{e} plain"][name])
                              for e in ("ours", "vllm") for name in settings},
        # the settings took effect: their plain output differs from the unpenalized one
        "penalized_differs": {f"{e} {name}": n - same(out[f"{e} plain"][name], out[f"{e} plain"]["none"])
                              for e in ("ours", "vllm") for name in settings if name != "none"},
        # the two engines' plain decoding of the same settings (fp32 kernels differ: near-ties may flip)
        "ours_plain_equals_vllm_plain": {name: same(out["ours plain"][name], out["vllm plain"][name])
                                         for name in settings},
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
