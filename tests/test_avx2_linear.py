"""cpu_linears="avx2": our AVX2 kernel for Linears of a few rows (eagle_infer/kernels/avx2_linear)
computes F.linear, a row's values do not depend on the rows beside it, compiled steps call it
(not a silent F.linear), and greedy decoding on it, plain and speculative, eager and compiled,
is token-identical to plain decoding on torch's Linears (compiled steps on Inductor's C++
wrapper, cpu_linears.step_options)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_speculative import prompts_for, random_head, tiny_target

from eagle_infer import cpu_linears
from eagle_infer.generate import generate
from eagle_infer.kernels import avx2_linear
from eagle_infer.speculative import SpecDecoder, generate_speculative
from eagle_infer.tree import TreeConfig

pytestmark = pytest.mark.skipif(not avx2_linear.supported(), reason="CPU without AVX2 / FMA")


@pytest.mark.parametrize("n,k", [(48, 64), (100, 576), (5, 7), (576, 1536)])
def test_kernel_is_linear_and_rows_independent(n, k):
    w = torch.randn(n, k)
    wp = avx2_linear.pack(w)
    assert wp.shape == (-(-n // 24), k, 24)
    x = torch.randn(17, k)
    full = avx2_linear.avx2_linear(x, wp, n)
    torch.testing.assert_close(full, F.linear(x, w), rtol=1e-4, atol=1e-4)
    for rows in (1, 2, 3, 4, 5, 8, 9):  # 4-row blocks and every tail
        got = avx2_linear.avx2_linear(x[:rows], wp, n)
        assert torch.equal(got, full[:rows]), rows  # bit for bit: a verify's rows = one-row steps'
    x3 = x[:6].view(2, 3, k)  # [B, K, H], as the lm_head sees it, and a strided input
    assert torch.equal(avx2_linear.avx2_linear(x3, wp, n), full[:6].view(2, 3, n))
    xt = torch.randn(k, 4).t()
    torch.testing.assert_close(avx2_linear.avx2_linear(xt, wp, n), F.linear(xt, w), rtol=1e-4, atol=1e-4)


def test_kernel_names_bad_input():
    wp = avx2_linear.pack(torch.randn(30, 16))
    with pytest.raises(RuntimeError, match="fp32 only"):
        avx2_linear.avx2_linear(torch.randn(2, 16, dtype=torch.float64), wp, 30)
    with pytest.raises(RuntimeError, match="does not hold 30 outputs of 8 inputs"):
        avx2_linear.avx2_linear(torch.randn(2, 8), wp, 30)
    with pytest.raises(RuntimeError, match="does not hold 49 outputs"):
        avx2_linear.avx2_linear(torch.randn(2, 16), wp, 49)


def test_avx2_linears_eager_compiled_and_large_calls():
    target = tiny_target(layers=1)
    ref = {n: m.weight.clone() for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)}
    state = target.state_dict()
    assert cpu_linears.use_avx2_linears(target) == len(ref)
    assert target.state_dict().keys() == state.keys()  # the packed copy is not a checkpoint tensor
    lin = target.layers[0].mlp.down_proj
    assert type(lin) is cpu_linears.Avx2Linear
    w = ref["layers.0.mlp.down_proj"]
    graphs = []

    def keep_graph(gm, inputs):
        graphs.append(gm)
        return gm.forward

    for rows in (1, 4, cpu_linears.AVX2_MAX_ROWS, cpu_linears.AVX2_MAX_ROWS + 1):
        x = torch.randn(rows, lin.in_features)
        torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(lin, backend=keep_graph, fullgraph=True)(x),
                                   F.linear(x, w), rtol=1e-5, atol=1e-5)
        targets = {n.target for n in graphs[-1].graph.nodes if n.op == "call_function"}
        ours = rows <= cpu_linears.AVX2_MAX_ROWS  # larger calls (prefill chunks): torch's kernel
        op = torch.ops.eagle.avx2_linear
        assert bool({op, op.default} & targets) is ours, (rows, targets)
        assert (F.linear in targets) is not ours, (rows, targets)


def test_greedy_identical_on_avx2_linears_eager_and_compiled():
    target = tiny_target(layers=3)
    head = random_head(target, "eagle3", draft_vocab=40)
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 24)
    cpu_linears.use_avx2_linears(target)
    cpu_linears.use_avx2_linears(head)  # as load_head_for does for a target on "avx2"
    target.cpu_linears = "avx2"
    assert cpu_linears.compile_settings(target, head) is None  # Inductor's defaults: no freezing
    assert generate(target, prompts, 24) == plain  # batch 4: every step has 4 rows
    assert cpu_linears.step_options(target, None, None)["cpp_wrapper"]  # compiled: Inductor's C++ wrapper
    assert cpu_linears.step_options(target, None, "reduce-overhead") is None
    assert generate(target, prompts, 24, compile=True) == plain
    spec, _ = generate_speculative(target, head, prompts, 24, tree=TreeConfig())
    assert spec == plain
    tree = TreeConfig(3, 4, 4)  # a CPU-sized tree (three draft steps), compiled with the C++ wrapper
    dec = SpecDecoder(target, head, tree, max_batch=4, max_seq_len=128).compile()
    spec, _ = generate_speculative(target, head, prompts, 24, tree=tree, decoder=dec)
    assert spec == plain


def test_auto_falls_back_with_a_warning_when_the_kernel_does_not_build(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_linears.avx2_default()

    def no_compiler():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(avx2_linear, "load", no_compiler)
    with pytest.warns(UserWarning, match="avx2 kernel did not build .*no C\\+\\+ compiler"):
        assert not cpu_linears.avx2_default()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not cpu_linears.avx2_default()  # AVX-512 CPUs keep the template (not measured there)
