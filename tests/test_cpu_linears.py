"""cpu_linears=onednn: Linears through oneDNN prepacked weights (fp32 at 2-512 rows; bf16 from
one row, where the CPU has native bf16) give the same numbers as torch's, eager and compiled,
and speculative decoding stays token-identical to plain decoding with them. cpu_linears=inductor:
compiled steps on Inductor's GEMM template decode as the eager steps do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_speculative import prompts_for, random_head, tiny_target

from eagle_infer import cpu_linears
from eagle_infer.errors import UserError
from eagle_infer.generate import CompiledDecode, generate
from eagle_infer.heads import load_head_for, save_head
from eagle_infer.kernels import avx2_linear
from eagle_infer.loader import load_model
from eagle_infer.speculative import generate_speculative
from eagle_infer.tree import TreeConfig

pytestmark = pytest.mark.skipif(not cpu_linears.available(), reason="torch built without oneDNN")


def test_linears_swapped_and_equal_eager_and_compiled():
    target = tiny_target(layers=2)
    ref = {n: m.weight.clone() for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)}
    assert cpu_linears.use_onednn_linears(target) == len(ref)
    lin = target.layers[0].mlp.gate_up_proj
    assert type(lin) is cpu_linears.OneDNNLinear
    w = ref["layers.0.mlp.gate_up_proj"]
    assert torch.equal(target.state_dict()["layers.0.mlp.gate_up_proj.weight"], w)  # same checkpoint
    compiled = torch.compile(lin, fullgraph=True)
    for rows in (1, 4, 16):
        x = torch.randn(rows, lin.in_features)
        want = F.linear(x, w)
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, lin.in_features)  # [B, K, H], as the lm_head sees it
    torch.testing.assert_close(lin(x3), F.linear(x3, w), rtol=1e-5, atol=1e-5)


def test_compiled_template_linears_trace_a_plain_linear(monkeypatch):
    """compiled_template: eager calls of 2-512 rows still go through oneDNN, a compiled call's
    graph holds a plain linear (which Inductor lowers to its GEMM template), not the oneDNN op."""
    target = tiny_target(layers=1)
    cpu_linears.use_onednn_linears(target, compiled_template=True)
    lin = target.layers[0].mlp.down_proj
    assert rows_through_onednn(lin, monkeypatch, [1, 4], 1e-5) == [4]
    graphs = []

    def keep_graph(gm, inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(4, lin.in_features)
    torch.testing.assert_close(torch.compile(lin, backend=keep_graph, fullgraph=True)(x),
                               F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    targets = {n.target for n in graphs[0].graph.nodes if n.op == "call_function"}
    op = torch.ops.eagle.onednn_linear  # (rows_through_onednn wrapped the module's name for it)
    assert F.linear in targets and op not in targets, targets
    lin.compiled_template = False  # without it the graph keeps the oneDNN op
    torch._dynamo.reset()
    torch.compile(lin, backend=keep_graph, fullgraph=True)(x)
    assert op in {n.target for n in graphs[1].graph.nodes}


def rows_through_onednn(lin: torch.nn.Module, monkeypatch, rows: list[int], tol: float) -> list[int]:
    calls = []
    real = cpu_linears.onednn_linear
    monkeypatch.setattr(cpu_linears, "onednn_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    for n in rows:
        x = torch.randn(n, lin.in_features, dtype=lin.weight.dtype)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=tol, atol=tol)
    return [s[0] for s in calls]


def test_fp32_one_row_and_large_calls_keep_torchs_kernel(monkeypatch):
    lin = torch.nn.Linear(8, 6, bias=False)
    assert cpu_linears.use_onednn_linears(lin) == 1
    rows = [1, 2, cpu_linears.MAX_ROWS, cpu_linears.MAX_ROWS + 1]
    assert rows_through_onednn(lin, monkeypatch, rows, 1e-5) == [2, cpu_linears.MAX_ROWS]


def test_bf16_linears_packed_from_one_row_where_the_cpu_has_bf16(monkeypatch, tiny_model_dir):
    lin = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    rows = [1, 4, cpu_linears.MAX_ROWS + 1]
    model = load_model(tiny_model_dir("llama"), "bf16", "cpu")
    if torch.bfloat16 in cpu_linears.packable_dtypes():
        assert cpu_linears.use_onednn_linears(lin) == 1
        assert rows_through_onednn(lin, monkeypatch, rows, 2e-2) == [1, 4]
        # auto: our kernel where the CPU has AVX512-BF16 (and it builds), else oneDNN
        ours = cpu_linears.bf16_default()
        assert model.cpu_linears == ("avx512_bf16" if ours else "onednn")
        assert type(model.lm_head) is (cpu_linears.Bf16Linear if ours else cpu_linears.OneDNNLinear)
    else:  # no native bf16 (an AVX2 CPU): nothing for oneDNN to pack; auto runs our kernel's AVX2 build
        assert cpu_linears.use_onednn_linears(lin) == 0
        assert model.cpu_linears == "avx512_bf16" and type(model.lm_head) is cpu_linears.Bf16Linear
        monkeypatch.setattr(cpu_linears, "bf16_default", lambda: False)  # where it does not build
        model = load_model(tiny_model_dir("llama"), "bf16", "cpu")
        assert model.cpu_linears == "torch" and type(model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_biased_linears_run_our_kernel_rows_independent(dtype, tiny_model_dir):
    """A Linear with a bias (Qwen2's q/k/v) runs our kernel too, its bias added after: close to
    torch's, each row the same bits alone or with others (what lossless verification needs), and
    a Qwen2 checkpoint loads with its q/k/v on it."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True).to(dtype)
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(5, 64).to(dtype)
    ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    convert, cls = ((cpu_linears.use_avx2_linears, cpu_linears.Avx2Linear) if dtype == torch.float32
                    else (cpu_linears.use_bf16_linears, cpu_linears.Bf16Linear))
    assert convert(lin) == 1 and type(lin) is cls
    y = lin(x)
    torch.testing.assert_close(y.float(), ref, atol=1e-4 if dtype == torch.float32 else 0.1, rtol=0.02)
    assert torch.equal(y, torch.cat([lin(x[i:i + 1]) for i in range(5)]))
    fp32 = dtype == torch.float32
    model = load_model(tiny_model_dir("qwen2"), "fp32" if fp32 else "bf16", "cpu",
                       cpu_linears="avx2" if fp32 else "avx512_bf16")
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.bias is not None and type(qkv) is cls and model.fused_layers is None


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_speculative_greedy_identical_with_onednn_linears(kind):
    target = tiny_target(layers=3)
    head = random_head(target, kind, draft_vocab=40 if kind == "eagle3" else None)
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 40)
    cpu_linears.use_onednn_linears(target)
    cpu_linears.use_onednn_linears(head)  # as load_head_for does for a target on oneDNN
    assert generate(target, prompts, 40) == plain  # batch 4: every step has 4 rows
    spec, _ = generate_speculative(target, head, prompts, 40, tree=TreeConfig())
    assert spec == plain


