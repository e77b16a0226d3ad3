"""An MoE router's selection in one launch: each token's top `k` experts by logit and their weights, a
softmax over the selected logits, optionally times a per-expert scale.

That covers GPT-OSS's router (top k of the logits, then a softmax over them) and Gemma 4's (a softmax
over all experts, the top k probabilities renormalised to sum to 1, times `per_expert_scale`): the
full softmax's denominator cancels in the renormalisation, and the probabilities order the experts as
the logits do. In torch that is six to nine launches a layer (softmax, `topk`'s two kernels, the sum,
the division, the scale's gather and product: ~19 us a layer at one token on an H200, 0.6 ms of a
Gemma-4-26B-A4B decode step); here one program per token reads its E logits once.

The routers take it on CUDA with SWASERVE_FUSED_ROUTER=1 (`layers.moe.fused_router`; opt-in until a GPU
run confirms it). Ties: among equal logits the lower expert index is taken first (`torch.topk` leaves
the order of equal values unspecified). Rows never mix, so the result depends on nothing but the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 1024  # one program holds a row's logits


@triton.jit
def _route_topk_kernel(logits, scale, weights, ids, E, stride_l, stride_w, stride_i,
                       K: tl.constexpr, K_P: tl.constexpr, BLOCK_E: tl.constexpr, HAS_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits + row * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    slot = tl.arange(0, K_P)
    top = tl.full([K_P], float("-inf"), tl.float32)
    top_ids = tl.zeros([K_P], tl.int32)
    for j in tl.static_range(K):  # k rounds of: the largest logit left, the lowest index among equals
        best = tl.max(x, 0)
        pick = tl.minimum(tl.min(tl.where(x == best, e, BLOCK_E), 0), E - 1)  # (NaN logits: still an expert)
        top = tl.where(slot == j, best, top)
        top_ids = tl.where(slot == j, pick, top_ids)
        x = tl.where(e == pick, float("-inf"), x)
    p = tl.exp(top - tl.max(top, 0))  # the first slot holds the maximum; padded slots give 0
    w = p / tl.sum(p, 0)
    if HAS_SCALE:
        w = w * tl.load(scale + top_ids, mask=slot < K, other=0.0).to(tl.float32)
    keep = slot < K
    tl.store(weights + row * stride_w + slot, w, mask=keep)
    tl.store(ids + row * stride_i + slot, top_ids.to(tl.int64), mask=keep)


def route_topk(
    logits: torch.Tensor,  # [n, E], any float dtype (read as float32)
    k: int,
    expert_scale: torch.Tensor | None = None,  # [E]: multiplies each selected expert's weight
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[n, k]` float32, expert ids `[n, k]` int64) of each row's top `k` logits, the weights a
    softmax over those k logits (times `expert_scale[id]`); slots in descending logit order."""
    n, E = logits.shape
    if not 0 < k <= E:
        raise ValueError(f"top_k {k} must be in 1..{E} (the number of experts)")
    if E > MAX_EXPERTS:
        raise ValueError(f"{E} experts: one program holds at most {MAX_EXPERTS} logits")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    if n:
        _route_topk_kernel[(n,)](
            logits, expert_scale if expert_scale is not None else logits, weights, ids, E,
            logits.stride(0), weights.stride(0), ids.stride(0),
            K=k, K_P=triton.next_power_of_2(k), BLOCK_E=triton.next_power_of_2(E),
            HAS_SCALE=expert_scale is not None, num_warps=1 if E <= 256 else 4,
        )
    return weights, ids


def route_topk_reference(logits: torch.Tensor, k: int,
                         expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk` in torch: the top k of the logits and a float32 softmax over them."""
    top, ids = torch.topk(logits.float(), k, dim=-1)
    w = torch.softmax(top, dim=-1)
    return (w if expert_scale is None else w * expert_scale[ids].float()), ids
