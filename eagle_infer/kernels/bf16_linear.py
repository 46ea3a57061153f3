"""bf16 Linears of a few rows on a CPU (bf16_linear.cpp): a decode step's one row and a verify's
tree of rows, over weights packed in 32-column panels of k pairs, as torch.ops.eagle.bf16_linear.
Built once per machine like avx2_linear (avx2_linear.build): for AVX-512 with AVX512-BF16 where
the CPU has it (fp32 FMAs, vdpbf16ps or AMX tiles), else for AVX2 + FMA (the FMA loop only).

    wp = pack(linear.weight)                       # [ceil(N / 32), ceil(K / 2), 32, 2]
    y = torch.ops.eagle.bf16_linear(x, wp, N)      # ~ F.linear(x, linear.weight), bf16
    y = torch.ops.eagle.bf16_linear(x, wp, N, True)  # on vdpbf16ps or AMX tiles (multiply_default)

Weight-only int8 (quantize.Int8Linear): the same panels of int8 weights and their scales.

    wp, s = pack_int8(q, scale)                    # int8 [ceil(N / 32), ceil(K / 2), 32, 2], fp32
    y = torch.ops.eagle.int8_linear(x, wp, s, N, dot)  # ~ bf16(x @ (q * scale).T)
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

PANEL = 32
SOURCE = Path(__file__).with_name("bf16_linear.cpp")
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]  # bf16: vdpbf16ps, vcvtneps2bf16
DOT_ENV = "EAGLE_BF16_DOT"  # auto | amx | vdpbf16ps | fma


def supported() -> bool:
    """Whether this CPU runs the kernel: AVX2 with FMA (the FMA loop), or AVX512-BF16."""
    from eagle_infer.kernels import avx2_linear

    return avx512_bf16_supported() or avx2_linear.supported()


def avx512_bf16_supported() -> bool:
    """Whether this CPU has AVX512-BF16 (vdpbf16ps): the AVX-512 build, with its dot products."""
    return torch.cpu._is_avx512_bf16_supported()


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (AuthenticAMD, GenuineIntel), or "" where there is none."""
    from eagle_infer.loader import cpuinfo_field

    return cpuinfo_field("vendor_id")


def fma_halves() -> bool:
    """Whether the CPU runs each 256-bit FMA as two 128-bit halves: AMD Zen 1 / Zen+ (family 0x17,
    models below 0x30) and Hygon Dhyana (family 0x18, a Zen 1), one 8-float FMA a cycle a core
    where Zen 2 runs two. The AVX2 build's rows past the first cost more there: the lm_head at 2 /
    3 / 4 rows 1.09 / 1.30 / 1.78x one row (Zen 2: 4 rows 1.11x), so a smaller tree wins
    (TreeConfig.default_for; results/probe_bf16_linear_amd_zen1.json)."""
    from eagle_infer.loader import cpuinfo_field

    try:
        family, model = int(cpuinfo_field("cpu family")), int(cpuinfo_field("model"))
    except ValueError:  # no /proc/cpuinfo, or not x86's fields
        return False
    vendor = cpu_vendor()
    return ((vendor == "AuthenticAMD" and family == 0x17 and model < 0x30)
            or (vendor == "HygonGenuine" and family == 0x18))


def multiply_default() -> str:
    """What the kernel multiplies on: "amx" (AMX tiles, TDPBF16PS), "vdpbf16ps" or "fma" (fp32 FMAs
    on the bf16 weights): $EAGLE_BF16_DOT, where "auto" = amx on AMX CPUs, vdpbf16ps on AMD ones,
    else fma. Measured (scripts/probe_bf16_linear.py, 2 threads): on a 2-core AMD EPYC (Zen 4)
    vdpbf16ps level with the FMAs at 1-4 rows, 1.3-1.7x at 8-16 and 2x at 64-512; on a 2-core
    Intel Xeon (AVX512-BF16, no AMX) the FMAs ran twice vdpbf16ps's multiply-adds a cycle
    (oneDNN's bf16 Linears, which use it, 1.6x slower at 16 rows). One choice a process: a row's
    bits depend on it, and greedy speculative output equals plain output only within one choice."""
    from eagle_infer.errors import UserError

    choice = os.environ.get(DOT_ENV, "auto")
    if choice not in ("auto", "amx", "vdpbf16ps", "fma"):
        raise UserError(f"{DOT_ENV} must be auto, amx, vdpbf16ps or fma, got {choice!r}")
    if not avx512_bf16_supported():  # the AVX2 build: FMAs only
        if choice in ("amx", "vdpbf16ps"):
            raise UserError(f"{DOT_ENV}={choice} needs a CPU with AVX512-BF16; this one runs the kernel "
                            "on fp32 FMAs only (fma or auto)")
        return "fma"
    return choice if choice != "auto" else cpu_multiply()


