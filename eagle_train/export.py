"""``python -m eagle_train stage=export``: rewrite a draft head in a published layout.

    python -m eagle_train stage=export export.format=speculators export.out=DIR    # vLLM speculators
    python -m eagle_train stage=export export.head=heads/SmolLM2-135M-Instruct-eagle3 export.out=DIR
    python -m eagle_train stage=export export.head=/path/to/pytorch_model.bin-head   # -> official

The source is any head load_head reads (ours, yuhuili's EAGLE-1/2/3, SpecForge, speculators;
safetensors or .bin, sharded or not); by default the head this pipeline trained (``head_dir``).
``official`` (the default) is the layout SGLang and EAGLE publish: config.json + one
model.safetensors. ``speculators`` is vLLM's (EAGLE-3 heads): ``vllm serve DIR`` serves it with
the verifier its config names.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from eagle_infer.errors import UserError

# Hub ids of the targets whose local copies carry no Hub name (the embedded default is converted
# from a GGUF file): what a published head's config and card name as its verifier / base model.
HUB_IDS = {"SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def target_hub_id(cfg: DictConfig) -> str:
    """The target's Hub id: the known id of its model.name, else model.name."""
    name = str(OmegaConf.select(cfg, "model.name", default="") or "")
    return HUB_IDS.get(name, name)


def target_arch(cfg: DictConfig) -> str | None:
    """The target's architecture (its config.json), or None when the folder is not at hand."""
    from eagle_infer.default_model import resolve_model_path

    try:
        folder = resolve_model_path(OmegaConf.select(cfg, "model.path"))
        return (json.loads((folder / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, UserError, ValueError):
        return None


def source_head(cfg: DictConfig, key: str) -> Path:
    """`<key>.head` (relative to where the command ran), else the pipeline's head_dir."""
    from eagle_train.pipeline import absolute

    head = OmegaConf.select(cfg, f"{key}.head")
    path = Path(absolute(head)) if head else Path(cfg.head_dir)
    if not (path / "config.json").is_file():
        raise UserError(f"no draft head at {path} (config.json missing): train one first, "
                        f"or pass {key}.head=DIR")
    return path


def run(cfg: DictConfig) -> dict[str, Any]:
    import torch

    from eagle_infer.head_formats import export_head
    from eagle_train.pipeline import absolute, log

    e = cfg.export
    fmt = str(e.format)
    src = source_head(cfg, "export")
    out = Path(absolute(e.out)) if e.get("out") else src.with_name(f"{src.name}-{fmt}")
    dtype = e.get("dtype")
    if dtype is not None and str(dtype) not in DTYPES:
        raise UserError(f"export.dtype={dtype}: use one of {', '.join(DTYPES)}, or null (keep the weights')")
    verifier = str(e.verifier) if e.get("verifier") else target_hub_id(cfg)
    arch = target_arch(cfg) if fmt == "speculators" else None
    export_head(src, out, fmt, verifier=verifier, verifier_arch=arch,
                speculative_tokens=int(e.speculative_tokens),
                dtype=getattr(torch, DTYPES[str(dtype)]) if dtype is not None else None)
    log(f"export: {src} -> {out} ({fmt} layout)")
    print(out, file=sys.stdout)
    return {"head": str(src), "out": str(out), "format": fmt}
