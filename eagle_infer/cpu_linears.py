"""The Linear layers of the target and its draft head on a CPU. Backends (load_model's
cpu_linears): "torch" (MKL), "onednn" (below), "inductor": compiled steps run Inductor's C++
GEMM template on frozen weights (compile_settings), eager calls (prefill, uncompiled steps) run
as "onednn" does; and "avx2": calls of up to AVX2_MAX_ROWS rows, eager and compiled, run our
kernel (kernels/avx2_linear.cpp: the template's register block with the weight stream
prefetched), larger ones torch's; "avx512_bf16": bf16 calls of up to BF16_MAX_ROWS rows, eager
and compiled, run kernels/bf16_linear.cpp (fp32 FMAs on the bf16 weights, vdpbf16ps or AMX
tiles: bf16_linear.multiply_default; on a CPU without AVX512-BF16 its AVX2 build, FMAs only, the
name notwithstanding). auto_backend picks "avx2" for fp32 on AVX2 CPUs (measured there),
"inductor" for fp32 on AVX-512 ones, "avx512_bf16" for bf16 wherever the kernel builds (on AMX
tiles where the CPU has them).

oneDNN: fp32 at 2-512 rows, bf16 from one row where the CPU has native bf16 (AVX512-BF16 / AMX).

A verify runs 4-17 rows through the target. torch's fp32 Linear (MKL sgemm) costs 3-4x a one-row
step at those sizes on an AVX2 AMD EPYC, where oneDNN with weights prepacked costs 1.1-1.9x
(scripts/probe_linear_backends.py, docs/measurements.md). fp32 one-row steps, and calls of more than MAX_ROWS
rows, keep torch's kernel, which is as fast or faster there. In bf16 oneDNN wins at every size
up to 64 rows, one row included (AMD EPYC AVX512-BF16: 11.8 vs 23.6 ms for the target's Linears
at one row, 18.4 vs 35.1 at 16).

The prepacked weights are opaque oneDNN tensors that Inductor cannot lower, so they live in a
registry outside the graph and a custom op reads them by key: compiled graphs treat the op as
a call with a known output shape. The packed copy doubles the Linear weights' memory.

    model = load_model(path, "fp32", "cpu", cpu_linears="onednn")
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle_infer.kernels.bf16_linear import amx_supported

# Rows above which torch's kernel is as fast or faster: prefill chunks and training batches.
# AMD EPYC AVX2, 2 threads, the target's 121 Linears (scripts/probe_linear_backends.py):
# M = 64 / 128 / 256 / 512 / 2048: torch 170 / 279 / 485 / 872 / 3567 ms, oneDNN prepacked
# 135 / 237 / 458 / 890 / 3805 ms.
MAX_ROWS = 512
# dtypes whose one-row calls (every plain decode step) go through oneDNN too. bf16: torch's kernel
# takes 2x oneDNN's prepacked one for the target's Linears at one row (AMD EPYC AVX512-BF16,
# 2 threads: 23.6 vs 11.8 ms). fp32: MKL is as fast: compiled bench there, plain 23.2 tok/s with
# torch's one-row kernel, 21.6 with oneDNN's.
ONE_ROW_DTYPES = (torch.bfloat16,)

# oneDNN-packed weights by OneDNNLinear.key; an entry goes when its module is collected, so
# loading a model again does not keep the old model's packed copy alive.
_PACKED: dict[int, Tensor] = {}
_KEYS = itertools.count()


# Defined through torch.library.Library rather than @custom_op: a step calls this op 121 times,
# and custom_op's Python wrapper costs ~10 us a call more (4.5 vs 11.2 us measured).
_LIB = torch.library.Library("eagle", "FRAGMENT")
_LIB.define("onednn_linear(Tensor x, Tensor weight, int key) -> Tensor")


def _onednn_linear(x: Tensor, weight: Tensor, key: int) -> Tensor:
    """x [..., in] @ weight.T through the packed copy of `weight` (the copy is _PACKED[key])."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[key], None, "none", [], "")


_LIB.impl("onednn_linear", _onednn_linear, "CPU")