def test_packed_copies_go_with_their_model():
    import gc

    target = tiny_target(layers=2)
    gc.collect()  # earlier tests' models
    before = len(cpu_linears._PACKED)
    n = cpu_linears.use_onednn_linears(target)
    assert len(cpu_linears._PACKED) == before + n
    del target
    gc.collect()
    assert len(cpu_linears._PACKED) == before


def test_load_model_rejects_an_unknown_backend(tiny_model_dir):
    with pytest.raises(UserError, match="must be auto, torch, onednn, inductor, avx2 or avx512_bf16"):
        load_model(tiny_model_dir("llama"), "fp32", "cpu", cpu_linears="mkl")


def test_load_head_for_puts_the_head_on_the_targets_backend(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    saved = random_head(load_model(path, "fp32", "cpu", cpu_linears="torch"), "eagle3", draft_vocab=40)
    save_head(saved, tmp_path / "head", dtype=torch.float32)
    backends = [("onednn", cpu_linears.OneDNNLinear), ("inductor", cpu_linears.OneDNNLinear),
                ("torch", torch.nn.Linear)]
    if avx2_linear.supported():
        backends.append(("avx2", cpu_linears.Avx2Linear))
    for backend, linear in backends:
        target = load_model(path, "fp32", "cpu", cpu_linears=backend)
        head = load_head_for(tmp_path / "head", target)
        assert target.cpu_linears == backend
        assert type(head.fc) is linear and type(head.lm_head) is linear
        assert type(head.midlayer.self_attn.q_proj) is linear
        template = backend == "inductor"  # compiled steps trace F.linear for the GEMM template
        assert getattr(head.fc, "compiled_template", False) is template
        assert getattr(target.layers[0].mlp.down_proj, "compiled_template", False) is template
        x = torch.randn(4, head.lm_head.in_features)
        torch.testing.assert_close(head.lm_head(x), saved.lm_head(x), rtol=1e-5, atol=1e-5)


def test_auto_backend_needs_room_for_the_packed_copies(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("llama")
    # the default (auto, room enough): fp32 on our kernel on an AVX2 CPU, on the template on an
    # AVX-512 one
    avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
    want = "avx2" if avx2 else "inductor" if cpu_linears.template_isa() else "onednn"
    assert load_model(path, "fp32", "cpu").cpu_linears == want
    need = cpu_linears.convertible_bytes(load_model(path, "fp32", "cpu", cpu_linears="torch"))
    assert need > 0
    copies = cpu_linears.TEMPLATE_COPIES
    monkeypatch.setattr(cpu_linears, "available_memory_bytes", lambda: 2 * copies * need - 1)
    # room for one packed copy only: enough for ours, not for the template's
    assert load_model(path, "fp32", "cpu").cpu_linears == ("avx2" if avx2 else "onednn")
    monkeypatch.setattr(cpu_linears, "avx2_default", lambda: False)
    assert load_model(path, "fp32", "cpu").cpu_linears == "onednn"
    monkeypatch.setattr(cpu_linears, "available_memory_bytes", lambda: 2 * need - 1)
    assert load_model(path, "fp32", "cpu").cpu_linears == "torch"
    monkeypatch.setenv("EAGLE_CPU_LINEARS", "onednn")  # an explicit choice is kept
    assert load_model(path, "fp32", "cpu").cpu_linears == "onednn"


def test_auto_backend_counts_the_biased_linears_our_kernels_pack(tiny_model_dir, monkeypatch):
    """Our kernels pack Qwen2's biased q/k/v too, oneDNN only the bias-free Linears: room for the
    bias-free ones' copy alone is not room for ours."""
    path = tiny_model_dir("qwen2")
    model = load_model(path, "fp32", "cpu", cpu_linears="torch")
    bias_free = cpu_linears.convertible_bytes(model)
    biased = sum(m.weight.numel() * 4 for m in model.modules()
                 if isinstance(m, torch.nn.Linear) and m.bias is not None)
    assert bias_free > 0 and biased > 0
    monkeypatch.setattr(cpu_linears, "avx2_default", lambda: True)
    monkeypatch.setattr(cpu_linears, "available_memory_bytes", lambda: 2 * (bias_free + biased))
    assert cpu_linears.auto_backend(model) == "avx2"
    monkeypatch.setattr(cpu_linears, "available_memory_bytes", lambda: 2 * (bias_free + biased) - 1)
    assert cpu_linears.auto_backend(model) == "torch"


def test_inductor_linears_compiled_steps_equal_eager(monkeypatch):
    """cpu_linears="inductor": compiled steps freeze the weights for Inductor's C++ GEMM template
    (where the CPU has its AVX2 / AVX-512 kernels), under a compile-cache tag that differs for
    different weights; compiled plain decoding equals eager."""
    from torch._inductor import cpu_vec_isa

    real_hash = cpu_linears._hash_into
    target, other = tiny_target(layers=2), tiny_target(layers=2, seed=1)
    target.cpu_linears = other.cpu_linears = "inductor"
    head = random_head(target, "eagle3", draft_vocab=40)
    settings = cpu_linears.compile_settings(target, head)
    if not isinstance(cpu_vec_isa.pick_vec_isa(), (cpu_vec_isa.VecAVX2, cpu_vec_isa.VecAVX512)):
        assert settings is None
        return
    assert settings.options["freezing"] and settings.options["max_autotune"]
    assert cpu_linears.compile_settings(other).cache_tag != cpu_linears.compile_settings(target).cache_tag
    # Every frozen constant counts, not only the Linears: a final norm of its own, another tag.
    renormed = tiny_target(layers=2)
    renormed.cpu_linears = "inductor"
    tag = cpu_linears.compile_settings(renormed).cache_tag
    with torch.no_grad():
        renormed.norm.weight.mul_(2)
    assert cpu_linears.compile_settings(renormed).cache_tag != tag
    assert cpu_linears.compile_settings(tiny_target(layers=2)) is None  # torch's Linears: defaults
    prompts = prompts_for(target.config.vocab_size, lens=(6, 13))
    # speculative steps on the same settings: test_quantize compiles them for an int8 target
    eager = generate(target, prompts, 16)
    # The tag hashes the weights at the first compile, not when a compiled step is built.
    hashed = []
    monkeypatch.setattr(cpu_linears, "_hash_into", lambda h, t: hashed.append(t) or real_hash(h, t))
    step = CompiledDecode(target)
    assert hashed == []
    assert generate(target, prompts, 16, compile=True) == eager
    assert sum(t is target.norm.weight for t in hashed) == 1  # once for the whole decode
    assert step.fn.patches is None
    # A later start compiles from torch's FX graph cache (fp32 weights left unpacked for MKL:
    # without_mkl_prepack), same tokens.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    hits = counters["inductor"]["fxgraph_cache_hit"]
    assert generate(target, prompts, 16, compile=True) == eager
    assert counters["inductor"]["fxgraph_cache_hit"] > hits, dict(counters["inductor"])


def test_kernel_templates_parsed_once_and_render_the_same():
    """cached_kernel_templates: one jinja Template per source for the whole process (Inductor
    builds one per use), rendering what a freshly parsed one renders; outside it, Inductor's own."""
    pytest.importorskip("jinja2")
    from torch._inductor.codegen.common import KernelTemplate

    source = "{{ name }}: {{ body | indent_except_first(1) }}"
    fresh = KernelTemplate._template_from_string(source)
    assert KernelTemplate._template_from_string(source) is not fresh
    with cpu_linears.cached_kernel_templates():
        first = KernelTemplate._template_from_string(source)
        assert KernelTemplate._template_from_string(source) is first
        assert KernelTemplate._template_from_string(source + " ") is not first
    with cpu_linears.cached_kernel_templates():  # re-entered: still the same one
        assert KernelTemplate._template_from_string(source) is first
    assert KernelTemplate._template_from_string(source) is not first
    args = {"name": "k", "body": "a\nb"}
    assert first.render(**args) == fresh.render(**args) == "k: a\n    b"
