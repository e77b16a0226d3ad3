"""moe_inputs (a Gemma 4 MoE block's router and expert inputs in one launch) against the launches it
replaces, bit for bit: the weightless `rms_norm`, the two products in torch, `rms_norm` with the experts'
norm weight; and the wiring in `Gemma4MoE` against its unfused form."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.moe_inputs import moe_inputs  # noqa: E402
from swaserve.kernels.norm import rms_norm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# bf16 loads are broken in Triton 3.9's CPU interpreter (test_fused_norm.py); natively both dtypes
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 1000, 2816])
def test_moe_inputs_equal_the_separate_launches(device, seed, dtype, dim):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(6, dim, generator=g) * 4).to(device, dtype)
    scale = (torch.randn(dim, generator=g) * 0.5 + 1).to(device, dtype)
    w = (torch.randn(dim, generator=g) * 0.3 + 1).to(device)  # float32, Gemma 4's norm form
    root = dim**-0.5
    router_in, experts_in = moe_inputs(h, scale, root, w, 1e-6, weight_fp32=True)
    ones = torch.ones(dim, device=device)
    want_router = rms_norm(h, ones, 1e-6, weight_fp32=True) * scale * root
    want_experts = rms_norm(h, w, 1e-6, weight_fp32=True)
    assert torch.equal(router_in, want_router) and torch.equal(experts_in, want_experts), f"seed={seed}"
    hf = h.float()
    xhat = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(router_in.float(), xhat * scale.float() * root, **tol)
    torch.testing.assert_close(experts_in.float(), xhat * w, **tol)


def test_moe_inputs_strided_and_empty(device, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(3, 96, generator=g).to(device)
    h = wide[:, 16:80]
    scale, w = torch.rand(64, generator=g).to(device) + 0.5, torch.rand(64, generator=g).to(device) + 0.5
    got = moe_inputs(h, scale, 0.125, w, 1e-6, weight_fp32=True)
    want = moe_inputs(h.contiguous(), scale, 0.125, w, 1e-6, weight_fp32=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = moe_inputs(h[:0], scale, 0.125, w, 1e-6, weight_fp32=True)
    assert empty[0].shape == empty[1].shape == (0, 64)


def test_gemma4_moe_block_fused_inputs_match_its_unfused_form(device, seed, monkeypatch):
    """`Gemma4MoE` with the fused inputs routes to the same experts with the same weights and feeds them
    the same rows as its unfused form (torch's reference norms here)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import families

    from swaserve.model_config import ModelConfig
    from swaserve.models.registry import build_model

    hf = families.gemma4_moe()
    hf.architectures = ["Gemma4ForCausalLM"]
    model = build_model(ModelConfig.from_hf(hf), torch.float32, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    families.randomize_(model, seed)
    block = model.model.layers[0].moe
    h = torch.randn(5, hf.hidden_size, generator=torch.Generator().manual_seed(seed)) * 3
    seen = []
    monkeypatch.setattr(block.experts.__class__, "forward", lambda self, x, w, ids, rows: seen.append((x, w, ids)))
    from types import SimpleNamespace

    block(h, SimpleNamespace(scratch={}, is_decode=False))
    block.to(device)._fused_inputs_forward(h.to(device), SimpleNamespace(scratch={}, is_decode=False))
    (x0, w0, ids0), (x1, w1, ids1) = seen
    assert torch.equal(ids0, ids1.cpu()), f"seed={seed}"
    torch.testing.assert_close(w1.cpu(), w0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x1.cpu(), x0, rtol=1e-5, atol=1e-5)