@torch.library.register_fake("eagle::onednn_linear")
def _(x: Tensor, weight: Tensor, key: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


onednn_linear = torch.ops.eagle.onednn_linear


class OneDNNLinear(nn.Linear):
    """A bias-free nn.Linear (same parameters and state dict) whose calls of up to MAX_ROWS rows
    go through oneDNN (one-row calls only in ONE_ROW_DTYPES); use_onednn_linears converts only
    bias-free layers. With compiled_template, a compiled step traces a plain F.linear instead,
    which Inductor lowers to its GEMM template on the frozen weight (compile_settings)."""

    key: int
    compiled_template: bool = False

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        if (rows > MAX_ROWS or (rows == 1 and self.weight.dtype not in ONE_ROW_DTYPES)
                or (self.compiled_template and torch.compiler.is_compiling())):
            return F.linear(x, self.weight)
        return onednn_linear(x, self.weight, self.key)


# Rows up to which an "avx2" Linear runs our kernel, above which torch's (prefill chunks): AMD
# EPYC AVX2, 2 threads, 3072 x 576: 16 / 32 / 64 rows ours 1.56 / 2.98 / 5.97 ms, torch's
# 1.96 / 2.73 / 4.36; 1 / 4 rows 0.16 / 0.39 against 0.30 / 1.31. A decode step or a verify
# (a tree's nodes times the batch) on a CPU stays under it, so its rows are bitwise the
# one-row step's.
AVX2_MAX_ROWS = 32


class KernelLinear(nn.Linear):
    """An nn.Linear (same parameters and state dict) whose calls of up to max_rows rows, eager and
    compiled, run our op torch.ops.eagle.<op> on its packed copy of the weight (the buffer
    packed_weight, outside the state dict), its bias (Qwen2's q/k/v) added after; larger calls
    run torch's F.linear. Where torch's addmm adds the bias before rounding to bf16, this rounds
    twice: equally close to the fp32 result, and still each row's own (rows are independent)."""

    packed_weight: Tensor
    max_rows: int
    op: str

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() // x.shape[-1] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        y = self.kernel(x)
        return y if self.bias is None else y + self.bias

    def kernel(self, x: Tensor) -> Tensor:
        return getattr(torch.ops.eagle, self.op)(x, self.packed_weight, self.out_features)


class Avx2Linear(KernelLinear):
    """fp32, kernels/avx2_linear."""

    max_rows, op = AVX2_MAX_ROWS, "avx2_linear"


# Rows up to which an "avx512_bf16" Linear runs our kernel (calls of more run torch's): no limit but on AMX.
# 2-core Xeon with AVX512-BF16, 2 threads, weights streamed from memory, ms a call: 3072 x 576 at
# 1 / 16 / 64 / 512 rows ours 0.146 / 0.273 / 0.801 / 6.35, oneDNN prepacked 0.183 / 0.447 / 1.336
# / 10.46, torch's 0.251 / 0.571 / 1.511 / 10.08 (scripts/probe_bf16_linear.py): without AMX
# oneDNN multiplies with vdpbf16ps, at half the multiply-adds a cycle of the fp32 FMAs that the
# kernel feeds with the bf16 weights. On a 2-core AMD EPYC (Zen 4) the kernel on vdpbf16ps (its
# default there) is level with oneDNN and torch at 512 rows and 1.2-2x faster below
# (results/probe_bf16_linear_amd_zen4.json); there the FMAs would be 2x slower at 512. Without
# AVX512-BF16 (the kernel's AVX2 build) every call runs ours: torch emulates bf16 there, 8x slower
# at 64-512 rows on a 2-core AVX2 AMD EPYC (results/probe_bf16_linear_amd_avx2.json). Above 512
# rows (a long prompt's prefill) too: on the Zen 4 ours on vdpbf16ps ran 1.10-1.40x torch's per
# shape at 1,089 rows (results/probe_bf16_linear_amd_zen4_1089.json), and a ~1,100-token prefill
# took 1.28 s against 1.44 with torch's above 512 rows; with int8 weights (quantize.Int8Linear:
# our kernel up to BF16_MAX_ROWS, else an fp32 GEMM on the weight dequantized each call) 1.45 s
# against 2.57 (scripts/probe_prefill.py --compare linears, results/probe_prefill_linears*). So
# every call runs ours, but on AMX CPUs, where ours is unmeasured that large against oneDNN's tiles.
BF16_MAX_ROWS = 512 if amx_supported() else 1 << 62


class Bf16Linear(KernelLinear):
    """bf16, kernels/bf16_linear, on fp32 FMAs or on dot products (`dot`: bf16_linear.use_multiply_default,
    set when the weights are packed, the same for a target and its head): AMX tiles where
    bf16_linear.set_amx put them (the default on AMX CPUs), else vdpbf16ps."""

    max_rows, op = BF16_MAX_ROWS, "bf16_linear"
    dot = False

    def kernel(self, x: Tensor) -> Tensor:
        return torch.ops.eagle.bf16_linear(x, self.packed_weight, self.out_features, self.dot)


def _use_kernel_linears(model: nn.Module, kernel, cls: type, dtype: torch.dtype) -> int:
    """Make every CPU Linear of `model` in `dtype` a `cls`, with `kernel`'s packed copy of its
    weight (kernel: kernels.avx2_linear or kernels.bf16_linear, built the first time on this
    machine), biased ones too (on torch's bf16 addmm the q/k/v projections of Qwen2.5-0.5B's shape
    streamed their weights at ~5 GB/s, a fifth of its decode step: docs/measurements.md); returns
    how many."""
    kernel.load()
    linears = _linears(model, (dtype,), with_bias=True)
    for m in linears:
        m.register_buffer("packed_weight", kernel.pack(m.weight), persistent=False)
        m.__class__ = cls
    return len(linears)


def use_avx2_linears(model: nn.Module) -> int:
    """Make every fp32 CPU Linear of `model` an Avx2Linear (building the kernel the
    first time on this machine); returns how many."""
    from eagle_infer.kernels import avx2_linear

    if not avx2_linear.supported():
        raise RuntimeError("cpu_linears=avx2: this CPU has no AVX2 / FMA")
    return _use_kernel_linears(model, avx2_linear, Avx2Linear, torch.float32)


def use_bf16_linears(model: nn.Module) -> int:
    """Make every bf16 CPU Linear of `model` a Bf16Linear (building the kernel the
    first time on this machine); returns how many."""
    from eagle_infer.kernels import bf16_linear

    if not bf16_linear.supported():
        raise RuntimeError("cpu_linears=avx512_bf16: this CPU has neither AVX512-BF16 nor AVX2 with FMA")
    n = _use_kernel_linears(model, bf16_linear, Bf16Linear, torch.bfloat16)
    dot = bf16_linear.use_multiply_default()
    for m in model.modules():
        if isinstance(m, Bf16Linear):
            m.dot = dot
    return n


def bf16_multiply(model: nn.Module) -> str | None:
    """What the model's "avx512_bf16" Linears (bf16, or int8 on that kernel) multiply on
    ("amx", "vdpbf16ps" or "fma"), None without them."""
    from eagle_infer.kernels import bf16_linear
    from eagle_infer.quantize import Int8Linear

    kernels = [m for m in model.modules()
               if isinstance(m, Bf16Linear) or (isinstance(m, Int8Linear) and m.ours)]
    if not kernels:
        return None
    return ("amx" if bf16_linear.amx_on() else "vdpbf16ps") if kernels[0].dot else "fma"


def bf16_default() -> bool:
    """Whether "auto" picks "avx512_bf16" for bf16 Linears: a CPU whose kernel builds here. With
    AVX512-BF16 measured faster than oneDNN's prepacked bf16 Linears at 1-512 rows (on AMX CPUs
    the kernel multiplies on the tiles too: 1.2-1.7x oneDNN's at 1-16 rows, level at 64, on a
    2-core Xeon with AMX, results/probe_bf16_linear_amx_xeon.json); on an AVX2 CPU without it
    (the kernel's AVX2 build) oneDNN has no bf16 Linear and torch's emulates bf16 several times
    slower than fp32, while the kernel streams half fp32's bytes (results/probe_bf16_linear_amd_avx2.json)."""
    from eagle_infer.kernels import bf16_linear

    if not bf16_linear.supported():
        return False
    try:
        bf16_linear.load()
    except Exception as e:  # no compiler or ninja: oneDNN's Linears need none
        warnings.warn(f"cpu_linears: the avx512_bf16 kernel did not build ({e}); using oneDNN's",
                      stacklevel=2)
        return False
    return True


def avx2_default() -> bool:
    """Whether "auto" picks "avx2" for fp32: an AVX2 CPU without AVX-512 (where it was measured
    against the template: AVX-512 CPUs keep "inductor") whose kernel builds here."""
    from eagle_infer.kernels import avx2_linear

    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    try:
        avx2_linear.load()
    except Exception as e:  # no compiler or ninja: the template needs a compiler too
        warnings.warn(f"cpu_linears: the avx2 kernel did not build ({e}); using the next backend",
                      stacklevel=2)
        return False
    return True


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """fp32 wherever oneDNN is; bf16 too where the CPU has native bf16 (oneDNN's bf16 check)."""
    mkldnn = torch.ops.mkldnn
    bf16 = hasattr(mkldnn, "_is_mkldnn_bf16_supported") and mkldnn._is_mkldnn_bf16_supported()
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


def _linears(model: nn.Module, dtypes: tuple[torch.dtype, ...], with_bias: bool = False) -> list[nn.Linear]:
    """The CPU nn.Linears of `model` with weights in `dtypes` (bias-free ones unless `with_bias`):
    what a backend converts."""
    return [m for m in model.modules() if type(m) is nn.Linear and (with_bias or m.bias is None)
            and m.weight.device.type == "cpu" and m.weight.dtype in dtypes]


def _convertible(model: nn.Module) -> list[nn.Linear]:
    """The Linears of `model` use_onednn_linears packs (its fp32 ones: use_avx2_linears)."""
    return _linears(model, packable_dtypes())


def _weight_bytes(linears: list[nn.Linear]) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in linears)


