"""Weight-only int8 targets (--quantization int8): each Linear computes with its int8 weight and
per-row scales, a row's result does not depend on the rows beside it, and speculative greedy
output equals the quantized target's plain greedy output, eager and compiled."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_avx2_attention import target_for_the_kernel
from test_speculative import oracle_head, prompts_for, random_head, tiny_target

from eagle_infer import cpu_linears, quantize
from eagle_infer.errors import UserError
from eagle_infer.generate import generate
from eagle_infer.heads import load_head_for, save_head
from eagle_infer.kernels import bf16_linear
from eagle_infer.loader import load_model
from eagle_infer.quantize import Int8Linear, quantize_linears, quantize_weight
from eagle_infer.speculative import SpecDecoder, generate_speculative
from eagle_infer.tree import TreeConfig


def test_quantized_weight_is_within_half_a_step_of_the_original():
    w = torch.randn(48, 64) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different scale
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and q.abs().max() <= 127
    err = (q.float() * scale.float()[:, None] - w).abs()
    assert (err <= 0.5 * scale.float()[:, None] * 1.01).all()
    assert (q.abs().amax(1) >= 126).all()  # each row uses its whole range


@pytest.mark.parametrize("in_features", [64, 40])  # 40: not a multiple of 16, the fallback path
def test_int8_linear_computes_the_quantized_function_row_by_row(in_features):
    lin = torch.nn.Linear(in_features, 40, bias=True)
    q = Int8Linear(lin)
    assert q.use_kernel == (in_features % 16 == 0)
    x = torch.randn(2, 9, in_features)  # [B, T, in]
    want = F.linear(x.bfloat16().float(), q.dequantized()).bfloat16().float() + lin.bias
    y = q(x)
    assert y.shape == (2, 9, 40) and y.dtype == torch.float32
    torch.testing.assert_close(y, want, rtol=1e-2, atol=1e-2)
    assert (y - lin(x)).abs().max() < 0.05  # close to the float layer it replaces
    flat = x.reshape(-1, in_features)
    one_by_one = torch.cat([q(flat[i:i + 1]) for i in range(flat.shape[0])])
    if q.use_kernel:  # a verify's rows equal plain steps' rows, bit for bit
        assert torch.equal(one_by_one, y.reshape(-1, 40))
    big = torch.randn(quantize.MAX_ROWS + 1, in_features)  # prefill-sized: the dequantized GEMM
    torch.testing.assert_close(q(big)[:4], q(big[:4]), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_speculative_greedy_identical_to_the_quantized_target(kind):
    target = tiny_target(layers=3)
    head = random_head(target, kind, draft_vocab=40 if kind == "eagle3" else None)
    prompts = prompts_for(target.config.vocab_size)
    unquantized = generate(target, prompts, 40)
    assert quantize_linears(target, "int8") == 3 * 2 + 3 * 2 + 1  # qkv, o, gate_up, down; lm_head
    plain = generate(target, prompts, 40)
    assert plain != unquantized  # the check below is about the quantized target
    for tree in (TreeConfig(), TreeConfig.chain(4)):
        spec, _ = generate_speculative(target, head, prompts, 40, tree=tree)
        assert spec == plain


def test_oracle_head_on_an_int8_target_accepts_and_stays_exact():
    target = tiny_target(layers=1, silent=True)
    head = oracle_head(target)
    quantize_linears(target, "int8")
    head.target_lm_head = [quantize.lm_head_weight(target)]  # as load_head_for gives it
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 30)
    spec, stats = generate_speculative(target, head, prompts, 30, tree=TreeConfig())
    assert spec == plain
    assert stats.acceptance_length() > 2.0


def test_compiled_int8_steps_equal_eager_with_each_targets_own_weights():
    """Compiled int8 steps (Inductor's int8 GEMM template on frozen weights) decode as the eager
    ones do, for two targets of the same shapes in one process: torch's compile cache keeps the
    template's packed weights by value, so without a tag of the weights (cpu_linears.compile_settings)
    the second target would decode with the first one's."""
    outputs = []
    for seed in (0, 1):
        target = tiny_target(layers=2, seed=seed)
        head = random_head(target, "eagle3", draft_vocab=40)
        quantize_linears(target, "int8")
        prompts = prompts_for(target.config.vocab_size, lens=(6, 13))
        plain = generate(target, prompts, 24)
        assert generate(target, prompts, 24, compile=True) == plain
        outputs.append(plain)
        if seed == 0:
            tree = TreeConfig(num_steps=3, eagle_topk=2, num_draft_tokens=6)
            dec = SpecDecoder(target, head, tree, max_batch=2, max_seq_len=128).compile()
            spec, _ = generate_speculative(target, head, prompts, 24, tree=tree, decoder=dec)
            assert spec == plain
    assert outputs[0] != outputs[1]


@pytest.mark.skipif(not cpu_linears.template_isa(), reason="CPU without Inductor's GEMM template kernels")
def test_compiled_int8_linears_round_to_bf16_and_a_row_is_the_same_in_any_call():
    """Compiled fp32 steps over int8 Linears (Inductor's template on frozen weights) keep each
    Linear's bf16 output, as eager does, also where the cast back to fp32 fuses into the GEMM
    (an lm_head before a softmax), and a row's bits do not depend on how many rows the call has
    (AMX tiles from 5 rows up summed in another order). Either way a verify's logits were not a
    plain step's, and the real target's compiled speculative output left its plain output."""
    from eagle_infer.generate import compile_step

    torch.manual_seed(0)
    # the default target's sizes: with fewer products a row the orders met (AMX at 8 rows)
    mlp = torch.nn.Sequential(Int8Linear(torch.nn.Linear(576, 1536, bias=False)), torch.nn.SiLU(),
                              Int8Linear(torch.nn.Linear(1536, 256, bias=False))).eval()
    settings = cpu_linears.compile_settings(mlp)
    assert settings is not None and settings.options["emulate_precision_casts"]
    step = compile_step(lambda x: (lambda y: (y, y.log_softmax(-1)))(mlp(x)), None, settings)
    x = torch.randn(8, 576)  # [rows, in]: a verify's rows
    with torch.no_grad():
        y, _ = step(x)
        rows = torch.cat([step(x[i:i + 1])[0] for i in range(8)])  # one-row plain steps
    assert y.dtype == torch.float32 and torch.equal(y, y.bfloat16().float())
    assert torch.equal(y, rows)


def test_load_model_int8_and_a_head_for_it(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    ref = load_model(path, "fp32", "cpu")
    target = load_model(path, "fp32", "cpu", quantization="int8")
    assert target.quantization == "int8" and target.cpu_linears == ref.cpu_linears
    assert not any(type(m) is torch.nn.Linear or hasattr(m, "key") for m in target.modules())
    assert type(target.lm_head) is Int8Linear and target.embed_tokens.weight.dtype == torch.float32
    save_head(random_head(ref, "eagle2"), tmp_path / "e2", dtype=torch.float32)
    head = load_head_for(tmp_path / "e2", target)  # EAGLE-2 drafts with the target's lm_head
    assert type(head.fc) is Int8Linear and not any(type(m) is torch.nn.Linear for m in head.modules())
    torch.testing.assert_close(head.target_lm_head[0], target.lm_head.dequantized())
    prompts = prompts_for(target.config.vocab_size, lens=(7,))
    spec, _ = generate_speculative(target, head, prompts, 16, tree=TreeConfig())
    assert spec == generate(target, prompts, 16)


def test_fp32_int8_load_turns_the_attention_kernel_on(tiny_model_dir):
    """int8 Linears round their inputs to bf16, which turns SDPA's query-length-dependent
    blocking into diverging greedy output (the real target: verify and plain apart at token 18);
    the attention kernel's rows are a step's rows, so an fp32 int8 load turns it on."""
    from eagle_infer.kernels import avx2_attention, avx2_linear

    if not avx2_linear.supported():
        pytest.skip("CPU without AVX2")
    before = avx2_attention.enabled()
    try:
        avx2_attention.enable(False)
        load_model(tiny_model_dir("llama"), "fp32", "cpu", cpu_linears="torch")
        assert not avx2_attention.enabled()  # fp32 on torch's Linears: SDPA, as before
        load_model(tiny_model_dir("llama"), "fp32", "cpu", quantization="int8", cpu_linears="torch")
        assert avx2_attention.enabled()
    finally:
        avx2_attention.enable(before)


@pytest.mark.skipif(not bf16_linear.supported(), reason="CPU without AVX2 / FMA")
def test_int8_on_our_kernel_speculative_identical_to_plain_eager_and_compiled(
        bf16_multiply, attention_kernel_on, request):
    """A bf16 target on "avx512_bf16" quantized: its Linears and its head's run our kernel on the
    int8 weights, compiled steps call it with our kernels' settings (not the frozen template),
    and greedy speculative decoding equals plain greedy decoding of the quantized target, eager
    and compiled, in bf16."""
    target, head = target_for_the_kernel(layers=2)
    target, head = target.to(torch.bfloat16), head.to(torch.bfloat16)
    prompts = prompts_for(target.config.vocab_size)
    torch_plain = generate(target, prompts, 24)
    on_torch = copy.deepcopy(target)
    quantize_linears(on_torch, "int8")
    on_torch = generate(on_torch, prompts, 24)  # torch's int8 kernel: the same quantized function
    target.cpu_linears = "avx512_bf16"
    n = quantize_linears(target, "int8", target.cpu_linears)
    quantize_linears(head, "int8", target.cpu_linears)  # as load_head_for does
    int8s = [m for mod in (target, head) for m in mod.modules() if isinstance(m, Int8Linear)]
    assert len(int8s) > n and all(m.ours and m.dot == (bf16_multiply != "fma") for m in int8s)
    assert cpu_linears.bf16_multiply(target) == bf16_multiply
    assert target.state_dict().keys() >= {"lm_head.weight_int8", "lm_head.scale"}
    assert not any("packed" in k for k in target.state_dict())  # not checkpoint tensors
    assert cpu_linears.compile_settings(target, head) is None
    assert cpu_linears.step_options(target, None, None) == {"cpp_wrapper": True,
                                                            "emulate_precision_casts": True}
    plain = generate(target, prompts, 24)
    assert plain != torch_plain  # quantized
    # torch's kernel rounds its bf16 output differently: mostly the same tokens
    agree = sum(a == b for p, q in zip(plain, on_torch) for a, b in zip(p, q))
    assert agree > 0.5 * sum(map(len, plain))
    for tree in (TreeConfig(3, 4, 4), TreeConfig.chain(3)):
        spec, _ = generate_speculative(target, head, prompts, 24, tree=tree)
        assert spec == plain, tree
    if bf16_multiply != request.node.machine_multiply:
        return  # compiled: the same graph on every multiply (the op's dot flag); checked on the default
    assert generate(target, prompts, 24, compile=True) == plain
    tree = TreeConfig(3, 4, 4)
    dec = SpecDecoder(target, head, tree, max_batch=4, max_seq_len=128).compile()
    spec, _ = generate_speculative(target, head, prompts, 24, tree=tree, decoder=dec)
    assert spec == plain


@pytest.mark.skipif(not bf16_linear.supported(), reason="CPU without AVX2 / FMA")
def test_load_model_int8_on_our_kernel(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    target = load_model(path, "bf16", "cpu", cpu_linears="avx512_bf16", quantization="int8")
    assert target.cpu_linears == "avx512_bf16" and target.lm_head.ours
    assert cpu_linears.bf16_multiply(target) == bf16_linear.multiply_default()
    save_head(random_head(load_model(path, "fp32", "cpu"), "eagle3", draft_vocab=40), tmp_path / "e3",
              dtype=torch.float32)
    head = load_head_for(tmp_path / "e3", target)
    assert type(head.fc) is Int8Linear and head.fc.ours
    prompts = prompts_for(target.config.vocab_size, lens=(7,))
    spec, _ = generate_speculative(target, head, prompts, 16, tree=TreeConfig())
    assert spec == generate(target, prompts, 16)
    onednn = load_model(path, "bf16", "cpu", cpu_linears="onednn", quantization="int8")
    assert not onednn.lm_head.ours  # torch's int8 kernel, the frozen template when compiled
    assert cpu_linears.bf16_multiply(onednn) is None
    assert cpu_linears.compile_settings(onednn) is not None


def test_bad_quantization_requests_name_the_problem(tiny_model_dir):
    with pytest.raises(UserError, match="quantization must be one of none, int8"):
        load_model(tiny_model_dir("llama"), "fp32", "cpu", quantization="int4")
    with pytest.raises(UserError, match="for CPU targets"):
        quantize_linears(torch.nn.Linear(8, 8, device="meta"), "int8")
