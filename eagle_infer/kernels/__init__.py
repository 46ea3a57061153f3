"""Fused device kernels (Triton, CUDA only) and the pure-torch references they are checked against;
and the C++ CPU kernels, imported where they are used: avx2_linear (fp32 Linears of a few rows on
AVX2), bf16_linear (bf16 Linears on AVX-512, or its AVX2 build), avx2_attention (attention of a
few query rows).

Nothing here imports triton at module import time: a CPU-only install never needs it, and tests
that run kernels under TRITON_INTERPRET=1 must set that variable before triton is first imported.
"""

from eagle_infer.kernels.tree_accept import (
    TreeAccept,
    accept_greedy_reference,
    accept_sampling_reference,
    fused_accept_greedy,
    fused_accept_sampling,
    kernel_available,
)

__all__ = [
    "TreeAccept",
    "accept_greedy_reference",
    "accept_sampling_reference",
    "fused_accept_greedy",
    "fused_accept_sampling",
    "kernel_available",
]
