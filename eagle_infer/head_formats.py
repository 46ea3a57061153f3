"""Published draft-head checkpoint layouts, read and written (reference.md section 4).

Every layout holds the same weights; they differ in file format, key names and config keys:

- EAGLE-1/2 (yuhuili, SGLang, ours): a Llama config with `num_hidden_layers: 1`, `"bias"` true
  when fc has a bias; keys `fc.*`, `layers.0.*`, often `embed_tokens.weight`.
- EAGLE-3 (yuhuili, SpecForge, ours): a Llama config plus `draft_vocab_size`, `architectures:
  ["LlamaForCausalLMEagle3"]`, maybe `eagle_config.eagle_aux_hidden_state_layer_ids` and
  `target_hidden_size`; keys `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`.
- vLLM speculators EAGLE-3: `speculators_model_type: "eagle3"`, the Llama config nested in
  `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`, top-level
  `eagle_aux_hidden_state_layer_ids`, `speculators_config` (proposal methods, verifier); keys
  `layers.0.*` instead of `midlayer.*`.

Files: `model.safetensors` or `pytorch_model.bin`, either one file or shards listed by a
`*.index.json` weight map.

The aux layer ids mean different things per layout, read in the engines' code: SGLang adds one
to `eagle_config.eagle_aux_hidden_state_layer_ids` (id i = the *output* of layer i), while vLLM
uses the speculators ids as they are (id k = the hidden state after k layers, HF
`hidden_states[k]`), and reads a top-level `eagle_aux_hidden_state_layer_ids` before
`eagle_config`. HeadConfig keeps SGLang's convention; speculators ids are shifted on the way in and
out, and our official EAGLE-3 configs carry both keys, each in its engine's convention.

This module works on plain dicts and tensors; `heads.py` turns them into a HeadConfig and a
DraftHead, and `export_head` (below) rewrites any readable head in another layout.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from eagle_infer.errors import UserError

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
EAGLE2_ARCH = "LlamaForCausalLM"
SPECULATORS_ARCH = "Eagle3Speculator"
FORMATS = ("official", "speculators")

# Speculators variants our head does not implement (vLLM reads them in llama_eagle3.py).
_UNSUPPORTED_SPECULATORS_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
# Config keys of the Llama layer config that a speculators file nests in transformer_layer_config.
_LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
               "max_position_embeddings", "hidden_act", "tie_word_embeddings")


# ---------------------------------------------------------------------------------------------
# Weights


def _load_one(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    # weights_only: a .bin is a pickle, and a downloaded one must not run code.
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, Mapping) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise UserError(f"{path} is not a state dict of tensors")
    return dict(sd)


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a head folder: the shards an index lists, else the safetensors files,
    else the PyTorch .bin files (safetensors win where both are published, as in transformers)."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text()).get("weight_map") or {}
            files = [folder / f for f in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if not files or missing:
                raise UserError(f"draft head {folder}: {index} lists missing shards: {missing or 'none'}")
            return files
    files = sorted(folder.glob("*.safetensors"))
    return files or sorted(folder.glob("*.bin"))


def read_weights(folder: str | os.PathLike) -> dict[str, Tensor]:
    """All tensors of a head folder, in whatever published form it has."""
    folder = Path(folder)
    files = weight_files(folder)
    if not files:
        raise UserError(f"draft head {folder} has no weights (model.safetensors or pytorch_model.bin, "
                        f"single or sharded)")
    sd: dict[str, Tensor] = {}
    for f in files:
        sd.update(_load_one(f))
    return sd


# ---------------------------------------------------------------------------------------------
# Config


def is_speculators(cfg: Mapping[str, Any]) -> bool:
    return "speculators_model_type" in cfg or "transformer_layer_config" in cfg


def speculators_to_flat(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A speculators config as the flat official EAGLE-3 config it stands for (aux ids in SGLang's
    convention, the draft-layer variant in `norm_before_residual`)."""
    kind = cfg.get("speculators_model_type")
    if kind != "eagle3":
        raise UserError(f"speculators_model_type '{kind}' is not supported: only eagle3 speculators load")
    layer = dict(cfg.get("transformer_layer_config") or {})
    if not layer:
        raise UserError("speculators config has no transformer_layer_config")
    unsupported = [k for k in _UNSUPPORTED_SPECULATORS_FLAGS if cfg.get(k)]
    if unsupported:
        raise UserError(f"speculators head uses {', '.join(unsupported)}, which this runtime's EAGLE-3 head "
                        f"does not implement")
    flat = layer | {"architectures": [EAGLE3_ARCH],
                    "draft_vocab_size": cfg.get("draft_vocab_size") or layer.get("vocab_size"),
                    # vLLM's default when the key is absent (speculators writes it explicitly).
                    "norm_before_residual": bool(cfg.get("norm_before_residual", True))}
    if cfg.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = cfg["target_hidden_size"]
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in ids],
                                "use_aux_hidden_state": True}
    return flat


