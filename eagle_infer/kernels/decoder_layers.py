"""A target's decoder layers as one C++ call per step on a CPU (decoder_layers.cpp), for the
targets whose Linears all run our kernels (fp32 "avx2", bf16 "avx512_bf16", int8 on our kernel)
with the attention kernel on, Llama's layers (Qwen2's, Qwen3's, Mistral's, Phi-3's) or Gemma's
and Gemma 3's (not Gemma 2's soft-capped scores): the model's layers as
torch.ops.eagle.decoder_layers, each Linear and attention on the same kernels as the Python
layers', the glue between them in C++, the whole step one OpenMP parallel region (the kernels'
range functions: kernel_calls.h).

    stack = attach(model)          # the loader does, after the weights are packed or quantized
    # model.forward then runs its layers as one call wherever applies(model, rows) holds:
    out = torch.ops.eagle.decoder_layers(stack.handle, x, cos, sin, bias, *local, write_index, kv, row0, B,
                                         taps)
    # local: the sliding layers' (cos, sin, bias) (Gemma's), else (cos, sin, bias) again
    # out [1 + len(taps), B*T, H]: x after the last layer, then the inputs of layers `taps`

The weights are registered once and named by an integer, passed in a one-value tensor (a graph
input, so a compiled step's graph is the same whichever id its target got: torch's compile cache
serves it to any process); a compiled step passes and guards a handful of step tensors instead of
every weight (measured: ~300 tensor guards and ~250 kernel and op calls a step before, ~2.4 of a
8.0 ms int8 step on the main thread outside kernels; Zen 4).
$EAGLE_FUSED_LAYERS=0 keeps the Python layers (for A/B runs).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from eagle_infer.errors import UserError
from eagle_infer.kernels import avx2_attention

SOURCE = Path(__file__).with_name("decoder_layers.cpp")
ENV = "EAGLE_FUSED_LAYERS"  # 1 (default) | 0
HEAD_DIMS = (64, 128, 256)  # the op's instances (register_stack), of the attention kernel's
AVX2, BF16, INT8 = 0, 1, 2  # the Linear kernels (decoder_layers.cpp's Kind)


@functools.cache
def load() -> None:
    """Build (first time on a machine) and load the op, and give compiled graphs its outputs."""
    from eagle_infer.kernels.avx2_linear import build

    build("eagle_decoder_layers", SOURCE)

    @torch.library.register_fake("eagle::decoder_layers")
    def _(id: Tensor, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor, local_cos: Tensor,
          local_sin: Tensor, local_bias: Tensor, write_index: Tensor, kv: Tensor, row0: int, batch: int,
          taps: list[int]) -> Tensor:
        return x.new_empty(1 + len(taps), *x.shape)


class Stack:
    """A model's registered layers: `id` names them to the op until this object is collected;
    calls of up to `max_rows` rows (its Linears' kernel limit) and attention rows go to it."""

    def __init__(self, id: int, max_rows: int):
        self.id, self.max_rows = id, max_rows
        self.handle = torch.tensor(id)  # the op's argument

    def __deepcopy__(self, memo: dict) -> None:
        """A deep copy of a model has weights of its own, which this stack does not hold: the copy
        runs its Python layers (attach it to fuse them)."""
        return None

    def __del__(self):
        try:
            torch.ops.eagle.release_stack(self.id)
        except Exception:  # interpreter shutdown
            pass


def _kernel_of(linear: nn.Module, biased: bool) -> tuple[int, Tensor, Tensor, int] | None:
    """(kind, packed weight, scale, the rows up to which it runs our kernel) of a Linear on one of
    our kernels, with a bias only where `biased` may (the op adds the q/k/v projection's), else
    None."""
    from eagle_infer.cpu_linears import BF16_MAX_ROWS, Avx2Linear, Bf16Linear
    from eagle_infer.quantize import Int8Linear

    if linear.bias is not None and not biased:
        return None
    empty = torch.empty(0)
    if type(linear) is Avx2Linear:
        return AVX2, linear.packed_weight, empty, linear.max_rows
    if type(linear) is Bf16Linear:
        return BF16, linear.packed_weight, empty, linear.max_rows
    if type(linear) is Int8Linear and linear.ours:
        return INT8, linear.packed_weight, linear.packed_scale, BF16_MAX_ROWS  # as Int8Linear.forward
    return None


def attach(model: nn.Module) -> Stack | None:
    """Register the model's layers with the op and set `model.fused_layers` (None where a layer
    has a Linear off our kernels, a bias but the q/k/v projection's, a head size the attention
    kernel lacks, is not a kind the op computes (ModelConfig.fused_layers_compute), the attention
    kernel is off, or $EAGLE_FUSED_LAYERS=0); returns the Stack."""
    choice = os.environ.get(ENV, "1")
    if choice not in ("0", "1"):
        raise UserError(f"{ENV} must be 0 or 1, got {choice!r}")
    model.fused_layers = None
    cfg = model.config
    if (choice == "0" or not avx2_attention.enabled() or cfg.head_dim not in HEAD_DIMS
            or not cfg.fused_layers_compute()  # Gemma 2's soft-capped scores
            or cfg.hidden_size % 8 or cfg.intermediate_size % 8):  # the C++ loops run 8 values at a time
        return None
    args = stack_arguments(model)
    if args is None:
        return None
    load()
    *register, max_rows = args
    stack = Stack(torch.ops.eagle.register_stack(*register), max_rows)
    model.fused_layers = stack
    return stack


def stack_arguments(
        model: nn.Module) -> tuple[list[Tensor], list[int], list[int], list[int], float, float, int] | None:
    """register_stack's arguments for the model's layers (tensors, kinds, dims, local_layers, eps,
    query_factor) and the rows up to which all its Linears run our kernels, or None where a layer
    has a Linear off our kernels or with a bias (but q/k/v's), or the Linears multiply differently
    (vdpbf16ps and FMAs)."""
    cfg = model.config
    tensors, kinds, dots, max_rows = [], [], set(), []
    empty = torch.empty(0)

    def norm(module: nn.Module) -> Tensor:  # Gemma's 1 + weight in fp32 (RMSNorm.offset_scale)
        return module.offset_scale().contiguous() if module.offset else module.weight

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        linears = [_kernel_of(m, biased=m is attn.qkv_proj) for m in modules]
        if any(k is None for k in linears):
            return None
        dtype = layer.input_layernorm.weight.dtype
        # the bias in the model's dtype, as each Linear adds it (Int8Linear keeps an fp32 one)
        bias = empty if attn.qkv_proj.bias is None else attn.qkv_proj.bias.detach().to(dtype).contiguous()
        norms = (norm(attn.q_norm), norm(attn.k_norm)) if cfg.qk_norm else (empty, empty)
        ffn_norms = (norm(layer.pre_feedforward_layernorm), norm(layer.post_feedforward_layernorm)) \
            if cfg.sandwich_norms else (empty, empty)
        tensors += [norm(layer.input_layernorm), norm(layer.post_attention_layernorm), *norms, bias,
                    *ffn_norms]
        for (kind, weight, scale, rows), m in zip(linears, modules):
            tensors += [weight, scale]
            kinds.append(kind)
            max_rows.append(rows)
            dots.add(bool(getattr(m, "dot", False)))
    if len(dots) > 1:
        return None
    dims = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, int(dots.pop()),
            int(bool(cfg.norm_offset)), int(cfg.hidden_act == "gelu_pytorch_tanh"),
            int(model.embed_tokens.weight.dtype == torch.bfloat16)]
    local = [i for i, layer in enumerate(model.layers) if layer.self_attn.sliding]
    query_factor = model.layers[0].self_attn.query_factor
    return tensors, kinds, dims, local, cfg.rms_norm_eps, query_factor, min(max_rows)


def applies(model: nn.Module, B: int, T: int) -> bool:
    """Whether model.forward runs the layers of a call of B x T tokens as one call."""
    stack = model.fused_layers
    return stack is not None and T <= avx2_attention.MAX_ROWS and B * T <= stack.max_rows
