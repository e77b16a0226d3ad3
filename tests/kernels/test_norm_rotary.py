"""Fused RMSNorm and rotary kernels against the torch forms in `layers/` (the references)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.norm import rms_norm  # noqa: E402
from swaserve.kernels.rotary import apply_rotary_  # noqa: E402
from swaserve.layers.norm import RMSNorm  # noqa: E402
from swaserve.layers.rotary import RotaryEmbedding, _rotate  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton 3.9's CPU interpreter mishandles bf16 loads in these kernels (NaN); bf16 runs natively on
# the GPU (scripts/gpu_check.sh runs this directory with SWASERVE_KERNEL_TESTS_ON_GPU=1).
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", [dict(unit_offset=True), dict(fp32_weight=True), dict()])
@pytest.mark.parametrize("dim", [64, 640, 1152])
def test_rms_norm_matches_torch_form(device, dtype, form, dim):
    norm = RMSNorm(dim, eps=1e-6, **form).to(device=device, dtype=dtype)  # weights in the model dtype
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = (torch.randn(7, dim, device=device) * 3).to(dtype)
    res = torch.randn(7, dim, device=device).to(dtype)
    ref = norm._reference(x)
    got = rms_norm(x, norm.weight, 1e-6, unit_offset=form.get("unit_offset", False),
                   weight_fp32=form.get("fp32_weight", False))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(got, ref, **tol)
    got_res = rms_norm(x, norm.weight, 1e-6, unit_offset=form.get("unit_offset", False),
                       weight_fp32=form.get("fp32_weight", False), residual=res)
    torch.testing.assert_close(got_res, res + ref, **tol)


def test_rms_norm_strided_rows(device):
    norm = RMSNorm(32, unit_offset=True).to(device)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, 3, 32, device=device)[:, 1]  # rows with a stride
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6, unit_offset=True), norm._reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, hq, hk", [(16, 4, 2), (256, 4, 1), (64, 8, 8)])
def test_rotary_in_place_matches_torch(device, dtype, head_dim, hq, hk):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rope = RotaryEmbedding(inv_freq, attention_scaling=1.25)
    positions = torch.tensor([0, 1, 5, 511, 512, 513, 4099], device=device)
    qkv = torch.randn(len(positions), (hq + 2 * hk) * head_dim, device=device).to(dtype)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)  # strided views, like the layer
    q, k = q.view(-1, hq, head_dim), k.view(-1, hk, head_dim)
    cos, sin = rope.cos_sin(positions)
    ref_q = _rotate(q, cos[:, None].to(dtype), sin[:, None].to(dtype))
    ref_k = _rotate(k, cos[:, None].to(dtype), sin[:, None].to(dtype))
    apply_rotary_(q, k, cos, sin)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)


@pytest.mark.parametrize("head_dim, rotary_dim", [(24, 8), (192, 64)])
def test_partial_rotary_in_place_on_leading_channels(device, head_dim, rotary_dim):
    """MiMo-V2's partial rotary: the kernel rotates views of each head's first `rotary_dim` channels
    (as `RotaryEmbedding.forward` passes them on CUDA) and leaves the rest untouched."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rope = RotaryEmbedding(inv_freq)
    positions = torch.tensor([0, 7, 8, 9, 131, 4099], device=device)
    hq, hk = 4, 2
    qkv = torch.randn(len(positions), (hq + hk) * head_dim + hk * 16, device=device)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * 16], dim=-1)
    q, k = q.view(-1, hq, head_dim), k.view(-1, hk, head_dim)
    ref_q, ref_k = rope(positions.cpu(), q.cpu(), k.cpu())  # the torch path on CPU tensors
    cos, sin = rope.cos_sin(positions)
    apply_rotary_(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
    torch.testing.assert_close(q.cpu(), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.cpu(), ref_k, rtol=1e-5, atol=1e-5)


def test_cos_sin_cache_is_per_forward():
    rope = RotaryEmbedding(torch.ones(4))
    cache: dict = {}
    a = rope.cos_sin(torch.tensor([1, 2]), cache)
    assert rope.cos_sin(torch.tensor([7, 8]), cache) is a, "layers of one forward share the tables"
    b = rope.cos_sin(torch.tensor([7, 8]), {})  # a new forward: recomputed
    assert not torch.equal(a[0], b[0])