def convertible_bytes(model: nn.Module) -> int:
    """Bytes of the weights use_onednn_linears would pack (the packed copy's size)."""
    return _weight_bytes(_convertible(model))


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# Packed copies of the Linear weights with cpu_linears="inductor": oneDNN's for eager calls, and
# a frozen one in each compiled graph that holds the target (the plain step, the verify step).
TEMPLATE_COPIES = 3


def template_isa() -> bool:
    """Whether Inductor has its C++ GEMM template's kernels for this CPU (AVX2 / AVX-512)."""
    from torch._inductor import cpu_vec_isa

    return isinstance(cpu_vec_isa.pick_vec_isa(), (cpu_vec_isa.VecAVX2, cpu_vec_isa.VecAVX512))


def auto_backend(model: nn.Module) -> str:
    """"onednn" where this torch has it, the model has Linears it packs (bf16 ones only where the
    CPU has native bf16) and the packed copy fits twice over in free memory (a server still
    needs room for caches and requests), else "torch"; for fp32 Linears "avx2" instead where
    avx2_default() (one packed copy, as oneDNN's), else "inductor" where the template has its
    kernels and TEMPLATE_COPIES packed copies fit twice over; for bf16 ones "avx512_bf16" where
    bf16_default() (one packed copy).

    Why: measured on the AVX2 AMD EPYC (2 threads, default target), compiled plain fp32 steps of
    24-28 ms on the template against 44-51 ms on MKL / oneDNN, and the avx2 kernel faster than
    the template at 1 and 4 rows (docs/measurements.md); on a Xeon with AVX512-BF16 the bf16
    kernel faster than oneDNN's bf16 Linears at 1-512 rows (BF16_MAX_ROWS). bf16 is not measured
    on the template (its weights would miss torch's compile cache there)."""
    free = available_memory_bytes()

    def ours_fit(dtype: torch.dtype) -> bool:  # our kernels pack biased Linears too (Qwen2's q/k/v)
        return free is None or 2 * _weight_bytes(_linears(model, (dtype,), with_bias=True)) <= free

    bf16 = _linears(model, (torch.bfloat16,))
    if bf16 and not _linears(model, (torch.float32,)) and bf16_default():  # on any AVX2 CPU, no oneDNN needed
        if ours_fit(torch.bfloat16):
            return "avx512_bf16"
    need = convertible_bytes(model) if available() else 0
    if need == 0:
        return "torch"
    if free is not None and 2 * need > free:
        return "torch"
    dtypes = {m.weight.dtype for m in _convertible(model)}  # not empty: need > 0
    fp32 = dtypes == {torch.float32}
    if fp32 and avx2_default():
        return "avx2" if ours_fit(torch.float32) else "torch"
    if fp32 and template_isa() and (free is None or 2 * TEMPLATE_COPIES * need <= free):
        return "inductor"
    return "onednn"


