"""Our C++ kernels build from a copy of their sources named by its contents (avx2_linear.build):
two checkouts (or installs) of the same sources hand torch's extension builder the same library
and source path, so neither rebuilds the other's library (torch rebuilds one whose source path
changed), and build with the environment's ninja; other sources, other flags or another torch
get a library of their own beside it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from eagle_infer.kernels import avx2_linear, decoder_layers


def test_checkouts_of_the_same_sources_share_one_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    calls, paths = [], []

    def load(name, sources, **kw):
        calls.append((name, sources, kw["extra_cflags"]))
        paths.append(os.environ["PATH"])

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a process that did not activate the environment
    kernels = Path(decoder_layers.SOURCE).parent
    checkouts = []
    for where in ("a", "b"):
        folder = tmp_path / where / "kernels"
        shutil.copytree(kernels, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        checkouts.append(folder)
    for folder in checkouts:
        avx2_linear.build("eagle_decoder_layers", folder / "decoder_layers.cpp")
    (a_name, a_sources, a_flags), (b_name, b_sources, b_flags) = calls
    assert (a_name, a_sources, a_flags) == (b_name, b_sources, b_flags)
    source = Path(a_sources[0])
    assert a_name.startswith("eagle_decoder_layers_") and source.is_relative_to(tmp_path / "ext")
    assert source.read_bytes() == (kernels / "decoder_layers.cpp").read_bytes()
    assert (source.parent / "kernel_calls.h").read_bytes() == (kernels / "kernel_calls.h").read_bytes()
    copied = source.stat().st_mtime_ns
    avx2_linear.build("eagle_decoder_layers", checkouts[0] / "decoder_layers.cpp")
    assert source.stat().st_mtime_ns == copied  # not rewritten: ninja rebuilds a newer source

    # another version of a header, or other flags: a library of its own, the first left in place
    (checkouts[1] / "kernel_calls.h").write_text((kernels / "kernel_calls.h").read_text() + "\n// changed\n")
    avx2_linear.build("eagle_decoder_layers", checkouts[1] / "decoder_layers.cpp")
    avx2_linear.build("eagle_decoder_layers", checkouts[0] / "decoder_layers.cpp", ["-mavx512f"])
    names = [name for name, _, _ in calls[3:]]
    assert len({a_name, *names}) == 3 and source.read_bytes() == (kernels / "decoder_layers.cpp").read_bytes()
    assert "-mavx512f" in calls[-1][2]
    # the environment's ninja first on PATH while torch builds (where it has one), not after
    bin_dir = str(Path(sys.executable).parent)
    if (Path(bin_dir) / "ninja").exists():
        assert all(p == bin_dir + os.pathsep + "/usr/bin:/bin" for p in paths)
    assert os.environ["PATH"] == "/usr/bin:/bin"

    # another install of torch (another environment's headers): a library of its own
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other" / "torch" / "__init__.py"))
    avx2_linear.build("eagle_decoder_layers", checkouts[0] / "decoder_layers.cpp")
    assert calls[-1][0] not in {a_name, *names}
