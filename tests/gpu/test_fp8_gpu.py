"""Block-FP8 kernels compiled on the GPU at real shapes (MiMo-V2-Flash, Gemma-4-26B-A4B) against the
dequantise-at-use reference: the GEMM at decode rows (1-256) and prefill rows (2k-16k), weight-only and
W8A8; the FP8 experts of the fused MoE; CUDA-graph capture and replay equal to eager; padded (zero /
invalid) rows inert and live rows bitwise unchanged by them; deterministic mode rows independent of M.

    SWASERVE_KERNEL_TESTS_ON_GPU=1 python -m pytest -q tests/gpu/test_fp8_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from swaserve.kernels.fp8_gemm import fp8_gemm, quant_fp8_groups
from swaserve.kernels.fused_moe import fused_moe
from swaserve.layers import fp8
from swaserve.layers.fused_moe import moe_experts_reference

DEV = torch.device("cuda")
# (N, K): MiMo-V2-Flash sliding qkv, dense down; Gemma-4-26B-A4B qkv, o_proj, dense down.
SHAPES = [(14848, 4096), (4096, 16384), (8192, 2816), (2816, 4096), (2816, 2112)]


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return fp8.quantize(0.02 * torch.randn(n, k, generator=g, device=DEV))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 64, 256, 2048])
def test_gemm_matches_dequantised_reference(n, k, m):
    q, s = _weight(n, k, m)
    x = torch.randn(m, k, device=DEV).bfloat16()
    w = fp8.dequantize(q, s, torch.float32)
    ref = x.float() @ w.T
    for act_fp8 in (False, True):
        got = fp8_gemm(x, q, s, act_fp8=act_fp8)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        if act_fp8:  # against the reference on the activations it multiplies, then against bf16's
            xq, xs = quant_fp8_groups(x)
            assert _rel(got, fp8.dequantize(xq, xs, torch.float32, scale_rows=1) @ w.T) < 1e-2
            assert _rel(got, ref) < 6e-2
        else:
            assert _rel(got, ref) < 1e-2, (m, n, k)


@pytest.mark.parametrize("m", [8192, 16384])
def test_gemm_prefill_sizes(m):
    n, k = 8192, 2816
    q, s = _weight(n, k, 0)
    x = torch.randn(m, k, device=DEV).bfloat16()
    got = fp8_gemm(x, q, s)  # W8A8 by default at these sizes
    xq, xs = quant_fp8_groups(x)
    ref = fp8.dequantize(xq, xs, torch.bfloat16, scale_rows=1) @ fp8.dequantize(q, s, torch.bfloat16).T
    assert _rel(got, ref) < 2e-2


def test_quantiser_matches_torch_bit_for_bit():
    x = torch.randn(300, 4096, device=DEV).bfloat16() * torch.logspace(-3, 2, 4096, device=DEV).bfloat16()
    q, s = quant_fp8_groups(x)
    q_ref, s_ref = fp8.quantize_act_groups(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 5, 64, 200])
def test_graph_replay_equals_eager_and_padded_rows_are_inert(m):
    """A decode graph captured at a padded batch: zero rows give 0, and the live rows are bitwise what
    they are eagerly alone (rows never mix, in either mode)."""
    n, k = 2816, 4096
    q, s = _weight(n, k, 1)
    bs = max(8, 1 << (m - 1).bit_length())
    static = torch.zeros(bs, k, device=DEV, dtype=torch.bfloat16)
    fp8_gemm(static, q, s)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm(static, q, s)
    live = torch.randn(m, k, device=DEV).bfloat16()
    static.zero_()
    static[:m] = live
    graph.replay()
    torch.cuda.synchronize()
    assert (out[m:] == 0).all()
    act_fp8 = bs >= 128  # the mode the captured batch size picked
    assert torch.equal(out[:m], fp8_gemm(live, q, s, act_fp8=act_fp8))


def test_deterministic_mode_rows_do_not_depend_on_m():
    q, s = _weight(4224, 2816, 2)
    x = torch.randn(300, 2816, device=DEV).bfloat16()
    full = fp8_gemm(x, q, s, batch_invariant=True)
    for rows in (slice(0, 1), slice(3, 40), slice(100, 300)):
        assert torch.equal(fp8_gemm(x[rows], q, s, batch_invariant=True), full[rows])


def _experts(H: int, E: int, I: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w1 = 0.02 * torch.randn(E, 2 * I, H, generator=g, device=DEV)
    w2 = 0.02 * torch.randn(E, H, I, generator=g, device=DEV)
    q2, s2 = fp8.quantize(w2)
    if I % fp8.BLOCK:  # gate/up parts of 704 rows: a scale per row, as `StackedExperts` holds them
        (qg, sg), (qu, su) = fp8.quantize(w1[:, :I]), fp8.quantize(w1[:, I:])
        q1 = torch.cat([qg.view(torch.uint8), qu.view(torch.uint8)], 1).view(fp8.FP8)
        s1 = torch.cat([fp8.expand_scale_rows(sg, I), fp8.expand_scale_rows(su, I)], 1).contiguous()
        return q1, s1, q2, s2, 1
    q1, s1 = fp8.quantize(w1)
    return q1, s1, q2, s2, fp8.BLOCK


@pytest.mark.parametrize("model", ["gemma4-26b-a4b", "mimo-v2-flash"])
@pytest.mark.parametrize("n", [1, 16, 256, 2048])
def test_fp8_experts_match_reference(model, n):
    # Real widths and top-k; MiMo's 256 experts cut to 32 (its full stack is 17 GB in fp32 before quantising,
    # more than a GPU shared with the other test processes holds): the number of experts only offsets pointers.
    H, E, K, I = {"gemma4-26b-a4b": (2816, 128, 8, 704), "mimo-v2-flash": (4096, 32, 8, 2048)}[model]
    q1, s1, q2, s2, sr = _experts(H, E, I, n)
    x = torch.randn(n, H, device=DEV).bfloat16()
    routes = torch.randn(n, E, device=DEV).softmax(-1).topk(K, -1)
    w, ids = routes.values.float(), routes.indices
    valid = torch.ones(n, dtype=torch.bool, device=DEV)
    valid[n // 2 + 1:: 7] = False  # a few padded rows (none of one row)
    kw = {"gate_up_scales": s1, "down_scales": s2, "gate_up_scale_rows": sr}
    ref = moe_experts_reference(x.float(), q1, q2, w, ids, "silu", valid, **kw)
    for act_fp8 in (False, True):
        got = fused_moe(x, q1, q2, w, ids, "silu", valid, act_fp8=act_fp8, **kw)
        assert (got[~valid] == 0).all() and torch.isfinite(got).all()
        assert _rel(got, ref) < (8e-2 if act_fp8 else 2e-2), (model, n, act_fp8)


def test_fp8_experts_capture_in_a_graph():
    H, E, K, I = 2816, 128, 8, 704
    q1, s1, q2, s2, sr = _experts(H, E, I, 3)
    kw = {"gate_up_scales": s1, "down_scales": s2, "gate_up_scale_rows": sr}
    bs = 32
    x = torch.zeros(bs, H, device=DEV, dtype=torch.bfloat16)
    w = torch.zeros(bs, K, device=DEV)
    ids = torch.zeros(bs, K, dtype=torch.int64, device=DEV)
    valid = torch.zeros(bs, dtype=torch.bool, device=DEV)
    fused_moe(x, q1, q2, w, ids, "silu", valid, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, q1, q2, w, ids, "silu", valid, **kw)
    m = 19
    routes = torch.randn(m, E, device=DEV).softmax(-1).topk(K, -1)
    x.zero_()
    x[:m] = torch.randn(m, H, device=DEV).bfloat16()
    w[:m], ids[:m] = routes.values, routes.indices
    valid.zero_()
    valid[:m] = True
    graph.replay()
    torch.cuda.synchronize()
    eager = fused_moe(x[:m].clone(), q1, q2, w[:m].clone(), ids[:m].clone(), "silu", None, **kw)
    assert (out[m:] == 0).all()
    assert _rel(out[:m], eager) < 1e-2  # block_m follows the pair count, so tiles may differ from eager
