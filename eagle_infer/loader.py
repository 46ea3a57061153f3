"""Load a target model (HF folder with safetensors) and its tokenizer onto our runtime."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from eagle_infer.default_model import resolve_model_path
from eagle_infer.errors import UserError
from eagle_infer.kernels import avx2_attention, avx2_linear, decoder_layers
from eagle_infer.model import ModelConfig, Transformer, convert_hf_state_dict
from eagle_infer.quantize import quantize_linears

# our names, and vLLM's and SGLang's for the same dtypes
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name (fp32, bf16, fp16) of a dtype resolve_dtype returns: what runs, for logs."""
    return next(name for name in ("fp32", "bf16", "fp16") if DTYPES[name] == dtype)


def cpuinfo_field(name: str) -> str:
    """The value of /proc/cpuinfo's first `name` line ("model name", "vendor_id", "cpu family",
    "model": the key whole, so "model" is not "model name"), or "" where there is none (no such
    file, no such line)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((value.strip() for key, sep, value in (ln.partition(":") for ln in f)
                         if sep and key.strip() == name), "")
    except OSError:
        return ""


def cpu_has_fast_bf16() -> bool:
    """True on a CPU with bf16 instructions (AVX512-BF16 / AMX). Without them bf16 matmuls are
    emulated and run several times slower than fp32 (measured 3-50x on an AVX2 EPYC)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def cpu_runs_bf16_fast() -> bool:
    """True where bf16 decoding beats fp32 on this CPU: bf16 instructions (cpu_has_fast_bf16), or
    AVX2 with FMA where our bf16 Linear kernel builds (its AVX2 build streams half fp32's bytes:
    plain decoding 1.7x our fp32 and speculative 1.6x on a 2-core AVX2 AMD EPYC, docs/measurements.md)."""
    if cpu_has_fast_bf16():
        return True
    from eagle_infer import cpu_linears

    return cpu_linears.bf16_default()


def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """Map a dtype name to torch, refusing one this machine can't run. "auto" = bf16 where the
    hardware runs it fast (cpu_runs_bf16_fast on a CPU), else fp32."""
    if name == "auto":
        dev = torch.device(device)
        fast = (torch.cuda.is_available() and torch.cuda.is_bf16_supported()) if dev.type == "cuda" \
            else cpu_runs_bf16_fast()
        return torch.bfloat16 if fast else torch.float32
    if isinstance(name, torch.dtype):
        dtype = name
    elif name in DTYPES:
        dtype = DTYPES[name]
    else:
        raise UserError(f"unknown dtype '{name}': use fp32 or bf16")
    dev = torch.device(device)
    if dev.type == "cpu" and dtype == torch.float16:
        raise UserError("dtype fp16 is not supported on CPU (no fast fp16 kernels): use bf16 or fp32")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device 'cuda' requested but CUDA is not available on this machine")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise UserError("dtype bf16 is not supported on this GPU: use fp16 or fp32")
    return dtype


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def read_hf_config(path: Path) -> dict:
    with open(path / "config.json") as f:
        return json.load(f)


def generation_eos_ids(path: Path) -> list[int]:
    """generation_config.json's eos_token_id (none without the file): where instruct checkpoints
    keep their end-of-turn token beside config.json's end of text (Gemma's <end_of_turn>, Llama 3's
    <|eot_id|>, Qwen2.5's <|endoftext|>); vLLM stops at both."""
    file = path / "generation_config.json"
    eos = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
    return [eos] if isinstance(eos, int) else list(eos or [])


def eos_ids(model_config, tokenizer, folder: str | os.PathLike | None = None) -> set[int]:
    """End-of-answer ids: the model config's, the tokenizer's and, given the folder,
    generation_config.json's (a target from load_model has those in its config already)."""
    ids = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if folder is not None:
        ids.update(generation_eos_ids(Path(folder)))
    return ids


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"no safetensors weights in model folder {path}")
    return files