def cpu_multiply() -> str:
    """What "auto" multiplies on, from the CPU alone: "amx" on AMX CPUs, "vdpbf16ps" on AMD ones
    with AVX512-BF16, else "fma" (the measurements: multiply_default). The attention kernel's
    default scores follow the same rule (avx2_attention.default_bf16_scores)."""
    if not avx512_bf16_supported():
        return "fma"
    if amx_supported():
        return "amx"
    return "vdpbf16ps" if cpu_vendor() == "AuthenticAMD" else "fma"


def dot_default() -> bool:
    """Whether the kernel takes bf16 inputs and multiplies on dot products (AMX tiles or
    vdpbf16ps: `dot`), not on fp32 FMAs; set_amx says which of the two."""
    return multiply_default() != "fma"


def use_multiply_default() -> bool:
    """The multiply of multiply_default() for the Linears packed now: sets the process's AMX switch
    to it (set_amx) and returns their `dot` (dot_default). Called where a model's weights are
    packed, so $EAGLE_BF16_DOT at a load is what its Linears run."""
    set_amx(multiply_default() == "amx")
    return dot_default()


def amx_supported() -> bool:
    """Whether this CPU has AMX tiles (AMX-BF16)."""
    return torch.cpu._is_amx_tile_supported()


def set_amx(on: bool) -> bool:
    """From now on, in this process, `dot` calls whose in_features is a multiple of 32 multiply on
    AMX tiles (on, where the CPU has them and Linux lets the process use them) or on vdpbf16ps;
    returns whether they use AMX."""
    load()
    return torch.ops.eagle.bf16_linear_set_amx(on)


def amx_on() -> bool:
    """Whether `dot` calls run on AMX now (set_amx)."""
    load()
    return torch.ops.eagle.bf16_linear_amx_on()


@functools.cache
def load() -> None:
    """Build (first time on a machine) and load the op, and give compiled graphs its shape."""
    from eagle_infer.kernels.avx2_linear import build

    if avx512_bf16_supported():
        build("eagle_bf16_linear", SOURCE, AVX512_FLAGS)
    else:  # another library name: a machine's cache can hold both builds
        build("eagle_bf16_linear_avx2", SOURCE)
    torch.ops.eagle.bf16_linear_set_amx(multiply_default() == "amx")

    @torch.library.register_fake("eagle::bf16_linear")
    def _(x: Tensor, packed_weight: Tensor, out_features: int, dot: bool = False) -> Tensor:
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("eagle::int8_linear")
    def _(x: Tensor, packed_weight: Tensor, scale: Tensor, out_features: int, dot: bool = False) -> Tensor:
        return x.new_empty(*x.shape[:-1], out_features)


def pack(weight: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """weight [N, K] -> `dtype` [ceil(N / 32), ceil(K / 2), 32, 2]: panel p holds columns
    32p..32p+31 of W.T, each k pair (2q, 2q + 1) of a column side by side; zero-padded past N
    and past an odd K."""
    n, k = weight.shape
    padded = F.pad(weight.detach().to(dtype), (0, k % 2, 0, -n % PANEL))
    return padded.reshape(-1, PANEL, (k + 1) // 2, 2).transpose(1, 2).contiguous()


def pack_int8(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """An int8 weight q [N, K] and its scales [N] -> the packed int8 weight (pack) and fp32 scales
    [ceil(N / 32) * 32], zero-padded past N."""
    return pack(q, torch.int8), F.pad(scale.detach().float(), (0, -q.shape[0] % PANEL)).contiguous()


def bf16_linear(x: Tensor, packed_weight: Tensor, out_features: int, dot: bool = False) -> Tensor:
    """x [..., K] bf16 @ W.T -> [..., out_features] bf16 through W's packed copy (pack), on fp32
    FMAs or (dot) on vdpbf16ps."""
    load()
    return torch.ops.eagle.bf16_linear(x, packed_weight, out_features, dot)


def int8_linear(x: Tensor, packed_weight: Tensor, scale: Tensor, out_features: int,
                dot: bool = False) -> Tensor:
    """x [..., K] bf16 @ (q * scale).T -> [..., out_features] bf16 through pack_int8's copy of q and
    scale: each output's sum over k times its scale, rounded to bf16 once."""
    load()
    return torch.ops.eagle.int8_linear(x, packed_weight, scale, out_features, dot)