def use_onednn_linears(model: nn.Module, rows_hint: int = 16, compiled_template: bool = False) -> int:
    """Make every bias-free CPU Linear of `model` in packable_dtypes() an OneDNNLinear (that
    compiled steps trace as F.linear where compiled_template); returns how many."""
    if not available():
        raise RuntimeError("cpu_linears=onednn: this torch build has no oneDNN (mkldnn) linear ops")
    linears = _convertible(model)
    for m in linears:
        key = next(_KEYS)
        _PACKED[key] = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().contiguous(), rows_hint)
        weakref.finalize(m, _PACKED.pop, key, None)
        m.__class__ = OneDNNLinear
        m.key = key
        m.compiled_template = compiled_template
    return len(linears)


def use_backend_linears(model: nn.Module, backend: str) -> int:
    """The eager side of a backend for `model` (a target, or a head loaded for it): oneDNN-packed
    Linears for "onednn" (an error without oneDNN) and for "inductor" where this torch has oneDNN,
    traced as F.linear by compiled steps for "inductor"; our kernels' Linears for "avx2" (fp32)
    and "avx512_bf16" (bf16); nothing for "torch". Returns how many."""
    if backend == "avx2":
        return use_avx2_linears(model)
    if backend == "avx512_bf16":
        return use_bf16_linears(model)
    if backend == "onednn" or (backend == "inductor" and available()):
        return use_onednn_linears(model, compiled_template=backend == "inductor")
    return 0


