"""Fused MoE at Gemma-4-26B-A4B's expert shape (hidden 2816, 128 experts, top-8, intermediate 704,
bf16) on CUDA: vs the per-expert reference at decode and prefill sizes, the one-program pair sort vs
the torch-ops sort, and captured in a CUDA graph (fixed n, new inputs each replay, padded rows masked)
where it must equal the eager call bit for bit, on both sort paths."""

from __future__ import annotations

import pytest
import torch
from engine_driver import record

from swaserve.kernels.fused_moe import _block_m, fused_moe
from swaserve.kernels.moe_align import ALIGN_KERNEL_MAX_PAIRS, align_pairs
from swaserve.layers.fused_moe import moe_experts_reference

pytestmark = pytest.mark.gpu
H, E, K, I = 2816, 128, 8, 704


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = (0.02 * torch.randn(E, 2 * I, H, generator=g, device="cuda")).bfloat16()
    w2 = (0.02 * torch.randn(E, H, I, generator=g, device="cuda")).bfloat16()
    return w1, w2


def _route(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, H, generator=g, device="cuda").bfloat16()
    probs = torch.softmax(torch.randn(n, E, generator=g, device="cuda"), -1)
    w, ids = probs.topk(K, -1)
    return x, (w / w.sum(-1, keepdim=True)).float(), ids


@pytest.mark.parametrize("n", [1, 16, 64, 256, 2048])
def test_matches_reference(weights, n):
    w1, w2 = weights
    x, w, ids = _route(n, n)
    out = fused_moe(x, w1, w2, w, ids, "gelu_tanh")
    ref = moe_experts_reference(x, w1, w2, w, ids, "gelu_tanh")
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    record({"test": "fused_moe_vs_reference", "n": n, "max_rel_err": err})
    assert err < 2e-2, err


@pytest.mark.parametrize("n", [1, 16, 64, 256])
def test_sort_kernel_matches_torch_ops(n):
    _, _, ids = _route(n, 10 + n)
    valid = torch.rand(n, device="cuda") > 0.3
    for row_valid in (None, valid):
        bm = _block_m(n * K, E)
        kernel = align_pairs(ids, E, bm, row_valid, use_kernel=True)
        ops = align_pairs(ids, E, bm, row_valid, use_kernel=False)
        assert torch.equal(kernel[0], ops[0]) and torch.equal(kernel[1], ops[1])


@pytest.mark.parametrize("n", [1, 64, 2 * ALIGN_KERNEL_MAX_PAIRS // K])  # the last sorts by torch ops
def test_cuda_graph_replay_with_padded_rows(weights, n):
    w1, w2 = weights
    x, w, ids = _route(n, 1)
    valid = torch.ones(n, dtype=torch.bool, device="cuda")
    static = [x.clone(), w.clone(), ids.clone(), valid.clone()]
    fused_moe(*static[:1], w1, w2, *static[1:3], "gelu_tanh", static[3])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w1, w2, static[1], static[2], "gelu_tanh", static[3])
    for seed, live in ((2, n), (3, (n + 1) // 2), (4, 1)):
        x, w, ids = _route(n, seed)
        valid = torch.arange(n, device="cuda") < live
        for buf, new in zip(static, (x, w, ids, valid)):
            buf.copy_(new)
        graph.replay()
        eager = fused_moe(x, w1, w2, w, ids, "gelu_tanh", valid)
        assert torch.equal(out, eager), f"graph replay differs from eager with {live} of {n} live rows"
        assert (out[live:] == 0).all()
        ref = moe_experts_reference(x[:live], w1, w2, w[:live], ids[:live], "gelu_tanh")
        err = ((out[:live].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err < 2e-2, err
