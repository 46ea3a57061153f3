"""A random-weight target of a real model's shape (and a random EAGLE-3 head for it), to measure
what decoding costs on that shape on this machine without its weights (no model hub here).

Speed does not depend on the weights' values: plain tokens/s, a verify's cost relative to a plain
step and a draft step's are the shape's. Acceptance does: a random head accepts ~nothing, and a
random target repeats itself, which the n-gram branch then predicts (τ says nothing here; read
`verify_vs_plain_step` and `draft_step_vs_plain_step` in the bench JSON, and plain tokens/s).
The folder takes the embedded default's tokenizer and chat template, so the benches' prompts
tokenize as usual; the vocabulary keeps the real model's size (its lm_head is part of the cost),
ids past the tokenizer's are never in a prompt.

    .venv/bin/python scripts/shape_model.py qwen3-0.6b --out /tmp/qwen3-0.6b-shape --head /tmp/qwen3-0.6b-head
    .venv/bin/python scripts/bench_vllm.py --model-path /tmp/qwen3-0.6b-shape --heads /tmp/qwen3-0.6b-head \\
        --ours --ours-tree default --num-prompts 3 --max-new-tokens 64 --json shape.json
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

# config.json fields of the public checkpoints (Hugging Face), the ones the runtime reads.
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         rope_theta=5e5, tie_word_embeddings=True, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Gemma 3's text-only checkpoints: 5 of 6 layers slide over 512 slots, head size 256, a
    # 262,144-token vocabulary (its lm_head is 62% of the 270M's weights)
    "gemma-3-270m": dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048,
                         num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                         vocab_size=262144,
                         sliding_window=512, query_pre_attn_scalar=256, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1e6, rope_local_base_freq=1e4),
    "gemma-3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       vocab_size=262144,
                       sliding_window=512, query_pre_attn_scalar=256, tie_word_embeddings=True,
                       max_position_embeddings=32768, rope_theta=1e6, rope_local_base_freq=1e4),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def hf_config(shape: str, vocab_size: int | None = None):
    """The transformers config of `shape` (eos and bos: the embedded tokenizer's ids)."""
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    if vocab_size:
        spec["vocab_size"] = vocab_size
    return AutoConfig.for_model(spec.pop("model_type"), **spec, rms_norm_eps=1e-6,
                                bos_token_id=1, eos_token_id=2)


def write_target(shape: str, out: Path, vocab_size: int | None = None, seed: int = 0) -> Path:
    """A bf16 HF folder of `shape` with random weights (transformers' initialisation) and the
    embedded default's tokenizer."""
    from transformers import AutoModelForCausalLM

    from eagle_infer.default_model import resolve_model_path

    tok_dir = resolve_model_path("default")
    cfg = hf_config(shape, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.config.architectures = [type(model).__name__]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, out / name)
    return out


def write_head(target_dir: Path, out: Path, draft_vocab_size: int = 32000, seed: int = 0) -> Path:
    """A random EAGLE-3 head for the target (official layout), its draft vocabulary the first ids."""
    from eagle_infer.heads import DraftHead, HeadConfig, save_head
    from eagle_infer.loader import load_model

    target = load_model(target_dir, "fp32", "cpu", cpu_linears="torch")
    cfg = HeadConfig.for_target(target.config, "eagle3", draft_vocab_size=draft_vocab_size)
    torch.manual_seed(seed)
    head = DraftHead(cfg, target.embed_tokens, target.lm_head.weight)
    with torch.no_grad():
        head.d2t.zero_()  # draft id i is target id i
        head.t2d.zero_()
        head.t2d[:draft_vocab_size] = True
    save_head(head.to(torch.bfloat16), out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, required=True, help="the target's folder")
    ap.add_argument("--head", type=Path, default=None, help="also a random EAGLE-3 head here")
    ap.add_argument("--vocab-size", type=int, default=None, help="instead of the real model's")
    ap.add_argument("--draft-vocab-size", type=int, default=32000)
    args = ap.parse_args(argv)
    write_target(args.shape, args.out, args.vocab_size)
    print(f"wrote {args.shape}'s shape with random weights to {args.out}")
    if args.head:
        write_head(args.out, args.head, args.draft_vocab_size)
        print(f"wrote a random EAGLE-3 head to {args.head}")


if __name__ == "__main__":
    main()