# Compiled steps over frozen weights: Inductor lowers every Linear to its C++ GEMM template (a
# weight vector loaded, or for int8 converted to fp32, in registers and reused across the
# call's rows). The template alone ("CPP"), not also torch's kernels ("CPP,ATEN", which Inductor
# then times per shape and picks from): one kernel at every row count, so a verify's rows equal
# one-row steps' bit for bit (checked at 1-64 rows), and a shorter first compile (int8 plain
# step 180 s instead of 210 s, about the same speed). AMD EPYC AVX2, 2 threads, default target,
# 3 MT-bench prompts x 64 tokens: int8 plain 31.2 -> 44.4-48.4 tok/s (torch's
# _weight_int8pack_mm -> template; the template computes and returns fp32 where torch's kernel
# rounds to bf16, so compiled int8 steps are not bitwise the eager ones); fp32 (cpu_linears
# "inductor") plain TPOT 46.1 -> 35.3 ms ("CPP,ATEN" in another run: 47.7 -> 28.3), and 44.3 ->
# 27.9 ms on 5 prompts x 128 (docs/measurements.md).
FROZEN_GEMM = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}


def without_mkl_prepack() -> contextlib.AbstractContextManager:
    """A context manager (re-enterable) under which Inductor's freezing leaves fp32 Linear weights
    to the GEMM template instead of first packing them for MKL.

    Why: with MKL in the build, freezing rewrites every fp32 Linear on a constant weight into
    MKL's packed linear, whose packed weight is an opaque mkldnn tensor; the template then drops
    it for its own packed copy, but the FX graph cache has already refused the graph ("Bypassing
    FX Graph Cache because 'mkldnn tensors unpickleable'", torch 2.13), so every start compiled
    the whole step anew (AMD EPYC AVX2, 2 threads, default target, fp32 plain step: two starts in
    a row 163 and 169 s of warm-up, under cProfile). That rewrite asks `torch._C.has_mkl` first;
    answered False, the matmul reaches the template directly (the same kernels), and the graph
    caches. bf16 weights take oneDNN's packing whatever this says (and stay uncached)."""
    from unittest import mock

    return mock.patch.object(torch._C, "has_mkl", False)


