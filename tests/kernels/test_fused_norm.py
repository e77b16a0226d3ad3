"""add_rms_norm (residual add + next norm in one launch) against the unfused torch form and the two
`rms_norm` launches it replaces."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.norm import add_rms_norm, rms_norm  # noqa: E402
from swaserve.layers.norm import RMSNorm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton 3.9's CPU interpreter mishandles bf16 loads in these kernels (NaN); bf16 runs natively on
# the GPU (scripts/gpu_check.sh runs this directory with SWASERVE_KERNEL_TESTS_ON_GPU=1).
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]
FORMS = [dict(unit_offset=True), dict(fp32_weight=True), dict()]


def _norm(dim: int, form: dict, dtype: torch.dtype, device: str, g: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, eps=1e-6, **form)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g) * 0.3)
    return norm.to(device=device, dtype=dtype)  # weights in the model dtype


def _kw(form: dict) -> dict:
    return dict(unit_offset=form.get("unit_offset", False), weight_fp32=form.get("fp32_weight", False))


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dim", [64, 640, 1152])
@pytest.mark.parametrize("has_post", [True, False])
def test_add_rms_norm_matches_unfused(device, seed, dtype, form, dim, has_post):
    g = torch.Generator().manual_seed(seed)
    post = _norm(dim, form, dtype, device, g) if has_post else None
    nxt = _norm(dim, form, dtype, device, g)
    x = (torch.randn(5, dim, generator=g) * 3).to(device, dtype)
    res = torch.randn(5, dim, generator=g).to(device, dtype)
    h_ref = res + (post._reference(x) if post is not None else x)
    y_ref = nxt._reference(h_ref)  # from the rounded h, as the unfused path reloads it
    h, y = add_rms_norm(x, res, post.weight if post is not None else None, nxt.weight, 1e-6, **_kw(form))
    assert h.dtype == y.dtype == dtype and h.shape == y.shape == x.shape
    torch.testing.assert_close(h, h_ref, **_tol(dtype), msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(y, y_ref, **_tol(dtype), msg=lambda m: f"seed={seed}: {m}")

    # The two launches it replaces: the same op order, so bit-identical where the reduction is the
    # same code (the interpreter); on the GPU only the fp32 reduction tree could differ.
    h_u = rms_norm(x, post.weight, 1e-6, residual=res, **_kw(form)) if post is not None else res + x
    y_u = rms_norm(h_u, nxt.weight, 1e-6, **_kw(form))
    if INTERPRET:
        assert torch.equal(h, h_u) and torch.equal(y, y_u), f"seed={seed}"
    else:
        torch.testing.assert_close(h, h_u, **_tol(dtype))
        torch.testing.assert_close(y, y_u, **_tol(dtype))


@pytest.mark.parametrize("has_post", [True, False])
def test_add_rms_norm_strided_rows(device, seed, has_post):
    g = torch.Generator().manual_seed(seed)
    dim = 96
    post = _norm(dim, FORMS[0], torch.float32, device, g)
    nxt = _norm(dim, FORMS[0], torch.float32, device, g)
    x = torch.randn(6, 3, dim, generator=g).to(device)[:, 1]  # rows with a stride
    res = torch.randn(6, 2, dim, generator=g).to(device)[:, 0]  # a different stride
    assert x.stride(0) != dim and res.stride(0) != x.stride(0)
    x_before, res_before = x.clone(), res.clone()
    h, y = add_rms_norm(x, res, post.weight if has_post else None, nxt.weight, 1e-6, unit_offset=True)
    h_ref = res + (post._reference(x) if has_post else x)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, nxt._reference(h_ref), rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs must not be written"
    assert h.is_contiguous() and y.is_contiguous()


def test_add_rms_norm_empty(device):
    w = torch.ones(32, device=device)
    x = torch.zeros(0, 32, device=device)
    h, y = add_rms_norm(x, x.clone(), w, w, 1e-6)
    assert h.shape == y.shape == (0, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_post", [True, False])
@pytest.mark.parametrize("parts", [1, 3, 15])
def test_add_rms_norm_sums_split_k_partials(device, seed, dtype, has_post, parts):
    """x given as float32 partial sums [S, T, dim] (skinny_gemm's output): summed in split order and
    rounded to the dtype, then the one-tensor path (bit for bit in the interpreter)."""
    g = torch.Generator().manual_seed(seed)
    dim = 640
    post = _norm(dim, FORMS[0], dtype, device, g) if has_post else None
    nxt = _norm(dim, FORMS[0], dtype, device, g)
    partial = torch.randn(parts, 7, dim, generator=g).to(device)
    res = torch.randn(7, dim, generator=g).to(device, dtype)
    total = partial[0].clone()
    for s in range(1, parts):
        total += partial[s]
    pw = post.weight if post is not None else None
    h, y = add_rms_norm(partial, res, pw, nxt.weight, 1e-6, unit_offset=True)
    h_ref, y_ref = add_rms_norm(total.to(dtype), res, pw, nxt.weight, 1e-6, unit_offset=True)
    assert h.shape == y.shape == res.shape and h.dtype == dtype
    if INTERPRET:
        assert torch.equal(h, h_ref) and torch.equal(y, y_ref), f"seed={seed}"
    else:  # the partial-sum launch uses 8 warps (register pressure): another fp32 reduction tree
        torch.testing.assert_close(h, h_ref, **_tol(dtype), msg=lambda m: f"seed={seed}: {m}")
        torch.testing.assert_close(y, y_ref, **_tol(dtype), msg=lambda m: f"seed={seed}: {m}")
    with pytest.raises(AssertionError):
        add_rms_norm(partial.to(dtype) if dtype != torch.float32 else partial[:, :3], res, pw, nxt.weight, 1e-6)
