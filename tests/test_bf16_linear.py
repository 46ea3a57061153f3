"""cpu_linears="avx512_bf16": our kernel for bf16 Linears (eagle_infer/kernels/bf16_linear),
on fp32 FMAs, on vdpbf16ps and on AMX tiles (`dot`; AMX where the CPU has it; on a CPU without
AVX512-BF16 its AVX2 build, on FMAs only),
computes F.linear to bf16 rounding (fp32 products and sums, one rounding at the end), a row's
values do not depend on the rows beside it, compiled steps call it (not a silent F.linear), the
loader picks it for bf16 on any CPU where it builds, and greedy speculative decoding on it (with
kernels/avx2_attention) is token-identical to plain decoding on it in bf16, eager and compiled
(Inductor's C++ wrapper, eager's bf16 rounding: cpu_linears.step_options)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_avx2_attention import target_for_the_kernel
from test_speculative import prompts_for, tiny_target

from eagle_infer import cpu_linears
from eagle_infer.errors import UserError
from eagle_infer.generate import ensure_cache, generate, prefill
from eagle_infer.kernels import avx2_attention, bf16_linear
from eagle_infer.loader import load_model
from eagle_infer.quantize import quantize_weight
from eagle_infer.speculative import SpecDecoder, generate_speculative
from eagle_infer.tree import TreeConfig

pytestmark = pytest.mark.skipif(not bf16_linear.supported(), reason="CPU without AVX2 / FMA")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear in float64 (bf16 products are exact in fp32; the sums are within fp32 rounding)."""
    return F.linear(x.double(), w.double())


