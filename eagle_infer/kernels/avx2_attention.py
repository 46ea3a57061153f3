"""Attention of a few query rows (a decode step's one, a verify's tree) over the KV cache, fp32 or
bf16 (computed in fp32) on AVX2 + FMA, or bf16 with its scores on AMX tiles (set_amx, opt-in:
EAGLE_CPU_ATTENTION=amx) (avx2_attention.cpp), as torch.ops.eagle.avx2_attention: what
model.attention runs for such calls on a CPU while it is enabled (`enable()`; the loader enables
it with the "avx2" Linears in fp32 and the "avx512_bf16" ones in bf16, unless
EAGLE_CPU_ATTENTION=sdpa). A prefill's causal attention from slot 0 (model.attention's `causal`
calls, hundreds of rows) goes to the library's second op, torch.ops.eagle.causal_attention, while
it is enabled.

Built once per machine by torch's extension builder into its cache (avx2_linear.build).

    enable()
    out = torch.ops.eagle.avx2_attention(q, keys, values, bias)
    # q [B, H, T, 64], keys / values [B, KVH, S, 64] (cache views), bias [B, 1, T, S] additive
    # == F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, enable_gqa=True)
    out = torch.ops.eagle.causal_attention(q, keys, values)  # S >= T, slots 0..T-1 read
    # == F.scaled_dot_product_attention(q, keys[:, :, :T], values[:, :, :T], is_causal=True,
    #                                   enable_gqa=True)
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from eagle_infer.kernels import avx2_linear

SOURCE = Path(__file__).with_name("avx2_attention.cpp")
HEAD_DIM = 64
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
    def _(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        B, H, T, D = q.shape
        return q.new_empty(B, T, H, D).transpose(1, 2)


def applies(q: Tensor, mask: Tensor) -> bool:
    """Whether model.attention hands this call (q [B, H, T, D], mask) to the kernel."""
    return (_enabled and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and mask.dtype == q.dtype and q.shape[-1] == HEAD_DIM and q.shape[2] <= MAX_ROWS)


def causal_applies(q: Tensor) -> bool:
    """Whether model.attention hands a prefill's causal attention (q [B, H, T, D]) to the kernel's
    causal_attention: on the same CPUs and dtypes as the decode calls, any T."""
    return (_enabled and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and q.shape[-1] == HEAD_DIM)


def set_amx(on: bool) -> bool:
    """From now on, in this process, bf16 calls run on AMX tiles (on, where the CPU has them and
    Linux lets the process use them) or on the AVX2 loops (the default); returns whether they
    use AMX. The loader sets it ($EAGLE_CPU_ATTENTION=amx: on). Not the default yet: faster
    (README, "Attention on AMX"), but on one held-out split the answers generated with it scored
    the shipped head lower (τ 2.05 against 2.26-2.29; on two others, level): likely chance. One
    choice a process: a row's bits depend on it."""
    load()
    return torch.ops.eagle.avx2_attention_set_amx(on)


def amx_on() -> bool:
    """Whether bf16 calls run on AMX now (set_amx)."""
    load()
    return torch.ops.eagle.avx2_attention_amx_on()
