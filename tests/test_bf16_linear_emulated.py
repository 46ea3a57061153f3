"""kernels/bf16_linear.cpp's AVX-512 build (fp32 FMAs, vdpbf16ps, AMX tiles; bf16 and int8
weights) run on any x86 CPU with AVX2: a copy of it compiled against tests/avx512_emulation.h,
which implements the intrinsics it calls in plain C++ (Intel's pseudo-code), registered as
torch.ops.eagle_emu512. The sessions and CI machines here are mostly AVX2-only, so without this a
change to that build would first run on a user's AVX512-BF16 or AMX machine.

Each output must be, bit for bit, the chain the kernel promises: one fp32 sum over the k pairs
from zero, each pair's two products added in the multiply's order (the FMA loop and TDPBF16PS:
the even k first; vdpbf16ps: the odd one), times the int8 scale, rounded to bf16 once; whatever
the rows beside it (every tile shape, the chunks of k, the blocks of 16 rows, AMX's last block)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle_infer.kernels import avx2_linear, bf16_linear
from eagle_infer.quantize import quantize_weight

pytestmark = pytest.mark.skipif(not avx2_linear.supported(), reason="CPU without AVX2 / FMA")

EMULATION = Path(__file__).with_name("avx512_emulation.h")
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 16, 17, 19, 25, 32, 33, 40)


@pytest.fixture(scope="module")
def emulated():
    """torch.ops.eagle_emu512: bf16_linear.cpp's AVX-512 build on the emulated intrinsics."""
    avx2_linear.build_copy("eagle_bf16_linear_emu512", bf16_linear.SOURCE.read_text(), "eagle_emu512",
                           ["-Wno-psabi"], include=EMULATION)
    return torch.ops.eagle_emu512


def chain(x: torch.Tensor, w: torch.Tensor, odd_first: bool,
          scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T as the kernel sums it: per output an fp32 chain over the k pairs from
    zero (an odd K padded with a zero), the pair's two products in order (the products of bf16
    values, and of bf16 and int8 ones, are exact in fp32: an add rounds once, as an FMA does),
    times `scale` [N], then bf16."""
    xf, wf = F.pad(x.float(), (0, x.shape[1] % 2)), F.pad(w.float(), (0, w.shape[1] % 2))
    acc = torch.zeros(x.shape[0], w.shape[0])
    first, second = (1, 0) if odd_first else (0, 1)
    for p in range(0, xf.shape[1], 2):
        acc = acc + xf[:, p + first, None] * wf[None, :, p + first]
        acc = acc + xf[:, p + second, None] * wf[None, :, p + second]
    return (acc if scale is None else acc * scale.float()).bfloat16()


def odd_first(multiply: str, k: int) -> bool:
    """vdpbf16ps adds a pair's odd product first; on AMX only K a multiple of 32 runs on the tiles
    (others on vdpbf16ps); the FMA loop and TDPBF16PS add the even one first."""
    return multiply == "vdpbf16ps" or (multiply == "amx" and k % 32 != 0)


@pytest.fixture(params=["fma", "vdpbf16ps", "amx"])
def multiply(request, emulated):
    assert emulated.bf16_linear_set_amx(request.param == "amx") == (request.param == "amx")
    yield request.param
    emulated.bf16_linear_set_amx(False)


@pytest.mark.parametrize("n,k", [(64, 64), (100, 576), (5, 7), (33, 100), (70, 1536)])
def test_emulated_avx512_build_sums_the_promised_chain(emulated, multiply, n, k):
    dot = multiply != "fma"
    w = torch.randn(n, k).bfloat16()
    wp = bf16_linear.pack(w)
    x = torch.randn(ROWS[-1], k).bfloat16()
    want = chain(x, w, odd_first(multiply, k))
    assert emulated.bf16_linear_amx_on() == (multiply == "amx")
    for rows in ROWS:
        got = emulated.bf16_linear(x[:rows], wp, n, dot)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        assert torch.equal(got, want[:rows]), (multiply, rows)
    if not dot:  # the AVX2 build (this machine's, or the AVX-512 one) runs the same FMA chain
        assert torch.equal(bf16_linear.bf16_linear(x, wp, n), want)
    x3 = x[:6].view(2, 3, k)  # [B, T, H], as the lm_head sees it
    assert torch.equal(emulated.bf16_linear(x3, wp, n, dot), want[:6].view(2, 3, n))


@pytest.mark.parametrize("n,k", [(64, 64), (100, 576), (5, 7), (33, 100)])
def test_emulated_avx512_build_int8_sums_the_promised_chain(emulated, multiply, n, k):
    """int8 weights: made fp32 (FMAs) or bf16 (vdpbf16ps; AMX: into a buffer the tiles load)
    exactly, the same chain, times the column's scale, bf16 once."""
    dot = multiply != "fma"
    w = torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None]
    q, scale = quantize_weight(w)
    wp, s = bf16_linear.pack_int8(q, scale)
    x = torch.randn(ROWS[-1], k).bfloat16()
    want = chain(x, q, odd_first(multiply, k), scale)
    for rows in ROWS:
        assert torch.equal(emulated.int8_linear(x[:rows], wp, s, n, dot), want[:rows]), (multiply, rows)
    if not dot:
        assert torch.equal(bf16_linear.int8_linear(x, wp, s, n), want)


@pytest.mark.parametrize("n,k", [(40, 200), (5, 7), (70, 576)])
def test_this_machines_build_sums_the_promised_fma_chain(n, k):
    """The build this machine loads, on its FMA loop: the same chain bit for bit, at every row
    count (the AVX2 build: tiles of up to 4 rows over all of k, then chunks of k, then from 24 rows
    6-row tiles over a panel made fp32 once). vdpbf16ps and AMX hardware are checked against
    float64 in test_bf16_linear: the silicon's rounding inside a dot product is not the
    pseudo-code's everywhere."""
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(64, k).bfloat16()
    q, scale = quantize_weight(w.float())
    want, want8 = chain(x, w, False), chain(x, q, False, scale)
    wp, (q8, s8) = bf16_linear.pack(w), bf16_linear.pack_int8(q, scale)
    for rows in (*ROWS, 47, 64):
        assert torch.equal(bf16_linear.bf16_linear(x[:rows], wp, n), want[:rows]), rows
        assert torch.equal(bf16_linear.int8_linear(x[:rows], q8, s8, n), want8[:rows]), rows
