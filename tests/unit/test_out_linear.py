"""OutLinear / GatedMLP `partial_sums`: only CUDA decode batches with the skinny GEMMs enabled ever get
split-K partial sums; everywhere else (CPU, bias, large batches, default off) the plain Linear result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swaserve.layers.linear import OutLinear
from swaserve.layers.mlp import GatedMLP


@pytest.mark.parametrize("bias", [False, True])
def test_out_linear_on_cpu_is_a_linear(bias, monkeypatch):
    monkeypatch.setenv("SWASERVE_SKINNY_GEMM", "1")
    g = torch.Generator().manual_seed(0)
    lin = OutLinear(48, 24, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 48, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(24, generator=g))
    x = torch.randn(5, 48, generator=g)
    ref = F.linear(x, lin.weight, lin.bias)
    assert torch.equal(lin(x, partial_sums=True), ref) and torch.equal(lin(x), ref)
    assert set(dict(lin.named_parameters())) == ({"weight", "bias"} if bias else {"weight"})  # HF names kept


def test_gated_mlp_partial_sums_flag_is_inert_on_cpu(monkeypatch):
    monkeypatch.setenv("SWASERVE_SKINNY_GEMM", "1")
    torch.manual_seed(0)
    mlp = GatedMLP(32, 64, "gelu_pytorch_tanh")
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 32)
    assert torch.equal(mlp(x, partial_sums=True), mlp(x))


def test_skinny_switch_is_opt_in(monkeypatch):
    pytest.importorskip("triton")
    from swaserve.kernels.skinny_gemm import use_skinny

    monkeypatch.delenv("SWASERVE_SKINNY_GEMM", raising=False)
    x = torch.zeros(4, 8)
    assert not use_skinny(x)
    monkeypatch.setenv("SWASERVE_SKINNY_GEMM", "1")
    assert not use_skinny(x)  # CPU tensors never qualify
