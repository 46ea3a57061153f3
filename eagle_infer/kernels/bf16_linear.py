"""bf16 Linears of a few rows on AVX512-BF16 CPUs (bf16_linear.cpp): a decode step's one row and
a verify's tree of rows, over weights packed in 32-column panels of k pairs, as
torch.ops.eagle.bf16_linear. Built once per machine like avx2_linear (avx2_linear.build).

    wp = pack(linear.weight)                       # [ceil(N / 32), ceil(K / 2), 32, 2]
    y = torch.ops.eagle.bf16_linear(x, wp, N)      # ~ F.linear(x, linear.weight), bf16
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

PANEL = 32
SOURCE = Path(__file__).with_name("bf16_linear.cpp")
FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]  # bf16: the output rounding (vcvtneps2bf16)


def supported() -> bool:
    """Whether this CPU has AVX512-BF16 (vdpbf16ps)."""
    return torch.cpu._is_avx512_bf16_supported()


@functools.cache
def load() -> None:
    """Build (first time on a machine) and load the op, and give compiled graphs its shape."""
    from eagle_infer.kernels.avx2_linear import build

    build("eagle_bf16_linear", SOURCE, FLAGS)

    @torch.library.register_fake("eagle::bf16_linear")
    def _(x: Tensor, packed_weight: Tensor, out_features: int) -> Tensor:
        return x.new_empty(*x.shape[:-1], out_features)


def pack(weight: Tensor) -> Tensor:
    """weight [N, K] -> bf16 [ceil(N / 32), ceil(K / 2), 32, 2]: panel p holds columns
    32p..32p+31 of W.T, each k pair (2q, 2q + 1) of a column side by side; zero-padded past N
    and past an odd K."""
    n, k = weight.shape
    padded = F.pad(weight.detach().to(torch.bfloat16), (0, k % 2, 0, -n % PANEL))
    return padded.reshape(-1, PANEL, (k + 1) // 2, 2).transpose(1, 2).contiguous()


def bf16_linear(x: Tensor, packed_weight: Tensor, out_features: int) -> Tensor:
    """x [..., K] bf16 @ W.T -> [..., out_features] bf16 through W's packed copy (pack)."""
    load()
    return torch.ops.eagle.bf16_linear(x, packed_weight, out_features)