def without_amx_int8_gemm() -> contextlib.AbstractContextManager:
    """A context manager (re-enterable) under which Inductor's GEMM template multiplies bf16
    activations by int8 weights (int8 Linears on torch's kernel) on its AVX-512 micro-kernel at
    every row count, never on its AMX one.

    Why: Inductor picks AMX tiles for such a GEMM from 5 rows up and AVX-512 FMAs below (torch
    2.13, create_micro_gemm), and the two sum a row's products in different orders. A verify's
    rows then differed from the one-row plain steps' in the last bits, which the next int8
    Linear's bf16 rounding made larger: compiled fp32 int8 speculative output left plain greedy
    output after 10-64 tokens on 5 of 5 MT-bench prompts (Xeon with AMX). Without the AMX
    configs, every row count gives each row's bits (checked at 1-24 rows). On CPUs without AMX
    this changes nothing: those configs never match there."""
    from unittest import mock

    import torch._inductor.select_algorithm  # noqa: F401  (cpp_micro_gemm imports it back)
    from torch._inductor.codegen import cpp_micro_gemm
    from torch._inductor.cpu_vec_isa import VecAMX

    configs = cpp_micro_gemm.micro_gemm_configs
    kept = {cls: [c for c in cs if not (c.vec_isa_cls is VecAMX and c.input_dtype == torch.bfloat16
                                        and c.input2_dtype == torch.int8)]
            for cls, cs in configs.items()}
    return mock.patch.dict(configs, kept)


@functools.cache
def _uncached_template_from_string():
    """Inductor's own KernelTemplate._template_from_string (read before any patch replaces it)."""
    from torch._inductor.codegen.common import KernelTemplate

    return KernelTemplate.__dict__["_template_from_string"].__func__


@functools.cache
def _jinja_template(source: str):
    return _uncached_template_from_string()(source)


def cached_kernel_templates() -> contextlib.AbstractContextManager:
    """A context manager (re-enterable) under which Inductor parses each jinja source of its C++
    GEMM template once per process instead of at every use.

    Why: Inductor (torch 2.13) builds a new jinja Template from the same few source strings for
    every GEMM it renders (KernelTemplate._template_from_string: ~10 a render, each a full jinja
    parse and Python compile); that parsing took 59 of the 209 s that a first compile of the
    plain fp32 step took (121 GEMMs, each rendered twice; AMD EPYC AVX2, under cProfile). A jinja
    Template renders any number of times, and the environment it comes from is one cached
    object, so one Template per source is the same as a new one each time."""
    from unittest import mock

    from torch._inductor.codegen.common import KernelTemplate

    if not isinstance(KernelTemplate.__dict__.get("_template_from_string"), staticmethod):
        return contextlib.nullcontext()  # another torch: leave it alone
    _uncached_template_from_string()
    return mock.patch.object(KernelTemplate, "_template_from_string", staticmethod(_jinja_template))


@dataclass(eq=False)
class FrozenCompile:
    """Inductor settings (FROZEN_GEMM) for compiled steps over `modules` (a target and its head),
    and their compile-cache tag.

    The tag fingerprints every frozen constant, i.e. all parameters and buffers but the KV
    cache's: torch (2.13) stores frozen constants (the GEMM template's prepacked weights among
    them) by value in its FX graph cache, keyed by the graph and shapes alone, so a second model
    of the same shapes computed with the first one's weights (measured: outputs off by ~3 on a
    cache hit). torch.compiler's cache_key_tag is the knob meant to break such caches. It is
    computed at its first read, i.e. the first compile (generate.WithInductorSettings), not when a
    decoder is built: hashing the default target's weights takes 1.6 s, and many decoders are
    built that never compile, or compile later."""

    options: dict
    modules: tuple[nn.Module, ...]

    @functools.cached_property
    def cache_tag(self) -> str:
        from eagle_infer.model import KVCache

        h, seen = hashlib.blake2b(digest_size=16), set()
        for mod in self.modules:
            for m in mod.modules():
                if isinstance(m, KVCache):  # written every step: not a constant
                    continue
                own = itertools.chain(m.named_parameters(recurse=False), m.named_buffers(recurse=False))
                for name, t in own:
                    if t is None or t.data_ptr() in seen:  # a tied weight once
                        continue
                    seen.add(t.data_ptr())
                    h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
                    _hash_into(h, t)
        # "v2": graphs from before without_amx_int8_gemm (AMX int8 GEMMs) are not reused
        return "frozen-gemm-v2-" + h.hexdigest()