def load_model(path: str | os.PathLike | None = None, dtype: str | torch.dtype = "fp32",
               device: str | None = None, cpu_linears: str | None = None,
               quantization: str = "none") -> Transformer:
    """Build our Transformer from an HF folder (None / 'default' = the embedded default).

    cpu_linears (fp32 or bf16 on a CPU; default: $EAGLE_CPU_LINEARS, else "auto"): "onednn" runs
    Linears through oneDNN with prepacked weights (eagle_infer/cpu_linears.py): fp32 calls of
    more than one row (verify, batches, prefill), bf16 calls of any size where the CPU has native
    bf16; "torch" runs them through torch's kernel; "inductor": compiled steps run them through
    Inductor's C++ GEMM template on frozen weights (cpu_linears.compile_settings; eager calls run
    as onednn's); "avx2": calls of up to 32 rows, eager and compiled, run our AVX2 kernel
    (eagle_infer/kernels/avx2_linear.cpp); "avx512_bf16": bf16 calls of up to 512 rows (every
    call on a CPU without AVX512-BF16: the kernel's AVX2 build) run our kernel
    (eagle_infer/kernels/bf16_linear.cpp); "auto" = avx2 for fp32 on an AVX2 CPU without AVX-512,
    inductor for fp32 on an AVX-512 one, avx512_bf16 for bf16 wherever the kernel builds, else
    onednn, where this torch has it, the model has Linears it packs and the packed copies fit in
    free memory (cpu_linears.auto_backend). With "avx2" and fp32 or "avx512_bf16"
    and bf16, attention calls of a few query rows run kernels/avx2_attention too
    ($EAGLE_CPU_ATTENTION=sdpa keeps them on torch's SDPA; =loops, =dot or =amx computes bf16
    ones' scores on the AVX2 loops, vdpbf16ps or AMX tiles; auto: avx2_attention.default_bf16_scores,
    amx on CPUs with AMX, dot on AMD CPUs with AVX512-BF16, else loops)."""
    folder = resolve_model_path(path)
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    cfg = ModelConfig.from_hf(read_hf_config(folder))
    cfg.eos_token_ids += [i for i in generation_eos_ids(folder) if i not in cfg.eos_token_ids]
    sd: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                sd[k] = st.get_tensor(k)
    with torch.device("meta"):
        model = Transformer(cfg)
    sd = convert_hf_state_dict(sd, cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(
            f"weights in {folder} do not match a {cfg.model_type} model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device=device, dtype=torch_dtype).eval()
    model.requires_grad_(False)
    model.cpu_linears = "torch"  # what load_head_for gives the head's Linears too
    if model.embed_tokens.weight.device.type == "cpu" and torch_dtype in (torch.float32, torch.bfloat16):
        if torch_dtype == torch.float32 and quantization == "none":
            column_major_linears(model)
        backend = cpu_linears or os.environ.get("EAGLE_CPU_LINEARS", "auto")
        if backend not in ("auto", "torch", "onednn", "inductor", "avx2", "avx512_bf16"):
            raise UserError("cpu_linears must be auto, torch, onednn, inductor, avx2 or avx512_bf16, "
                            f"got {backend!r}")
        attention = os.environ.get("EAGLE_CPU_ATTENTION", "auto")
        if attention not in ("auto", "sdpa", *avx2_attention.BF16_SCORES):
            raise UserError(f"EAGLE_CPU_ATTENTION must be auto, loops, dot, amx or sdpa, got {attention!r}")
        from eagle_infer import cpu_linears as onednn

        if backend == "auto":
            backend = onednn.auto_backend(model)
        if quantization == "none":
            onednn.use_backend_linears(model, backend)
        model.cpu_linears = backend
        ours = (backend, torch_dtype) in (("avx2", torch.float32), ("avx512_bf16", torch.bfloat16))
        # int8 Linears round their inputs to bf16, so a verify row's attention must equal a step's
        # bit for bit, as the kernel's does and SDPA's (its blocking follows the query length) does
        # not: fp32 int8 on an AVX-512 CPU's "inductor" Linears and SDPA diverged from its own
        # plain greedy output at token 18 of 2 MT-bench prompts, and matched with the kernel.
        int8_fp32 = quantization == "int8" and torch_dtype == torch.float32 and avx2_linear.supported()
        if (ours or int8_fp32) and attention != "sdpa":
            try:
                avx2_attention.enable()
                # bf16 calls' scores: one choice a process
                avx2_attention.set_bf16_scores(
                    avx2_attention.default_bf16_scores() if attention == "auto"
                    else attention)
            except Exception as e:  # the Linear kernel built, so this is unexpected: say so, go on
                warnings.warn(f"the avx2 attention kernel did not build ({e}); attention runs on SDPA",
                              stacklevel=2)
    quantize_linears(model, quantization, model.cpu_linears)
    decoder_layers.attach(model)  # last: it registers the packed or quantized weights
    model.quantization = quantization
    model.source_path = folder
    return model


def column_major_linears(model: torch.nn.Module) -> None:
    """Store every Linear weight [out, in] column-major (its transpose contiguous), in place.

    F.linear computes x @ W.t(); with W row-major that transpose is strided, and on CPU the fp32
    GEMM for a few rows (a verify of 4-16 tree nodes) then runs far slower than one row: measured
    on a 2-core Xeon (AVX-512, no bf16), 2 threads, default model, compiled forward: 1 / 4 / 16
    tokens 41 / 83 / 159 ms row-major, 42 / 58 / 80 ms column-major (eager 51 / 102 / 187 vs
    53 / 70 / 87). Same values, same shapes, same parameter names; a tied embedding reads its
    rows strided, which costs nothing at one row per token. bf16 is not measured here, so only
    fp32 weights change."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.data = m.weight.data.t().contiguous().t()


def load_tokenizer(path: str | os.PathLike | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(path))
