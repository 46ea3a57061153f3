"""Weight-only int8 for the target's Linear layers on a CPU (`--quantization int8`).

Each weight [out, in] is stored as int8 with one scale per output row (symmetric, absmax / 127),
a quarter of the fp32 bytes a decode step streams. The quantized target computes every Linear
as y = bf16(bf16(x) @ (w_int8 * scale).T) (+ bias): torch's weight-only int8 kernel
(aten._weight_int8pack_mm) takes bf16 activations and returns bf16. Measured on a 2-core AMD
EPYC (AVX2 only), 2 threads, a 1536x576 layer at 1 / 4 / 16 rows: fp32 F.linear 0.122 / 0.312 /
0.409 ms, the int8 kernel 0.074 / 0.123 / 0.493 ms; the 49152x576 lm_head 11.1 / 23.8 / 28.6 ms
against 3.6 / 5.2 / 18.8 ms. With fp32 activations the same kernel is 2-20x slower than fp32:
hence bf16 activations, whatever the model's dtype.

The kernel's rows do not depend on how many rows a call has (checked bitwise at 1-64 rows), so a
verify of a draft tree scores each node as a plain step would. Above MAX_ROWS rows (prefills)
the kernel is 2-2.7x slower than an fp32 GEMM (512 rows: 16.7 vs 6.2 ms), so those calls run
the same function through an fp32 GEMM on the dequantized weight, equal up to summation order.
So do layers whose input size is not a multiple of 16: the kernel computed wrongly or crashed
on some (torch 2.13, AVX2 CPU: in_features 4 or 12 gave garbage, 5 or 33 a segfault; 8 and 24
were right), and its AVX-512 path, unmeasured here, works in 16-wide vectors.

On a CPU with AVX512-BF16 where the target's Linears run our bf16 kernel (cpu_linears
"avx512_bf16"), calls of up to its BF16_MAX_ROWS rows (any number but on AMX CPUs: 512), eager
and compiled, run the same kernel on
the int8 weights instead (kernels/bf16_linear.cpp, int8_linear: each output's fp32 sum over k
times its scale, rounded to bf16 once; AMX tiles, vdpbf16ps or FMAs as the bf16 kernel's
multiply), and
compiled steps keep our kernels' settings rather than Inductor's template (compile_settings).
Measured on a 2-core AMD EPYC (Zen 4), default target, ms a step's Linears (probe_bf16_linear.py
--kernels ours_dot int8_dot, results/probe_int8_linear_amd_zen4.json): 1 / 4 / 9 rows bf16
9.98 / 9.59 / 10.09, int8 5.59 / 5.54 / 9.93. On AMX tiles (2-core Xeon with AMX,
results/probe_bf16_linear_amx_xeon.json): 1 / 7 / 16 rows int8 7.53 / 8.63 / 10.17, bf16 11.52 /
12.93 / 14.46.

Speculative decoding follows this quantized target, not the unquantized model: greedy output
equals the quantized target's plain greedy output in the tests (tiny targets,
tests/test_quantize.py). On the default target it agrees, but can part at near-ties: rounding
activations to bf16 turns the last-bit fp32 differences between a one-token step and a verify
(attention, norms) into bf16-sized ones, as with --dtype bf16 (docs/measurements.md: 3 of 5 MT-bench answers
identical over 128 tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle_infer.cpu_linears import BF16_MAX_ROWS
from eagle_infer.errors import UserError

QUANTIZATIONS = ("none", "int8")
MAX_ROWS = 256  # above: prefill-sized calls, an fp32 GEMM on the dequantized weight is faster


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [out, in] -> int8 [out, in] (row-major) and bf16 scales [out] with w ~ q * scale."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).bfloat16()
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 with per-row bf16 scales; inputs and outputs keep their dtype."""

    def __init__(self, linear: nn.Linear, ours: bool = False, dot: bool = False):
        """ours: calls of up to BF16_MAX_ROWS rows on our kernel (int8_linear, on vdpbf16ps where
        `dot`), else on torch's (_weight_int8pack_mm where in_features % 16 == 0)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.use_kernel = linear.in_features % 16 == 0
        q, scale = quantize_weight(linear.weight)
        self.weight_int8 = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.ours, self.dot = ours, dot
        if ours:  # the kernel's packed copy and scales, outside the state dict
            from eagle_infer.kernels import bf16_linear

            packed, packed_scale = bf16_linear.pack_int8(q, scale)
            self.register_buffer("packed_weight", packed, persistent=False)
            self.register_buffer("packed_scale", packed_scale, persistent=False)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight this layer computes with, [out, in]."""
        return (self.weight_int8.float() * self.scale.float()[:, None]).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, in]
        if self.ours and x2.shape[0] <= BF16_MAX_ROWS:
            y = torch.ops.eagle.int8_linear(x2, self.packed_weight, self.packed_scale, self.out_features,
                                            self.dot)  # [M, out] bf16
        elif self.use_kernel and x2.shape[0] <= MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scale)  # [M, out] bf16
        else:
            y = F.linear(x2.float(), self.dequantized()).bfloat16()
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = f", ours ({'vdpbf16ps' if self.dot else 'fma'})" if self.ours else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only{kernel}"


def quantize_linears(model: nn.Module, quantization: str, cpu_linears: str = "torch") -> int:
    """Replace every nn.Linear of `model` by an Int8Linear ("int8"); returns how many. A tied
    lm_head gets its own int8 copy and the embedding keeps its dtype (a step reads one row).
    cpu_linears: the target's backend (load_model's); "avx512_bf16" = our kernel on the int8
    weights, on AMX, vdpbf16ps or FMAs as the bf16 kernel would (bf16_linear.use_multiply_default)."""
    if quantization not in QUANTIZATIONS:
        raise UserError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return 0
    dev = next(model.parameters()).device
    if dev.type != "cpu":
        raise UserError(f"quantization=int8 is for CPU targets (torch's weight-only int8 kernel); "
                        f"the model is on {dev}")
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        raise UserError("quantization=int8 needs torch's aten._weight_int8pack_mm (torch >= 2.3)")
    ours = cpu_linears == "avx512_bf16"
    dot = False
    if ours:
        from eagle_infer.kernels import bf16_linear

        dot = bf16_linear.use_multiply_default()
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child, ours, dot))
                n += 1
    return n


def lm_head_weight(model: nn.Module) -> Tensor:
    """The target's lm_head weight [V, H] as the model computes with it (dequantized if int8)."""
    head = model.lm_head
    return head.dequantized(model.embed_tokens.weight.dtype) if isinstance(head, Int8Linear) else head.weight