def compile_settings(*modules: nn.Module) -> FrozenCompile | None:
    """How compiled steps over these modules (a target and its head) compile on a CPU: on
    FROZEN_GEMM (FrozenCompile) where the target's Linears are int8 on torch's kernel (not ours) or
    its cpu_linears is "inductor", on a CPU whose template kernels exist (AVX2 / AVX-512); else
    None (defaults)."""
    from eagle_infer.quantize import Int8Linear

    int8 = any(isinstance(m, Int8Linear) and not m.ours for mod in modules for m in mod.modules())
    if not (int8 or getattr(modules[0], "cpu_linears", None) == "inductor") or not template_isa():
        return None
    # An int8 Linear returns bf16 (torch's kernel rounds its fp32 sums), which an fp32 target casts
    # back. Inductor drops that round trip where it fuses the cast into the GEMM's epilogue, and
    # whether it fuses depends on the graph: the plain step's lm_head returned bf16 logits, the
    # verify's fp32 ones, so argmax broke bf16 ties differently and compiled fp32 int8
    # speculative output left plain greedy output after 10-64 tokens (5 MT-bench prompts; Xeon
    # with AMX). emulate_precision_casts keeps every such rounding, as eager does.
    return FrozenCompile(FROZEN_GEMM | {"emulate_precision_casts": True} if int8 else FROZEN_GEMM, modules)


def step_options(target: nn.Module, settings: FrozenCompile | None, mode: str | None) -> dict | None:
    """Inductor options of compiled steps over `target` on a CPU with our kernels' Linears
    ("avx2", "avx512_bf16"; not frozen, default mode), else None:

    - cpp_wrapper: the graph's kernels and external ops called from generated C++, not from
      generated Python. A step makes ~180 calls (121 GEMMs, 30 attention and 30 KV-write ops, the
      small kernels between them), and the Python wrapper spent tens of us on each: a plain step
      44.9 -> 40.0 ms (AMD EPYC AVX2, fp32, 2 threads, kv 512), 17.1 -> 15.9 ms (Xeon AVX512-BF16,
      bf16, kv 300), each interleaved in one process, the same logits.
    - emulate_precision_casts: fused kernels round to bf16 where eager's ops do instead of keeping
      fp32 between them. With our Linears and attention a row's bits do not depend on the rows
      beside it, but Inductor fuses a one-row step and a many-row verify differently, so where the
      graphs keep fp32 differs and bf16 outputs parted; rounding as eager does, greedy speculative
      decoding equals plain decoding in bf16 too (Xeon AVX512-BF16, 5 MT-bench prompts x 128
      tokens: 5 of 5 identical, 2 of 5 without; the same speed). fp32 steps are unchanged by it."""
    cpu = next(target.parameters()).device.type == "cpu"
    ours = getattr(target, "cpu_linears", None) in ("avx2", "avx512_bf16")
    if not (cpu and mode is None and settings is None and ours):
        return None
    return {"cpp_wrapper": True, "emulate_precision_casts": True}


def _hash_into(h, t: Tensor) -> None:
    """Feed a CPU tensor's bytes to h, without a copy where it is contiguous (or a column-major matrix)."""
    t = t.detach()
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
        t = t.t()
    t = t.contiguous().reshape(-1)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    h.update(memoryview(t.view(ints).numpy()))
