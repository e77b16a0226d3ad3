"""route_topk (an MoE router's top-k and weights in one launch) against torch: `torch.topk` then a softmax
over the selected logits (GPT-OSS), and Gemma 4's softmax over all experts, top k, renormalised, times
`per_expert_scale`; ties to the lower expert index; strided and empty inputs."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.router_topk import route_topk, route_topk_reference  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# (E, k) of the families' routers: Gemma-4-26B-A4B, GPT-OSS-20B, GPT-OSS-120B, tiny test models, and an
# expert count that is not a power of two
SHAPES = [(128, 8), (32, 4), (128, 4), (8, 2), (100, 6), (256, 8), (4, 4)]
# bf16 loads are broken in Triton 3.9's CPU interpreter (test_act_and_mul.py); natively both dtypes
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,k", SHAPES)
@pytest.mark.parametrize("scaled", [False, True])
def test_route_topk_matches_torch(device, seed, E, k, dtype, scaled):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(37, E, generator=g) * 3).to(device, dtype)
    scale = (torch.rand(E, generator=g) + 0.5).to(device) if scaled else None
    w, ids = route_topk(logits, k, scale)
    ref_w, ref_ids = route_topk_reference(logits, k, scale)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (37, k)
    # distinct random logits (a tie in bf16 is possible: compare the chosen logits, then the ids elsewhere)
    torch.testing.assert_close(logits.float().gather(1, ids), logits.float().gather(1, ref_ids.to(device)),
                               rtol=0, atol=0, msg=lambda m: f"seed={seed}: {m}")
    distinct = (logits.float().gather(1, ref_ids.to(device)).diff(dim=1) != 0).all(dim=1)
    assert torch.equal(ids[distinct], ref_ids.to(device)[distinct]), f"seed={seed}"
    # a tie may pick another expert of the same logit, hence another scale: compare the softmax part on
    # every row, and the scaled weights where the choice is unique
    unscaled = (w / scale[ids], ref_w.to(device) / scale[ref_ids.to(device)]) if scaled else (w, ref_w.to(device))
    torch.testing.assert_close(*unscaled, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(w[distinct], ref_w.to(device)[distinct], rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("E,k", [(128, 8), (32, 4)])
def test_route_topk_is_gemma4_routing(device, seed, E, k):
    """Gemma 4's router as HF writes it: softmax over every expert, the top k probabilities renormalised
    to sum to 1, times `per_expert_scale`; the same experts and weights from the selected logits alone."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(19, E, generator=g) * 2).to(device)
    per_expert_scale = (torch.rand(E, generator=g) + 0.5).to(device)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ref_ids = torch.topk(probs, k, dim=-1)
    ref_w = top / top.sum(dim=-1, keepdim=True) * per_expert_scale[ref_ids]
    w, ids = route_topk(logits, k, per_expert_scale)
    assert torch.equal(ids, ref_ids), f"seed={seed}"
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")


def test_route_topk_ties_take_the_lower_expert(device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                           [float("-inf"), 0.0, float("-inf"), 0.0, 5.0, 0.0]], device=device)
    w, ids = route_topk(logits, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [4, 1, 3]]
    torch.testing.assert_close(w[0], torch.full((3,), 1 / 3, device=device))
    torch.testing.assert_close(w[1], torch.full((3,), 1 / 3, device=device))
    assert torch.isfinite(w).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter (numpy) on NaN rows
def test_route_topk_nan_logits_still_name_experts(device):
    """A broken row (NaN logits) must not send an out-of-range expert id to the MoE kernels."""
    logits = torch.tensor([[float("nan")] * 8, [0.0, float("nan"), 1.0, 2.0, -1.0, 0.5, 3.0, 0.1]], device=device)
    _, ids = route_topk(logits, 3)
    assert ((ids >= 0) & (ids < 8)).all(), ids


def test_route_topk_strided_rows_empty_and_bad_k(device):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 80, generator=g).to(device)
    logits = wide[:, 8:72]  # [5, 64], row stride 80
    w, ids = route_topk(logits, 4)
    ref_w, ref_ids = route_topk_reference(logits, 4)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    w0, ids0 = route_topk(wide[:0, :64], 4)
    assert w0.shape == ids0.shape == (0, 4)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, 65)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, 0)


@pytest.mark.parametrize("E,k,n_group,topk_group,norm", [(256, 8, 1, 1, True), (8, 2, 4, 2, True), (64, 6, 8, 3, False),
                                                         (32, 4, 4, 1, True)])
def test_route_grouped_matches_mimo_router(device, seed, E, k, n_group, topk_group, norm):
    """MiMo-V2's router (`GroupedTopKRouter`, its torch form on the CPU) against `route_grouped` on the same
    logits: the same experts in the same order, the same weights."""
    from swaserve.kernels.router_topk import route_grouped
    from swaserve.layers.moe import GroupedTopKRouter

    g = torch.Generator().manual_seed(seed)
    hidden = 16
    router = GroupedTopKRouter(hidden, E, k, n_group, topk_group, norm, 2.5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, hidden, generator=g))
        router.e_score_correction_bias.copy_(0.2 * torch.randn(E, generator=g))
    x = torch.randn(23, hidden, generator=g)
    ref_w, ref_ids = router(x)  # CPU: the torch form
    logits = torch.nn.functional.linear(x, router.weight.detach())  # as the router computes them
    w, ids = route_grouped(logits.to(device), router.e_score_correction_bias.detach().to(device), k, n_group,
                           topk_group, norm, 2.5)
    assert torch.equal(ids.cpu(), ref_ids), f"seed={seed}"
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")


def test_route_grouped_refuses_shapes_it_cannot_hold():
    from swaserve.kernels.router_topk import grouped_supported, route_grouped

    assert grouped_supported(256, 1) and grouped_supported(8, 4)
    assert not grouped_supported(96, 4) and not grouped_supported(8, 8) and not grouped_supported(12, 3)
    with pytest.raises(ValueError, match="power of two"):
        route_grouped(torch.zeros(2, 96), torch.zeros(96), 4, 4, 2, True, 1.0)