def flat_to_speculators(flat: Mapping[str, Any], verifier: str | None, verifier_arch: str | None = None,
                        speculative_tokens: int = 3) -> dict[str, Any]:
    """An official EAGLE-3 config (as HeadConfig.to_hf writes it) in the speculators layout that
    vLLM reads (vllm/transformers_utils/configs/speculators)."""
    layer = {k: flat[k] for k in _LAYER_KEYS if k in flat}
    layer |= {"num_hidden_layers": 1, "attention_bias": False, "mlp_bias": False}
    ids = (flat.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    out: dict[str, Any] = {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": flat.get("draft_vocab_size") or flat["vocab_size"],
        "norm_before_residual": bool(flat.get("norm_before_residual", False)),
        "target_hidden_size": flat.get("target_hidden_size"),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier,
                         "architectures": [verifier_arch] if verifier_arch else []},
        },
    }
    if ids:  # vLLM: id k = hidden state after k layers (SGLang's id + 1)
        out["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in ids]
    if "torch_dtype" in flat:
        out["torch_dtype"] = flat["torch_dtype"]
    return out


# ---------------------------------------------------------------------------------------------
# Key names


def canonical_state_dict(sd: Mapping[str, Tensor], kind: str) -> dict[str, Tensor]:
    """Official key names of our DraftHead: no `model.` prefix, `midlayer.*` for EAGLE-3
    (speculators and vLLM say `layers.0.*`), and no copies of the target's embedding (or, for
    EAGLE-2, its lm_head): the head shares the target's."""
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("model.")
        if kind == "eagle3" and k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        if k == "embed_tokens.weight" or (kind == "eagle2" and k == "lm_head.weight"):
            continue
        out[k] = v
    return out


def speculators_state_dict(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
            for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------
# Writing


def write_head_folder(out: str | os.PathLike, config: Mapping[str, Any], sd: Mapping[str, Tensor],
                      dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """config.json + model.safetensors, the weights written atomically (floats cast to `dtype`
    unless None)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in sd.items()}
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
    return out


def _float_dtype(sd: Iterable[Tensor]) -> torch.dtype:
    return next((v.dtype for v in sd if v.is_floating_point()), torch.bfloat16)


def export_head(src: str | os.PathLike, out: str | os.PathLike, fmt: str = "official",
                verifier: str | None = None, verifier_arch: str | None = None,
                speculative_tokens: int = 3, dtype: torch.dtype | None = None) -> Path:
    """Rewrite the head folder `src` (any layout load_head reads) into `out` in layout `fmt`:
    `official` (config.json + model.safetensors as SGLang and EAGLE publish them, what save_head
    writes) or `speculators` (vLLM's, EAGLE-3 only). Weights keep their dtype unless `dtype`."""
    from eagle_infer.heads import read_head

    if fmt not in FORMATS:
        raise UserError(f"unknown export format '{fmt}': use one of {', '.join(FORMATS)}")
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise UserError(f"export: the output folder is the source {src}; pick another export.out")
    cfg, sd = read_head(src)
    dtype = dtype or _float_dtype(sd.values())
    flat = cfg.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    if cfg.kind == "eagle2" and cfg.fc_bias:
        print(f"export: {src} has an fc bias ('bias': true): SGLang loads it, vLLM builds fc without a bias "
              f"and reads 'bias' as attention bias, so this head accepts nothing there", file=sys.stderr)
    if fmt == "official":
        return write_head_folder(out, flat, sd, dtype)
    if cfg.kind != "eagle3":
        raise UserError("the speculators format is for EAGLE-3 heads (vLLM loads speculators_model_type "
                        "eagle3); export an EAGLE-2 head with export.format=official")
    config = flat_to_speculators(flat, verifier, verifier_arch, speculative_tokens)
    return write_head_folder(out, config, speculators_state_dict(sd), dtype)
