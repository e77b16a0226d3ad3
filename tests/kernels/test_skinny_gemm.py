"""skinny_gemm (decode-sized split-K GEMM) against `x @ W.T` in float64."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.skinny_gemm import skinny_gemm, skinny_gemm_splits

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,splits", [(1, 80, 200, 1), (5, 64, 256, 2), (16, 130, 384, 3), (64, 96, 300, 4), (150, 40, 128, 2)])
def test_skinny_gemm_matches_reference(device, seed, dtype, m, n, k, splits):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g).to(device, dtype)
    got = skinny_gemm(x, w, splits, block_n=32, block_k=64)
    if splits == 1:
        assert got.shape == (m, n) and got.dtype == dtype
        total = got.float()
    else:
        assert got.shape == (splits, m, n) and got.dtype == torch.float32
        total = got.sum(0)
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 0.5}
    torch.testing.assert_close(total, _ref(x, w), **tol, msg=lambda s: f"seed={seed}: {s}")


def test_rows_do_not_depend_on_batch(device, seed):
    """A row's partial sums are bit-identical whether it comes alone or with other rows (padded
    graph batches rely on it). Exact on the GPU, where an MMA row never sees the other rows; the
    CPU interpreter's BLAS rounds by a row's position in the tile, so there it is a tolerance."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 192, generator=g).to(device)
    w = torch.randn(96, 192, generator=g).to(device)
    full = skinny_gemm(x, w, 3, block_n=32, block_k=64, block_m=16)  # rows in two blocks of 16
    for rows in (slice(0, 1), slice(3, 10), slice(0, 24), slice(17, 24)):
        got = skinny_gemm(x[rows], w, 3, block_n=32, block_k=64, block_m=16)
        if INTERPRET:
            torch.testing.assert_close(got, full[:, rows], rtol=1e-5, atol=1e-4)
        else:
            assert torch.equal(got, full[:, rows])


def test_strided_rows_and_out_buffer(device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 160, generator=g).to(device)[:, :128]  # row stride 160
    w = torch.randn(48, 128, generator=g).to(device)
    out = torch.full((2, 4, 48), float("nan"), device=device)
    assert skinny_gemm(x, w, 2, block_n=32, block_k=64, out=out) is out
    torch.testing.assert_close(out.sum(0), _ref(x, w), rtol=1e-4, atol=1e-3)
    assert skinny_gemm(x[:0], w, 2, block_n=32, block_k=64).shape == (2, 0, 48)


def test_split_count_depends_on_the_weight_only():
    assert skinny_gemm_splits(1152, 6912, 132) == skinny_gemm_splits(1152, 6912, 132)
    assert skinny_gemm_splits(1152, 6912, 132) == 8  # 18 N-blocks want 15 for ~2 programs per SM; capped
    assert skinny_gemm_splits(1152, 6912, 132, max_splits=64) == 15
    assert skinny_gemm_splits(2560, 10240, 132) == 7  # 40 N-blocks
    assert skinny_gemm_splits(13824, 1152, 132) == 1  # wide outputs fill the GPU without splitting
    assert skinny_gemm_splits(64, 100, 132) == 1  # never more splits than K-blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu_tanh", "silu", "gelu"])
@pytest.mark.parametrize("m,inter,k", [(1, 80, 200), (9, 64, 256), (64, 100, 130)])
def test_skinny_gated_gemm_matches_gemm_then_act(device, seed, dtype, act, m, inter, k):
    """One launch equals the merged GEMM followed by act_and_mul (both round gate/up to the dtype)."""
    from swaserve.kernels.activation import act_and_mul
    from swaserve.kernels.skinny_gemm import skinny_gated_gemm

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(2 * inter, k, generator=g) / k**0.5).to(device, dtype)
    got = skinny_gated_gemm(x, w, act, block_n=32, block_k=64)
    assert got.shape == (m, inter) and got.dtype == dtype
    ref = act_and_mul(_ref(x, w).to(dtype), act)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, ref, **tol, msg=lambda s: f"seed={seed}: {s}")
    with pytest.raises(ValueError, match="unsupported activation"):
        skinny_gated_gemm(x, w, "relu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [320, 2304])  # both default tiles of the gated form
def test_default_launch_settings(device, seed, dtype, k):
    """The tiles the layers use (no overrides) fit the GPU's shared memory for fp32 as well as bf16."""
    from swaserve.kernels.activation import act_and_mul
    from swaserve.kernels.skinny_gemm import skinny_gated_gemm

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, k, generator=g).to(device, dtype)
    w = (torch.randn(192, k, generator=g) / k**0.5).to(device, dtype)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(skinny_gemm(x, w, 2).sum(0), _ref(x, w), **tol)
    torch.testing.assert_close(skinny_gated_gemm(x, w, "gelu_tanh"), act_and_mul(_ref(x, w).to(dtype), "gelu_tanh"),
                               **tol)
