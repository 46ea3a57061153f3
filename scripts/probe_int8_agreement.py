"""How far an int8 target (--quantization int8) is from the fp32 one: the fp32 target answers
the first MT-bench turns greedily, then it and each variant score those answers teacher-forced;
reports top-1 agreement of their next-token predictions and the KL(fp32 || variant) per prompt.
A variant is DTYPE[:int8] ("int8" alone: fp32 with int8 weights): with "bf16:int8" on an
AVX512-BF16 CPU the int8 Linears run our kernel, and "bf16" says what bf16 alone costs.

    python scripts/probe_int8_agreement.py --num-prompts 5 --json results/int8_vs_fp32_agreement.json
    python scripts/probe_int8_agreement.py --variants bf16 bf16:int8 --json results/agreement.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle_infer.bench import load_prompts
from eagle_infer.generate import ensure_cache, generate, kv_len_for
from eagle_infer.loader import load_model, load_tokenizer
from eagle_infer.model import causal_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["int8"], help="DTYPE[:int8] or int8 (fp32)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(None, args.num_prompts, load_tokenizer(None))
    ref = load_model(None, "fp32")
    answers = generate(ref, prompts, args.max_new_tokens)
    variants = {}
    for v in args.variants:
        dtype, _, quant = ("fp32:int8" if v == "int8" else v).partition(":")
        variants[v] = load_model(None, dtype, quantization=quant or "none")
    counts = {v: {"agree": 0, "total": 0, "kl": []} for v in variants}
    for p, a in zip(prompts, answers):
        seq = torch.tensor([p + a])  # [1, T]
        T = seq.shape[1]
        pos = torch.arange(T)[None]
        logits = {}
        for name, m in (("fp32", ref), *variants.items()):
            ensure_cache(m, 1, T)
            mask = causal_mask(torch.zeros(1, dtype=torch.long), T, kv_len_for(T, m.max_seq_len))
            with torch.no_grad():
                logits[name] = m(seq, pos, pos, mask)[0][0, len(p) - 1:-1].float()  # [len(a), V]
        f = logits["fp32"]
        for name, c in counts.items():
            q = logits[name]
            c["agree"] += int((f.argmax(-1) == q.argmax(-1)).sum())
            c["total"] += f.shape[0]
            c["kl"].append(F.kl_div(q.log_softmax(-1), f.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item())
    out = {"variants": {name: {"top1_agreement": round(c["agree"] / c["total"], 4), "positions": c["total"],
                               "kl_fp32_to_variant_per_prompt": [round(k, 4) for k in c["kl"]],
                               "cpu_linears": variants[name].cpu_linears}
                        for name, c in counts.items()},
           "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": args.threads}
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
