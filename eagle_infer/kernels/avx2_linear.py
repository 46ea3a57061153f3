"""fp32 Linears of a few rows on AVX2 + FMA (avx2_linear.cpp): a decode step's one row and a
verify's tree of rows, over weights packed in 24-column panels, as torch.ops.eagle.avx2_linear.

The C++ source is built once per machine (and version of the sources: build) by torch's extension
builder (a C++ compiler, which Inductor needs anyway, and ninja) into its cache
(~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR; ~20 s the first time on the AVX2 EPYC), then
loaded from there. Compiled steps see the op as an external call with a known output shape
(register_fake below).

    wp = pack(linear.weight)                       # [ceil(N / 24), K, 24]
    y = torch.ops.eagle.avx2_linear(x, wp, N)      # == F.linear(x, linear.weight), fp32
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

PANEL = 24
SOURCE = Path(__file__).with_name("avx2_linear.cpp")


def supported() -> bool:
    """Whether this CPU runs the kernel (AVX2 with FMA: torch's own dispatch level says so)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def build(name: str, source: Path, isa: Sequence[str] = (), text: str | None = None,
          include: Path | None = None) -> None:
    """Build (first time on a machine) and load a C++ op library for AVX2 + FMA CPUs, this one's
    and avx2_attention's (and with `isa`'s extra flags bf16_linear's): `source` (or `text`, a
    version of it) and this folder's headers (and `include`, a header read first: -include),
    copied into torch's extension cache under a name with their hash, the flags' and torch's
    install's. Every checkout with the same sources and torch loads one build, and others build
    beside it: torch's builder rebuilds a library whose command changed (the source's path,
    torch's headers' path), so two checkouts sharing one name rebuilt each other's at every
    switch (~37 s on the Zen 4). The build runs the ninja of this interpreter's environment where
    it has one (the `ninja` package), as a process that activated it would: ninja 1.13 and 1.11
    hash a command differently, so a library one built the other rebuilt."""
    import os
    import sys
    import zlib

    from torch.utils import cpp_extension

    text = source.read_text() if text is None else text
    headers = sorted(source.parent.glob("*.h")) + ([include] if include else [])
    # OpenMP: at::parallel_for's threads (and decoder_layers' own region)
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", *isa]
    crc = zlib.crc32("\0".join([text, *flags, str(Path(torch.__file__).parent)]).encode()
                     + b"".join(h.read_bytes() for h in headers))
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    folder = root / "eagle_sources" / f"{name}_{crc:08x}"
    copies = {folder / h.name: h.read_bytes() for h in headers} | {folder / source.name: text.encode()}
    folder.mkdir(parents=True, exist_ok=True)
    for path, data in copies.items():
        if not path.exists():  # an unchanged copy keeps its time: ninja rebuilds what is newer
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(path)  # whole, beside another process building the same library
    forced = ["-include", str(folder / include.name)] if include else []
    search, bin_dir = os.environ.get("PATH", ""), str(Path(sys.executable).parent)
    if (Path(bin_dir) / "ninja").exists() and not search.startswith(bin_dir + os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + search
    try:
        cpp_extension.load(f"{name}_{crc:08x}", [str(folder / source.name)], extra_cflags=flags + forced,
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = search


def build_copy(name: str, text: str, namespace: str, isa: Sequence[str] = (),
               include: Path | None = None) -> None:
    """Build `text`, a version of one of this folder's C++ sources, as library `name` with its ops
    under torch.ops.<namespace> instead of eagle (its TORCH_LIBRARY_FRAGMENT / _IMPL(eagle, ...)
    blocks renamed), against this folder's headers as they are now; `include`: a header of its own
    read before the source (-include). How a probe runs a kernel beside another revision of
    itself, and how the tests run bf16_linear's AVX-512 build on emulated intrinsics."""
    for macro in ("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
        if f"{macro}(eagle," not in text:
            raise ValueError(f"{name}: the source has no {macro}(eagle, ...) block to rename")
        text = text.replace(f"{macro}(eagle,", f"{macro}({namespace},")
    build(name, SOURCE.with_name(f"{name}.cpp"), isa, text, include)


def source_at(rev: str, source: Path) -> str:
    """The text of `source` (one of this folder's C++ files) at git revision `rev`: what a probe
    hands build_copy to run a kernel beside another revision of itself."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    return subprocess.run(["git", "-C", str(root), "show", f"{rev}:{source.resolve().relative_to(root)}"],
                          check=True, capture_output=True, text=True).stdout


@functools.cache
def load() -> None:
    """Build (first time on a machine) and load the op, and give compiled graphs its shape."""
    build("eagle_avx2_linear", SOURCE)

    @torch.library.register_fake("eagle::avx2_linear")
    def _(x: Tensor, packed_weight: Tensor, out_features: int) -> Tensor:
        return x.new_empty(*x.shape[:-1], out_features)


def pack(weight: Tensor) -> Tensor:
    """weight [N, K] fp32 -> [ceil(N / 24), K, 24]: panel p holds columns 24p..24p+23 of W.T,
    zero-padded past N."""
    n, k = weight.shape
    padded = F.pad(weight.detach().float(), (0, 0, 0, -n % PANEL))
    return padded.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


def avx2_linear(x: Tensor, packed_weight: Tensor, out_features: int) -> Tensor:
    """x [..., K] @ W.T -> [..., out_features] through W's packed copy (pack)."""
    load()
    return torch.ops.eagle.avx2_linear(x, packed_weight, out_features)
