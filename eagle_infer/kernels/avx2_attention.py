"""Attention of a few query rows (a decode step's one, a verify's tree) over the KV cache, fp32 or
bf16 (computed in fp32) on AVX2 + FMA, or bf16 with its scores on vdpbf16ps (the default on AMD
CPUs with AVX512-BF16) or AMX tiles (the default at head size 128 on CPUs with them)
(set_bf16_scores, EAGLE_CPU_ATTENTION; avx2_attention.cpp), as torch.ops.eagle.avx2_attention: what
model.attention runs for such calls on a CPU while it is enabled (`enable()`; the loader enables
it with the "avx2" Linears in fp32 and the "avx512_bf16" ones in bf16, unless
EAGLE_CPU_ATTENTION=sdpa). A prefill's causal attention from slot 0 (model.attention's `causal`
calls, hundreds of rows) goes to the library's second op, torch.ops.eagle.causal_attention, while
it is enabled.

Built once per machine by torch's extension builder into its cache (avx2_linear.build).

    enable()
    out = torch.ops.eagle.avx2_attention(q, keys, values, bias)
    # q [B, H, T, D], keys / values [B, KVH, S, D] (cache views; D 64, 128 or 256), bias [B, 1, T, S]
    # == F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, enable_gqa=True)
    out = torch.ops.eagle.causal_attention(q, keys, values)  # S >= T, slots 0..T-1 read
    # == F.scaled_dot_product_attention(q, keys[:, :, :T], values[:, :, :T], is_causal=True,
    #                                   enable_gqa=True)
    out = torch.ops.eagle.causal_attention(q, keys, values, window)  # a sliding layer's prefill:
    # position t over slots t - window + 1 .. t
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from eagle_infer.kernels import avx2_linear

SOURCE = Path(__file__).with_name("avx2_attention.cpp")
HEAD_DIMS = (64, 128, 256)  # head sizes the kernel has instances for (the fused layers: 64, 128)
# Query rows (T) up to which model.attention calls the kernel: decode steps and verifies; a
# prefill's hundreds of rows stay on SDPA's flash kernel, which blocks over them.
MAX_ROWS = 64
_enabled = False


def enabled() -> bool:
    """Whether model.attention hands fp32 / bf16 CPU calls of a few rows to the kernel (enable())."""
    return _enabled


def enable(on: bool = True) -> None:
    """Turn the kernel on (building and loading it first) or off for model.attention in this
    process. A compiled step traces the choice and guards on it: graphs compiled either way stay
    cached and are reused when the flag comes back to them."""
    global _enabled
    if on:
        load()
    _enabled = on


@functools.cache
def load() -> None:
    """Build (first time on a machine) and load the op, and give compiled graphs its shape."""
    avx2_linear.build("eagle_avx2_attention", SOURCE)

    @torch.library.register_fake("eagle::avx2_attention")
    def _(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
        return q.new_empty(q.shape)

    @torch.library.register_fake("eagle::causal_attention")
    def _(q: Tensor, keys: Tensor, values: Tensor, window: int = 0, offset: int = 0) -> Tensor:
        B, H, T, D = q.shape
        return q.new_empty(B, T, H, D).transpose(1, 2)


def applies(q: Tensor, mask: Tensor) -> bool:
    """Whether model.attention hands this call (q [B, H, T, D], mask) to the kernel."""
    return (_enabled and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and mask.dtype == q.dtype and q.shape[-1] in HEAD_DIMS and q.shape[2] <= MAX_ROWS)


def causal_applies(q: Tensor) -> bool:
    """Whether model.attention hands a prefill's causal attention (q [B, H, T, D]) to the kernel's
    causal_attention: on the same CPUs and dtypes as the decode calls, any T."""
    return (_enabled and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and q.shape[-1] in HEAD_DIMS)


BF16_SCORES = ("loops", "dot", "amx")


def set_bf16_scores(mode: str) -> str:
    """From now on, in this process, bf16 calls compute their scores on `mode`: "loops" (the AVX2
    loops, fp32 FMAs), "dot" (vdpbf16ps on AVX512-BF16, the softmax and P V on AVX-512) or "amx"
    (AMX tiles, likewise); returns the mode in effect: "loops" where the CPU lacks the one asked
    for. The loader sets default_bf16_scores() ($EAGLE_CPU_ATTENTION). One choice a process: a
    row's bits depend on it."""
    load()
    return torch.ops.eagle.avx2_attention_set_bf16_scores(mode)


def bf16_scores() -> str:
    """What bf16 calls compute their scores on now (set_bf16_scores)."""
    load()
    return torch.ops.eagle.avx2_attention_bf16_scores()


def default_bf16_scores() -> str:
    """"amx" on a CPU with AMX tiles: Qwen3's shape (head size 128, 16 query heads over 8, 2
    threads, Xeon with AMX) ran a call 2.3-2.6x faster on the tiles than on the loops, and at head
    size 64 the default target decoded 1-7% faster plain and 7-13% speculative on MT-bench and on
    ~1,000-token prompts (docs/measurements.md, "Attention on AMX tiles at head size 64 too"); τ
    moved either way with the greedy answers, as with any other rounding. "dot" on an AMD CPU
    with AVX512-BF16 (where vdpbf16ps runs at the FMAs' rate with twice their multiply-adds,
    kernels/bf16_linear.cpp): on a 2-core AMD EPYC Zen 4, 2 threads, 9 heads over 3, the kernel's
    calls ran 1.5-1.9x faster than on the loops (1 to 11 query rows, 256 and 1,024 slots;
    docs/measurements.md, "bf16 attention on vdpbf16ps"). Else "loops": on Intel's AVX512-BF16
    CPUs without AMX vdpbf16ps ran at a quarter of the FMAs' rate."""
    from eagle_infer.kernels import bf16_linear

    # the Linears' CPU rule (bf16_linear.cpu_multiply), each multiply's counterpart here
    return {"amx": "amx", "vdpbf16ps": "dot", "fma": "loops"}[bf16_linear.cpu_multiply()]
