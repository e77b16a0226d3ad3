"""gemv (one row, weight-streaming, no split over K) against `x @ W.T + b` in float64, and when the layers
take it."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.gemv import gemv, gemv_config, use_gemv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16, torch.float16]


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y + b.double() if b is not None else y).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k,block_n,block_k", [
    (80, 256, 8, 64),  # K a whole number of tiles
    (37, 200, 4, 64),  # a partial last tile, rows past N in the last block
    (64, 50, 16, 64),  # K inside one tile
    (33, 130, 2, 32),
    (96, 384, 4, 128),
])
def test_gemv_matches_reference(device, seed, dtype, bias, n, k, block_n, block_k):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    got = gemv(x, w, b, block_n=block_n, block_k=block_k)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 0.25}
    torch.testing.assert_close(got.float(), _ref(x, w, b), **tol, msg=lambda s: f"seed={seed}: {s}")


def test_default_launch_and_strided_weight_and_out_buffer(device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1100, generator=g).to(device)
    w = torch.randn(48, 1200, generator=g).to(device)[:, :1100]  # a column slice: row stride 1200
    out = torch.full((1, 48), float("nan"), device=device)
    assert gemv(x, w, out=out) is out  # gemv_config: 512-wide tiles, the last partial
    torch.testing.assert_close(out, _ref(x, w, None), rtol=1e-4, atol=1e-3)


def test_config_and_when_the_layers_take_it(monkeypatch):
    import swaserve.kernels.gemv as gemv_mod

    assert gemv_config(5120, 2880, 132) == (8, 512, 4)  # 640 programs of 8 rows
    assert gemv_config(4096, 2560, 132) == (4, 512, 4)  # 8 rows would give an SM under 4 programs
    assert gemv_config(2816, 8192, 132) == (4, 512, 4)
    assert gemv_config(2560, 10240, 132) == (4, 1024, 4)  # very long rows: 1024-wide tiles
    assert gemv_config(1152, 6912, 132) == (2, 1024, 4)  # 2-row blocks from K = 4096: 1024-wide tiles
    assert gemv_config(1536, 1152, 132) == (2, 512, 4)
    assert gemv_config(96, 200, 132)[1] == 128  # K under 1024: a tile of half its next power of two

    class Cuda:  # what use_gemv reads of an input: a one-row 2-D bf16 tensor on a GPU
        is_cuda, shape, dtype = True, (1, 2816), torch.bfloat16

        def dim(self) -> int:
            return 2

    x = Cuda()
    w = torch.empty(4224, 2816, dtype=torch.bfloat16)
    monkeypatch.setattr(gemv_mod, "_ENABLED", True)
    assert use_gemv(x, w)
    assert not use_gemv(x, torch.empty(8192, 2816, dtype=torch.bfloat16))  # over twice the input: the library
    assert not use_gemv(x, torch.empty(512, 2816, dtype=torch.bfloat16))  # a few programs
    assert not use_gemv(x, w.float())
    assert not use_gemv(x, torch.empty(2816, 4224, dtype=torch.bfloat16).T)  # a transposed weight
    x.shape = (2, 2816)
    assert not use_gemv(x, w)  # one row only
    x.shape, x.is_cuda = (1, 2816), False
    assert not use_gemv(x, w)
    x.is_cuda = True
    monkeypatch.setattr(gemv_mod, "_ENABLED", False)  # SWASERVE_GEMV=0
    assert not use_gemv(x, w)
