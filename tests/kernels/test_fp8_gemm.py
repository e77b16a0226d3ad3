"""Block-FP8 kernels against the torch dequantise-at-use reference (`layers.fp8`): the per-token-group
activation quantiser bit for bit; the GEMM weight-only and W8A8, block and per-row scales, odd M, N and
K that are not multiples of 128, bias; all-zero (padded) rows inert; rows independent of the batch; and
the fused MoE's FP8 experts (both activation modes, padded rows route nothing)."""

from __future__ import annotations

import os

import pytest
import torch

from swaserve.kernels.fp8_gemm import fp8_gemm, quant_fp8_groups
from swaserve.kernels.fused_moe import fused_moe
from swaserve.layers import fp8
from swaserve.layers.fused_moe import moe_experts_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _weight(n: int, k: int, g: torch.Generator, scale_rows: int = fp8.BLOCK):
    w = 0.05 * torch.randn(n, k, generator=g)
    w[: min(n, 40)] *= 8.0  # blocks of different magnitudes: a wrong block index shows
    q, s = fp8.quantize(w)
    if scale_rows == 1:
        s = fp8.expand_scale_rows(s, n)
    return q, s


def _ref(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, scale_rows: int, act_fp8: bool) -> torch.Tensor:
    if act_fp8:
        xq, xs = fp8.quantize_act_groups(x)
        x = fp8.dequantize(xq, xs, torch.float32, scale_rows=1)
    return x.double() @ fp8.dequantize(q, s, torch.float32, scale_rows).double().T


def test_activation_quantiser_matches_torch_bit_for_bit(device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 300, generator=g) * torch.logspace(-3, 2, 300)  # wide ranges: subnormal fp8 codes too
    x[3] = 0.0  # a padded row: finite scale, zero codes
    x[6, 0] = -1e-12  # rounds to -0: the sign survives
    q, s = quant_fp8_groups(x.to(device))
    q_ref, s_ref = fp8.quantize_act_groups(x)
    assert q.dtype == fp8.FP8 and s.shape == (7, 3)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.isfinite(s).all() and (q.cpu()[3].float() == 0).all()


