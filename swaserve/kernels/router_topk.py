"""An MoE router's selection in one launch: each token's top `k` experts by logit and their weights, a
softmax over the selected logits, optionally times a per-expert scale.

That covers GPT-OSS's router (top k of the logits, then a softmax over them) and Gemma 4's (a softmax
over all experts, the top k probabilities renormalised to sum to 1, times `per_expert_scale`): the
full softmax's denominator cancels in the renormalisation, and the probabilities order the experts as
the logits do. In torch that is six to nine launches a layer (softmax, `topk`'s two kernels, the sum,
the division, the scale's gather and product: ~19 us a layer at one token on an H200, 0.6 ms of a
Gemma-4-26B-A4B decode step); here one program per token reads its E logits once. `route_grouped` does
the same for MiMo-V2's (DeepSeek-V3's) grouped sigmoid selection with its correction bias.

The routers take it on CUDA unless SWASERVE_FUSED_ROUTER=0 (`layers.moe.fused_router`). Ties: among
equal logits the lower expert index is taken first (`torch.topk` leaves the order of equal values
unspecified). Rows never mix, so the result depends on nothing but the row.
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
    logits, weights, ids = _operands(logits, k)
    if n:
        _route_topk_kernel[(n,)](
            logits, expert_scale if expert_scale is not None else logits, weights, ids, E,
            logits.stride(0), weights.stride(0), ids.stride(0),
            K=k, K_P=triton.next_power_of_2(k), BLOCK_E=triton.next_power_of_2(E),
            HAS_SCALE=expert_scale is not None, num_warps=1 if E <= 256 else 4,
        )
    return weights, ids


@triton.jit
def _route_grouped_kernel(logits, bias, weights, ids, stride_l, stride_w, stride_i, scale,
                          E: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr, G: tl.constexpr,
                          TOPK_G: tl.constexpr, NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E)
    s = tl.sigmoid(tl.load(logits + row * stride_l + e).to(tl.float32))
    b = s + tl.load(bias + e).to(tl.float32)
    if G > 1:  # keep the TOPK_G groups whose two best biased scores sum highest
        bg = tl.reshape(b, [G, E // G])
        col = tl.arange(0, E // G)
        m1 = tl.max(bg, 1)
        p1 = tl.min(tl.where(bg == m1[:, None], col[None, :], E), 1)
        score = m1 + tl.max(tl.where(col[None, :] == p1[:, None], float("-inf"), bg), 1)  # [G]
        grp = tl.arange(0, G)
        keep = grp < 0
        for _ in tl.static_range(TOPK_G):
            best = tl.max(score, 0)
            pick = tl.minimum(tl.min(tl.where(score == best, grp, G), 0), G - 1)
            keep = keep | (grp == pick)
            score = tl.where(grp == pick, float("-inf"), score)
        b = tl.reshape(tl.where(keep[:, None], bg, float("-inf")), [E])
    slot = tl.arange(0, K_P)
    w = tl.zeros([K_P], tl.float32)
    top_ids = tl.zeros([K_P], tl.int32)
    for j in tl.static_range(K):  # the top k biased scores; the weights are the unbiased ones
        best = tl.max(b, 0)
        pick = tl.minimum(tl.min(tl.where(b == best, e, E), 0), E - 1)
        w = tl.where(slot == j, tl.sum(tl.where(e == pick, s, 0.0), 0), w)
        top_ids = tl.where(slot == j, pick, top_ids)
        b = tl.where(e == pick, float("-inf"), b)
    if NORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    keep_slot = slot < K
    tl.store(weights + row * stride_w + slot, w * scale, mask=keep_slot)
    tl.store(ids + row * stride_i + slot, top_ids.to(tl.int64), mask=keep_slot)


def grouped_supported(num_experts: int, n_group: int) -> bool:
    """Whether `route_grouped` takes this router shape (powers of two, groups of 2 or more)."""
    E = num_experts
    return (E & (E - 1) == 0 and n_group & (n_group - 1) == 0 and E % n_group == 0 and E // n_group >= 2
            and E <= MAX_EXPERTS)


def route_grouped(
    logits: torch.Tensor,  # [n, E] float32 router logits
    bias: torch.Tensor,  # [E] e_score_correction_bias
    k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MiMo-V2's (DeepSeek-V3's) selection in one launch, as `layers.moe.GroupedTopKRouter` computes it:
    sigmoid scores, the top k of `scores + bias` within the `topk_group` best of `n_group` groups (a
    group's score: its two best biased scores), weights the unbiased scores (renormalised with
    `norm_topk_prob`, + 1e-20) times `scale`. E and n_group powers of two."""
    n, E = logits.shape
    if not grouped_supported(E, n_group):
        raise ValueError(f"{E} experts in {n_group} groups: a power of two each, groups of 2 or more")
    logits, weights, ids = _operands(logits, k)
    if n:
        _route_grouped_kernel[(n,)](
            logits, bias, weights, ids, logits.stride(0), weights.stride(0), ids.stride(0), float(scale),
            E=E, K=k, K_P=triton.next_power_of_2(k), G=n_group, TOPK_G=topk_group, NORM=norm_topk_prob,
            num_warps=1 if E <= 256 else 4,
        )
    return weights, ids


def _operands(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits with unit column stride, and the outputs: weights `[n, k]` float32, ids `[n, k]` int64."""
    n, dev = logits.shape[0], logits.device
    return (logits if logits.stride(1) == 1 else logits.contiguous(),
            torch.empty(n, k, dtype=torch.float32, device=dev), torch.empty(n, k, dtype=torch.int64, device=dev))


def route_topk_reference(logits: torch.Tensor, k: int,
                         expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk` in torch: the top k of the logits and a float32 softmax over them."""
    top, ids = torch.topk(logits.float(), k, dim=-1)
    w = torch.softmax(top, dim=-1)
    return (w if expert_scale is None else w * expert_scale[ids].float()), ids
