"""cpu_linears=onednn: multi-row fp32 Linears through oneDNN prepacked weights give the same
numbers as torch's, eager and compiled, and speculative decoding stays token-identical to
plain decoding with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_speculative import prompts_for, random_head, tiny_target

from eagle_infer import cpu_linears
from eagle_infer.errors import UserError
from eagle_infer.generate import generate
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


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_speculative_greedy_identical_with_onednn_linears(kind):
    target = tiny_target(layers=3)
    head = random_head(target, kind, draft_vocab=40 if kind == "eagle3" else None)
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 40)
    cpu_linears.use_onednn_linears(target)
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
    with pytest.raises(UserError, match="cpu_linears must be torch or onednn"):
        load_model(tiny_model_dir("llama"), "fp32", "cpu", cpu_linears="mkl")