@pytest.mark.parametrize("act_fp8", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("scale_rows", [128, 1], ids=["block", "per_row"])
@pytest.mark.parametrize("m,n,k", [(1, 200, 300), (5, 96, 256), (33, 130, 128)])
def test_gemm_matches_dequantised_reference(device, seed, act_fp8, scale_rows, m, n, k):
    g = torch.Generator().manual_seed(seed)
    q, s = _weight(n, k, g, scale_rows)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    got = fp8_gemm(x.to(device), q.to(device), s.to(device), bias.to(device), scale_rows=scale_rows, act_fp8=act_fp8)
    want = _ref(x, q, s, scale_rows, act_fp8) + bias.double()
    assert got.shape == (m, n) and got.dtype == torch.float32
    # Hopper's FP8 MMAs add their products with a narrower accumulator than fp32's (about 14 bits, per
    # DeepSeek-V3's report; the kernel promotes to fp32 every 128 inputs): up to 6.2e-3 off on an H100
    # (these shapes, 2026-11-28). The interpreter's W8A8 and every weight-only GEMM add in fp32.
    rtol, atol = (1e-3, 1e-2) if act_fp8 and device != "cpu" else (1e-5, 1e-4)
    torch.testing.assert_close(got.cpu().double(), want, rtol=rtol, atol=atol, msg=lambda e: f"seed={seed}: {e}")


def test_bf16_activations(device, seed):
    g = torch.Generator().manual_seed(seed)
    q, s = _weight(160, 384, g)
    x = torch.randn(9, 384, generator=g).bfloat16()
    for act_fp8 in (False, True):
        got = fp8_gemm(x.to(device), q.to(device), s.to(device), act_fp8=act_fp8).cpu()
        want = _ref(x.float(), q, s, 128, act_fp8)
        assert got.dtype == torch.bfloat16
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 1e-2, (act_fp8, err)


def test_padded_rows_are_inert_and_rows_independent(device, seed):
    """Zero rows (a replayed graph's padding) give 0 (or the bias) and no NaN in either mode; a row's
    result is the same alone as in a batch (exact on the GPU; the interpreter's BLAS rounds by position)."""
    g = torch.Generator().manual_seed(seed)
    q, s = [t.to(device) for t in _weight(96, 256, g)]
    x = torch.randn(12, 256, generator=g).to(device)
    x[[2, 7, 11]] = 0.0
    for act_fp8 in (False, True):
        full = fp8_gemm(x, q, s, act_fp8=act_fp8)
        assert torch.isfinite(full).all() and (full[[2, 7, 11]] == 0).all()
        for rows in (slice(0, 1), slice(3, 9)):
            part = fp8_gemm(x[rows], q, s, act_fp8=act_fp8)
            if INTERPRET:
                torch.testing.assert_close(part, full[rows], rtol=1e-6, atol=1e-5)
            else:
                assert torch.equal(part, full[rows])


def _moe_problem(n, E, k, H, I, seed, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    q1, s1 = fp8.quantize(0.2 * torch.randn(E, 2 * I, H, generator=g))
    q2, s2 = fp8.quantize(0.2 * torch.randn(E, H, I, generator=g))
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    return x, q1, s1, q2, s2, torch.rand(n, k, generator=g), ids


def _w8a8_moe_reference(x, q1, s1_rows, q2, s2, w, ids, valid):
    """The W8A8 MoE's arithmetic in float32, pair by pair: x quantised per row and 128 inputs, silu(gate) * up,
    that intermediate quantised likewise, then the down projection; slots summed in order."""
    def act_q(v):
        vq, vs = fp8.quantize_act_groups(v)
        return fp8.dequantize(vq, vs, torch.float32, scale_rows=1)

    xq = act_q(x)
    out = torch.zeros(x.shape[0], q2.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            if not valid[t]:
                continue
            e = int(ids[t, j])
            gate, up = (xq[t : t + 1] @ fp8.dequantize(q1[e], s1_rows[e], torch.float32, scale_rows=1).T).chunk(2, -1)
            h = act_q(torch.nn.functional.silu(gate) * up)
            out[t] += w[t, j] * (h @ fp8.dequantize(q2[e], s2[e], torch.float32).T)[0]
    return out


@pytest.mark.parametrize("act_fp8", [False, True], ids=["w8a16", "w8a8"])
def test_fused_moe_fp8_experts(device, seed, act_fp8):
    """I = 160 (gate and up split inside a 128-row block, so the gate/up scales are per row) and
    H = 144 (a partial input block); padded rows route nothing and give 0."""
    n, E, k, H, I = 7, 5, 2, 144, 160
    x, q1, s1, q2, s2, w, ids = _moe_problem(n, E, k, H, I, seed)
    s1_rows = fp8.expand_scale_rows(s1, 2 * I)
    valid = torch.tensor([True, True, False, True, True, False, True])
    scales = {"gate_up_scales": s1_rows, "down_scales": s2, "gate_up_scale_rows": 1}
    dev = {name: t.to(device) for name, t in scales.items() if isinstance(t, torch.Tensor)}
    out = fused_moe(x.to(device), q1.to(device), q2.to(device), w.to(device), ids.to(device), "silu",
                    valid.to(device), gate_up_scale_rows=1, act_fp8=act_fp8, **dev).cpu()
    ref = (_w8a8_moe_reference(x, q1, s1_rows, q2, s2, w, ids, valid) if act_fp8
           else moe_experts_reference(x, q1, q2, w, ids, "silu", valid, **scales))
    assert (out[~valid] == 0).all()
    # W8A8: the reference quantises x and each pair's h as the kernels do; a value that lands on the other side
    # of an e4m3 rounding boundary (the kernel's fp32 sums in another order) moves one output slightly.
    tol = 2e-3 if act_fp8 else 1e-5
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < tol, f"seed={seed}: relative error {err:.2e}"
