"""scripts/average_heads.py: weight interpolation of two heads of one draft vocabulary."""

from __future__ import annotations

import pytest
import torch
from script_module import load_script


def _average():
    return load_script("average_heads").average


def test_average_interpolates_floats_and_keeps_equal_maps():
    average = _average()
    g = torch.Generator().manual_seed(0)
    d2t = torch.arange(8)
    a = {"fc.weight": torch.randn(4, 6, generator=g).bfloat16(), "d2t": d2t}
    b = {"fc.weight": torch.randn(4, 6, generator=g).bfloat16(), "d2t": d2t.clone()}
    assert torch.equal(average(a, b, 0.0)["fc.weight"], a["fc.weight"])
    assert torch.equal(average(a, b, 1.0)["fc.weight"], b["fc.weight"])
    mid = average(a, b, 0.5)
    assert mid["fc.weight"].dtype == torch.bfloat16
    want = ((a["fc.weight"].float() + b["fc.weight"].float()) / 2).bfloat16()
    assert torch.equal(mid["fc.weight"], want) and torch.equal(mid["d2t"], d2t)

    with pytest.raises(ValueError, match="d2t .* differs"):
        average(a, {**b, "d2t": d2t.flip(0)}, 0.5)
    with pytest.raises(ValueError, match="different tensors"):
        average(a, {"fc.weight": b["fc.weight"]}, 0.5)
    with pytest.raises(ValueError, match="fc.weight"):
        average(a, {**b, "fc.weight": b["fc.weight"].float()}, 0.5)