@pytest.mark.parametrize("n,k", [(64, 64), (100, 576), (5, 7), (33, 100), (576, 1536)])
def test_kernel_is_linear_and_rows_independent(n, k, bf16_multiply):
    """On AMX, in_features of a multiple of 32 run on the tiles (64, 576, 1536: the last block of
    an M over 16 on tiles of its own), the others on vdpbf16ps."""
    dot = bf16_multiply != "fma"
    w = torch.randn(n, k).bfloat16()
    wp = bf16_linear.pack(w)
    assert wp.shape == (-(-n // 32), -(-k // 2), 32, 2) and wp.dtype == torch.bfloat16
    x = torch.randn(40, k).bfloat16()
    full = bf16_linear.bf16_linear(x, wp, n, dot)
    assert full.dtype == torch.bfloat16 and full.shape == (40, n)
    # one rounding to bf16 of a sum that fp32 computes within ~1e-6 relative: at most one bf16 step
    torch.testing.assert_close(full.double(), reference(x, w).bfloat16().double(), rtol=8e-3, atol=1e-2)
    assert (full.double() != reference(x, w).bfloat16().double()).float().mean() < 0.01
    # tiles of 8 and every tail; on vdpbf16ps 2-32 rows run k in chunks (100: a chunk and a part),
    # 33+ do not
    # AVX2 build: up to 4 rows one tile over all of k, more in chunks of 32 k pairs that tiles of
    # 4 rows and the rest take in turn (11 = 4 + 4 + 3), over 16 rows in blocks of 16 (17, 33)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 16, 17, 19, 25, 32, 33):
        got = bf16_linear.bf16_linear(x[:rows], wp, n, dot)
        assert torch.equal(got, full[:rows]), rows  # bit for bit: a verify's rows = one-row steps'
    x3 = x[:6].view(2, 3, k)  # [B, T, H], as the lm_head sees it
    assert torch.equal(bf16_linear.bf16_linear(x3, wp, n, dot), full[:6].view(2, 3, n))
    xt = torch.randn(k, 4).bfloat16().t()  # a strided input
    want = reference(xt, w).bfloat16().double()
    torch.testing.assert_close(bf16_linear.bf16_linear(xt, wp, n, dot).double(), want, rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("n,k", [(64, 64), (100, 576), (5, 7), (33, 100)])
def test_int8_kernel_is_the_quantized_linear_and_rows_independent(n, k, bf16_multiply):
    """The int8 weights' kernel (quantize.Int8Linear on "avx512_bf16"): x @ (q * scale).T, each
    output's sum times its scale rounded once, a row's bits whatever rows come with it."""
    dot = bf16_multiply != "fma"
    w = torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None]  # rows of different scales
    q, scale = quantize_weight(w)
    wp, s = bf16_linear.pack_int8(q, scale)
    assert wp.shape == (-(-n // 32), -(-k // 2), 32, 2) and wp.dtype == torch.int8
    assert s.shape == (wp.shape[0] * 32,) and s.dtype == torch.float32
    x = torch.randn(40, k).bfloat16()
    full = bf16_linear.int8_linear(x, wp, s, n, dot)
    assert full.dtype == torch.bfloat16 and full.shape == (40, n)
    want = (x.double() @ q.double().T * scale.double()).bfloat16().double()
    torch.testing.assert_close(full.double(), want, rtol=8e-3, atol=1e-4)
    assert (full.double() != want).float().mean() < 0.01
    # whole k, chunks of k (9-32 on vdpbf16ps), whole; AVX2: each tile shape
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 16, 17, 32, 33):
        assert torch.equal(bf16_linear.int8_linear(x[:rows], wp, s, n, dot), full[:rows]), rows


def test_dot_product_choice(monkeypatch):
    bf16_linear.load()  # this machine's build, before the CPU checks are faked
    monkeypatch.setattr(bf16_linear, "avx512_bf16_supported", lambda: False)  # AVX2 only: FMAs
    for choice in ("auto", "fma"):
        monkeypatch.setenv(bf16_linear.DOT_ENV, choice)
        assert bf16_linear.multiply_default() == "fma" and not bf16_linear.dot_default()
    for choice in ("vdpbf16ps", "amx"):
        monkeypatch.setenv(bf16_linear.DOT_ENV, choice)
        with pytest.raises(UserError, match=f"EAGLE_BF16_DOT={choice} needs a CPU with AVX512-BF16"):
            bf16_linear.multiply_default()
    monkeypatch.setattr(bf16_linear, "avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(bf16_linear, "amx_supported", lambda: False)
    monkeypatch.setattr(bf16_linear, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.delenv(bf16_linear.DOT_ENV, raising=False)
    assert bf16_linear.dot_default() and bf16_linear.multiply_default() == "vdpbf16ps"  # Zen 4
    monkeypatch.setattr(bf16_linear, "cpu_vendor", lambda: "GenuineIntel")
    assert not bf16_linear.dot_default()  # the FMAs measured faster there (no AMX)
    monkeypatch.setattr(bf16_linear, "amx_supported", lambda: True)
    assert bf16_linear.dot_default() and bf16_linear.multiply_default() == "amx"  # Xeon with AMX
    monkeypatch.setenv(bf16_linear.DOT_ENV, "fma")
    assert bf16_linear.multiply_default() == "fma"
    monkeypatch.setenv(bf16_linear.DOT_ENV, "vdpbf16ps")
    assert bf16_linear.dot_default()
    target = tiny_target(layers=1).to(torch.bfloat16)
    before = bf16_linear.amx_on()
    try:
        cpu_linears.use_bf16_linears(target)  # a load sets the process's AMX switch to its choice
        assert all(m.dot for m in target.modules() if isinstance(m, cpu_linears.Bf16Linear))
        assert not bf16_linear.amx_on() and cpu_linears.bf16_multiply(target) == "vdpbf16ps"
        if bf16_linear.set_amx(True):  # an AMX CPU: a load with amx puts the switch back on
            bf16_linear.set_amx(False)
            monkeypatch.setenv(bf16_linear.DOT_ENV, "amx")
            cpu_linears.use_bf16_linears(target := tiny_target(layers=1).to(torch.bfloat16))
            assert bf16_linear.amx_on() and cpu_linears.bf16_multiply(target) == "amx"
    finally:
        bf16_linear.set_amx(before)
    monkeypatch.setenv(bf16_linear.DOT_ENV, "fma")
    assert not bf16_linear.dot_default()
    monkeypatch.setenv(bf16_linear.DOT_ENV, "tiles")
    with pytest.raises(UserError, match="EAGLE_BF16_DOT must be auto, amx, vdpbf16ps or fma, got 'tiles'"):
        bf16_linear.dot_default()


def test_kernel_names_bad_input():
    wp = bf16_linear.pack(torch.randn(30, 16))
    with pytest.raises(RuntimeError, match="bf16_linear: bf16 inputs only, got Float"):
        bf16_linear.bf16_linear(torch.randn(2, 16), wp, 30)
    with pytest.raises(RuntimeError, match="does not hold 30 outputs of 8 inputs"):
        bf16_linear.bf16_linear(torch.randn(2, 8).bfloat16(), wp, 30)
    with pytest.raises(RuntimeError, match="does not hold 49 outputs"):
        bf16_linear.bf16_linear(torch.randn(2, 16).bfloat16(), wp, 49)
    x = torch.randn(2, 16).bfloat16()
    with pytest.raises(RuntimeError, match="bf16_linear: bf16 packed weight only, got Char"):
        bf16_linear.bf16_linear(x, wp.to(torch.int8), 30)
    q8, s8 = bf16_linear.pack_int8(*quantize_weight(torch.randn(30, 16)))
    with pytest.raises(RuntimeError, match="int8_linear: int8 packed weight only, got BFloat16"):
        bf16_linear.int8_linear(x, wp, s8, 30)
    with pytest.raises(RuntimeError, match="scale must be a contiguous fp32 CPU vector of 32"):
        bf16_linear.int8_linear(x, q8, s8[:30], 30)
    with pytest.raises(RuntimeError, match="scale must be .* got BFloat16"):
        bf16_linear.int8_linear(x, q8, s8.bfloat16(), 30)


def test_bf16_linears_eager_compiled_and_large_calls():
    target = tiny_target(layers=1).to(torch.bfloat16)
    ref = {n: m.weight.clone() for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)}
    state = target.state_dict()
    assert cpu_linears.use_bf16_linears(target) == len(ref)
    assert target.state_dict().keys() == state.keys()  # the packed copy is not a checkpoint tensor
    lin = target.layers[0].mlp.down_proj
    assert type(lin) is cpu_linears.Bf16Linear
    w = ref["layers.0.mlp.down_proj"]
    graphs = []

    def keep_graph(gm, inputs):
        graphs.append(gm)
        return gm.forward

    limit = cpu_linears.BF16_MAX_ROWS  # no limit but on AMX CPUs: a prefill chunk of 600 rows runs ours
    for rows in (1, 4, limit, limit + 1) if limit <= 512 else (1, 4, 600):
        x = torch.randn(rows, lin.in_features).bfloat16()
        want = reference(x, w).bfloat16().double()
        torch.testing.assert_close(lin(x).double(), want, rtol=8e-3, atol=1e-2)
        torch._dynamo.reset()
        got = torch.compile(lin, backend=keep_graph, fullgraph=True)(x)
        torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-2)
        targets = {n.target for n in graphs[-1].graph.nodes if n.op == "call_function"}
        ours = rows <= cpu_linears.BF16_MAX_ROWS  # larger calls (prefill chunks): torch's kernel
        op = torch.ops.eagle.bf16_linear
        assert bool({op, op.default} & targets) is ours, (rows, targets)
        assert (F.linear in targets) is not ours, (rows, targets)


def test_bf16_speculative_greedy_identical_to_plain_on_the_kernels(attention_kernel_on, bf16_multiply,
                                                                  request):
    """Our Linears and attention give a row the same bits whatever rows come with it, so in bf16
    too a verify's logits are the one-row steps' and greedy speculative decoding equals plain
    greedy decoding token for token, eager and compiled (Inductor's C++ wrapper, rounding as
    eager does). Logits close to those on torch's Linears. On FMAs, vdpbf16ps and AMX alike."""
    fp32_target, fp32_head = target_for_the_kernel(layers=3)
    target, head = fp32_target.to(torch.bfloat16), fp32_head.to(torch.bfloat16)
    prompts = prompts_for(target.config.vocab_size)
    ensure_cache(target, 1, 64)
    logits_torch = prefill(target, prompts[:1])[0].float()
    cpu_linears.use_bf16_linears(target)
    cpu_linears.use_bf16_linears(head)  # as load_head_for does for a target on "avx512_bf16"
    target.cpu_linears = "avx512_bf16"
    torch.testing.assert_close(prefill(target, prompts[:1])[0].float(), logits_torch, rtol=0.05, atol=0.1)
    assert cpu_linears.compile_settings(target, head) is None  # Inductor's defaults: no freezing
    options = cpu_linears.step_options(target, None, None)  # compiled: C++ wrapper, eager's bf16 casts
    assert options == {"cpp_wrapper": True, "emulate_precision_casts": True}
    plain = generate(target, prompts, 24)  # batch 4: every decode step has 4 rows
    for tree in (TreeConfig(), TreeConfig(3, 4, 4), TreeConfig.chain(3)):
        spec, _ = generate_speculative(target, head, prompts, 24, tree=tree)
        assert spec == plain, tree
    if bf16_multiply != request.node.machine_multiply:
        return  # compiled: the same graph on every multiply (the op's dot flag); checked on the default
    # compiled graphs round bf16 where eager's ops do (step_options: emulate_precision_casts)
    assert generate(target, prompts, 24, compile=True) == plain
    tree = TreeConfig(3, 4, 4)  # a CPU-sized tree (three draft steps), compiled
    dec = SpecDecoder(target, head, tree, max_batch=4, max_seq_len=128).compile()
    spec, _ = generate_speculative(target, head, prompts, 24, tree=tree, decoder=dec)
    assert spec == plain


def test_loader_picks_the_kernel_for_bf16_and_falls_back_when_it_does_not_build(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("llama")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # where it was measured
    before = avx2_attention.enabled()
    try:
        avx2_attention.enable(False)
        model = load_model(path, "bf16", "cpu")
        assert avx2_attention.enabled()  # attention on our kernel too, as with the fp32 "avx2"
    finally:
        avx2_attention.enable(before)
    assert model.cpu_linears == "avx512_bf16" and type(model.lm_head) is cpu_linears.Bf16Linear
    assert load_model(path, "fp32", "cpu").cpu_linears != "avx512_bf16"  # fp32 keeps its backends

    def no_compiler():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # AMX: ours on the tiles
    assert load_model(path, "bf16", "cpu").cpu_linears == "avx512_bf16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(bf16_linear, "load", no_compiler)
    # oneDNN's bf16 Linears where the CPU has native bf16, else torch's (an AVX2 CPU)
    fallback = "onednn" if torch.bfloat16 in cpu_linears.packable_dtypes() else "torch"
    with pytest.warns(UserWarning, match="avx512_bf16 kernel did not build .*no C\\+\\+ compiler"):
        assert load_model(path, "bf16", "cpu").cpu_linears == fallback
    monkeypatch.setattr(bf16_linear, "supported", lambda: False)
    assert load_model(path, "bf16", "cpu").cpu_linears == fallback
    with pytest.raises(RuntimeError, match="neither AVX512-BF16 nor AVX2 with FMA"):
        load_model(path, "bf16", "cpu", cpu_linears="avx512_bf16")


def test_auto_dtype_is_bf16_wherever_the_kernel_runs(monkeypatch):
    """"auto" = bf16 on a CPU with bf16 instructions, and on an AVX2 one where the kernel's AVX2
    build runs (1.7x our fp32 plain decoding there), fp32 where it does not build."""
    from eagle_infer import loader

    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda: False)  # an AVX2 CPU
    monkeypatch.setattr(cpu_linears, "bf16_default", lambda: True)
    assert loader.resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(cpu_linears, "bf16_default", lambda: False)  # no compiler: torch's bf16 is slow
    assert loader.resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda: True)
    assert loader.resolve_dtype("auto", "cpu") == torch.bfloat16
    assert loader.resolve_dtype("fp32", "cpu") == torch.float32


def test_fma_halves_names_zen1_by_family_and_model(monkeypatch):
    from eagle_infer import loader

    cpus = {  # vendor, family, model -> 256-bit FMAs as two halves
        ("AuthenticAMD", "23", "1"): True,  # Zen 1 (Naples)
        ("AuthenticAMD", "23", "8"): True,  # Zen+
        ("AuthenticAMD", "23", "49"): False,  # Zen 2 (Rome)
        ("AuthenticAMD", "25", "17"): False,  # Zen 4 (Genoa)
        ("HygonGenuine", "24", "0"): True,  # Dhyana, a Zen 1
        ("GenuineIntel", "6", "143"): False,
        ("AuthenticAMD", "", ""): False,  # no fields: not guessed
    }
    for (vendor, family, model), halves in cpus.items():
        fields = {"vendor_id": vendor, "cpu family": family, "model": model}
        monkeypatch.setattr(loader, "cpuinfo_field", lambda name, f=fields: f.get(name, ""))
        assert bf16_linear.fma_halves() is halves, (vendor, family, model)
    monkeypatch.undo()
    if loader.cpuinfo_field("model name"):  # a Linux x86 machine: the key is matched whole
        assert loader.cpuinfo_field("model").isdigit()
