"""act_and_mul (gated-MLP activation in one launch) against `get_activation(name)(gate) * up`."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.activation import act_and_mul  # noqa: E402
from swaserve.layers.activation import get_activation  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton 3.9's CPU interpreter mishandles bf16 loads in these kernels (NaN); bf16 runs natively on
# the GPU (scripts/gpu_check.sh runs this directory with SWASERVE_KERNEL_TESTS_ON_GPU=1).
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]
# kernel name -> HF name of the torch reference
ACTS = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "silu": "silu"}
# exp overflowing to inf for very negative gates is intended (it saturates to -0); numpy warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _ref(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return get_activation(ACTS[act])(gate) * up


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("inter", [64, 1000, 6912])
def test_act_and_mul_matches_torch(device, seed, dtype, act, inter):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(3, 2 * inter, generator=g) * 3).to(device, dtype)
    got = act_and_mul(gate_up, act)
    assert got.shape == (3, inter) and got.dtype == dtype
    torch.testing.assert_close(got, _ref(gate_up, act), **_tol(dtype), msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("act", list(ACTS))
def test_act_and_mul_saturates_without_nan(device, act):
    """Huge |gate| (exp overflow inside the kernel) must give gate or -0, never NaN or inf.

    The reference is float64: torch's own float32 CPU gelu may overflow to inf at 3e38 depending on
    the vector width of the machine's kernel (it multiplies x by 1 + erf before halving)."""
    gate = torch.tensor([-1e4, -200.0, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 90.0, 200.0, 1e4, 3e38])
    gate_up = torch.cat([gate, torch.full_like(gate, 0.5)])[None].to(device)
    got = act_and_mul(gate_up, act)
    assert torch.isfinite(got).all(), got
    ref = _ref(gate_up.double(), act).float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_act_and_mul_strided_rows_and_empty(device, seed):
    g = torch.Generator().manual_seed(seed)
    inter = 96
    gate_up = torch.randn(4, 2 * inter + 40, generator=g).to(device)[:, : 2 * inter]  # row stride > width
    torch.testing.assert_close(act_and_mul(gate_up, "silu"), _ref(gate_up, "silu"), rtol=1e-5, atol=1e-5)
    assert act_and_mul(torch.zeros(0, 2 * inter, device=device), "gelu").shape == (0, inter)


def test_act_and_mul_rejects_unknown_activation(device):
    with pytest.raises(ValueError, match="relu"):
        act_and_mul(torch.zeros(1, 8, device=device), "relu")
