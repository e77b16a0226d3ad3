"""Fused MoE experts on the GPU: (token, slot) pairs sorted into per-expert blocks without a host sync
(`kernels.moe_align`), then two grouped GEMMs over those blocks (`kernels.moe_gemm`: dense, MXFP4 or
block-FP8 weights, optional biases, the gated activation fused into the first; MXFP4 at decode sizes
split over K), and a fixed-order combine (`fused_moe`).
Capturable in a CUDA graph: every buffer is sized from n. Under expert parallelism the weights hold a run
of the experts (`expert_start ..`): pairs routed outside it sort into no block and add nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import num_sms
from swaserve.kernels.fp8_gemm import quant_fp8_groups
from swaserve.kernels.moe_align import align_pairs
from swaserve.kernels.moe_gemm import MOE_ACTS, MXFP4_BLOCK_K, moe_gemm
from swaserve.kernels.moe_split import finish_split
from swaserve.kernels.pdl import pdl_enter, pdl_kwargs

W8A8_MIN_PAIRS = 128  # FP8 experts quantise their activations from this many pairs an expert on average
MX_SPLIT_PROGRAMS = 4  # programs an SM that an MXFP4 GEMM's split-K aims for (`_split_k`)


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, ids_ptr, out_ptr, valid_ptr, n_cols, stride_y, stride_part, stride_out,
    TOP_K: tl.constexpr, HAS_VALID: tl.constexpr, HAS_SPLIT: tl.constexpr, EXPERT_START: tl.constexpr,
    E: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out[t] = sum_j w[t, j] * y[t*K + j], j = 0..K-1 in order, in float32, over the slots whose
    expert these weights hold (`HAS_SPLIT`: `EXPERT_START .. + E - 1`, else all); 0 for an invalid row. Rows of y no pair
    wrote (an invalid row, another rank's expert) are never loaded. PARTS > 0: y is the down GEMM's float32
    split-K partials (`stride_part` apart), each pair's summed in order and rounded to out's dtype first,
    as the unsplit GEMM stores it."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + t + 0 * cols) != 0)  # broadcast load: a vector mask
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        wj = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        here = ok
        if HAS_SPLIT:
            ej = tl.load(ids_ptr + t * TOP_K + j + 0 * cols).to(tl.int32) - EXPERT_START  # broadcast load
            here = here & (ej >= 0) & (ej < E)
        y_j = y_ptr + (t * TOP_K + j) * stride_y + cols
        if PARTS:
            yj = tl.zeros([BLOCK], tl.float32)
            for s in tl.static_range(PARTS):
                yj += tl.load(y_j + s * stride_part, mask=here, other=0.0)
            yj = yj.to(out_ptr.dtype.element_ty).to(tl.float32)
        else:
            yj = tl.load(y_j, mask=here, other=0.0).to(tl.float32)
        acc += tl.where(here, wj * yj, 0.0)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def _split_k(programs: int, n_in: int, sms: int) -> int:
    """How many programs share each MXFP4 tile's inputs (a power of two): until the GEMM has
    `MX_SPLIT_PROGRAMS` programs an SM, each with at least two 128-input steps. At decode few programs
    each walked the whole K loop, converting codes between the loads and the MMA: gpt-oss-20b's experts
    at one token took 100.7 us on an H200 (11% of their bytes' bandwidth), 70.2 split 4 ways (2 or 8:
    72.2 / 71.4, so what is left is the conversion's work; `benchmarks/results/h200_mx_split_2026-11-29.log`)."""
    split = 1
    while programs * split < MX_SPLIT_PROGRAMS * sms and n_in >= 2 * split * 2 * MXFP4_BLOCK_K:
        split *= 2
    return split


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: the smallest tile that holds a typical expert's pairs (mean + 3 sd of a uniform
    routing) in one block, so a memory-bound call reads each hit expert's weights once (decode wastes
    tile rows, which costs no bandwidth); 64 once the calls are large enough to be compute-bound."""
    mean = num_pairs / num_experts
    need = mean + 3 * mean**0.5
    return 16 if need <= 16 else 32 if need <= 32 else 64


def fused_moe(
    x: torch.Tensor,  # [n, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H], gate rows first (dense or e4m3); MXFP4: [E, 2I, H/32, 16] uint8
    w_down: torch.Tensor,  # [E, H, I] (dense or e4m3); MXFP4: [E, H, I/32, 16] uint8 codes
    topk_weights: torch.Tensor,  # [n, k] float
    topk_ids: torch.Tensor,  # [n, k] int
    activation: str,  # "silu", "gelu", "gelu_tanh" or "swiglu_oai" (GPT-OSS: needs alpha and limit)
    row_valid: torch.Tensor | None = None,  # [n] bool
    block_m: int | None = None,
    batch_invariant: bool = False,  # one tiling for every n (deterministic mode)
    *,
    gate_up_scales: torch.Tensor | None = None,  # [E, 2I, H/32] uint8 e8m0 (MXFP4); FP8: [E, ceil(2I/sr), ceil(H/128)] fp32
    down_scales: torch.Tensor | None = None,  # [E, H, I/32] uint8 e8m0 (MXFP4); FP8: [E, ceil(H/128), ceil(I/128)] fp32
    gate_up_scale_rows: int = 128,  # FP8: w_gate_up rows per scale (1: a scale per row, `layers.fp8_linear`)
    act_fp8: bool | None = None,  # FP8: activations quantised (W8A8); None: when experts average W8A8_MIN_PAIRS pairs
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I], gate first
    down_bias: torch.Tensor | None = None,  # [E, H]
    alpha: float | None = None,  # swiglu_oai's sigmoid gain
    limit: float | None = None,  # swiglu_oai's clamp
    block_k: int | None = None,  # inputs per GEMM step (default: kernels.moe_gemm's per format)
    tuning: dict | None = None,  # benchmarks: moe_gemm's num_warps / num_stages / mx_mode / block_n for both GEMMs
    expert_start: int | None = None,  # expert parallelism: the weights hold global experts expert_start + 0..E-1
) -> torch.Tensor:  # [n, H], x's dtype
    """sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)) with e = ids[t, j], summed over j in order
    in float32; rows with `row_valid` False are 0. Four launches, none of them waiting on the host.
    `expert_start` (expert parallelism): ids are global and the weights hold experts `expert_start ..
    expert_start + E - 1`; the sum runs over the slots routed to those only (the others add nothing).
    Biases, when given, are added to each GEMM's output before the activation / the combine.
    `batch_invariant`: 64-row blocks and 64-column tiles whatever n (no K split either way), so a
    token's expert outputs do not depend on how many tokens share the call (and FP8 weights run
    weight-only). FP8 experts read bf16 activations (weight-only) while the calls are bandwidth-bound and
    quantise them per row and 128 inputs (W8A8, fp8 MMAs) once the experts' GEMMs are compute-bound."""
    if activation not in MOE_ACTS:
        raise ValueError(f"unsupported activation {activation!r}; supported: {sorted(MOE_ACTS)}")
    if activation == "swiglu_oai" and (alpha is None or limit is None):
        raise ValueError("the swiglu_oai activation needs alpha and limit")
    n, H = x.shape
    E, two_i = w_gate_up.shape[:2]
    inter = two_i // 2
    k = topk_ids.shape[1]
    assert w_down.shape[:2] == (E, H), (w_down.shape, E, H)
    assert topk_weights.shape == topk_ids.shape == (n, k), (topk_weights.shape, topk_ids.shape)
    if n == 0:
        return torch.zeros_like(x)
    bm = block_m or (64 if batch_invariant else _block_m(n * k, E))
    sorted_pairs, block_expert = align_pairs(topk_ids, E, bm, row_valid, expert_start=expert_start or 0)
    h = torch.empty(n * k, inter, dtype=x.dtype, device=x.device)  # [pairs, I]
    bn = 64
    bn1, active, sms = bn, min(E, n * k), num_sms(x.device)
    split1 = split2 = 1
    mx = w_gate_up.dtype == torch.uint8
    if mx and not batch_invariant:
        # MXFP4 at a few pairs an expert: whole 64-column tiles (the warpgroup MMA) and the inputs split
        # over more programs instead, each a few K steps (`_split_k`)
        split1 = _split_k(active * triton.cdiv(inter, bn), H, sms)
        split2 = _split_k(active * triton.cdiv(H, bn), inter, sms)
    else:
        # Few tokens (decode) hit few experts: narrower column tiles of the first GEMM keep enough programs
        # streaming the active experts' weights to fill the GPU (bs 1 on an H100: 8 experts, 88 -> 352).
        while not batch_invariant and bn1 > 16 and active * triton.cdiv(inter, bn1) < 2 * sms:
            bn1 //= 2
    act = {"alpha": 1.0 if alpha is None else alpha, "limit": 0.0 if limit is None else limit}
    tune = dict(tuning or {})
    if "block_n" in tune:
        bn = bn1 = tune.pop("block_n")
    if "split_k" in tune:
        split1 = split2 = tune.pop("split_k")
    fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    if not fp8 or batch_invariant:
        act_fp8 = False
    elif act_fp8 is None:
        act_fp8 = x.dtype != torch.float32 and n * k >= W8A8_MIN_PAIRS * E
    xa, xs = quant_fp8_groups(x) if act_fp8 else (x, None)
    parts = torch.empty(split1, n * k, two_i, dtype=torch.float32, device=x.device) if split1 > 1 else h
    moe_gemm(xa, w_gate_up, gate_up_scales, gate_up_bias, parts, sorted_pairs, block_expert, n * k, top_k=k,
             a_per_token=True, gated=True, activation=activation, **act, block_m=bm, block_n=bn1,
             block_k=block_k, scale_rows=gate_up_scale_rows, a_scales=xs, split_k=split1, **tune)
    if split1 > 1:
        finish_split(parts, h, gated=True, activation=activation, **act)
    # Rows of h no pair wrote (padded rows) quantise to garbage that no block reads.
    ha, hs = quant_fp8_groups(h) if act_fp8 else (h, None)
    if split2 > 1:  # the down GEMM's float32 partials: the combine sums them
        y = torch.empty(split2, n * k, H, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(n * k, H, dtype=x.dtype, device=x.device)  # [pairs, H]
    moe_gemm(ha, w_down, down_scales, down_bias, y, sorted_pairs, block_expert, n * k, top_k=k,
             a_per_token=False, gated=False, block_m=bm, block_n=bn, block_k=block_k, a_scales=hs, split_k=split2,
             **tune)
    held = {} if expert_start is None else {"topk_ids": topk_ids, "expert_start": expert_start, "num_experts": E}
    return combine(y, topk_weights, row_valid, x.dtype, **held)


def combine(
    y: torch.Tensor,  # [n*k, H]: pair t*k + j's expert output; or float32 split-K partials [parts, n*k, H]
    weights: torch.Tensor,  # [n, k] float32
    row_valid: torch.Tensor | None,  # [n] bool
    dtype: torch.dtype,
    block: int = 512,
    topk_ids: torch.Tensor | None = None,  # [n, k] int: with `num_experts`, slots outside the held run add 0
    expert_start: int = 0,
    num_experts: int | None = None,  # experts held (None: every slot's)
) -> torch.Tensor:  # [n, H] in dtype
    """Weighted sum over each token's k slots in slot order, in float32, in one launch: the order
    depends on nothing but k, so a row's sum never depends on n, the routing or the scheduling.
    Slots routed to experts outside `expert_start .. + num_experts - 1` are skipped (add exactly 0)."""
    n, k = weights.shape
    parts = y.shape[0] if y.dim() == 3 else 0
    assert y.shape[-2] == n * k and y.stride(-1) == 1 and (not parts or y.dtype == torch.float32), (y.shape, y.stride())
    weights = weights if weights.is_contiguous() else weights.contiguous()
    out = torch.empty(n, y.shape[-1], dtype=dtype, device=y.device)
    valid = row_valid.view(torch.uint8) if row_valid is not None else weights  # bool as bytes
    split = num_experts is not None
    ids = weights if not split else topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    _combine_kernel[(n, triton.cdiv(y.shape[-1], block))](
        y, weights, ids, out, valid, y.shape[-1], y.stride(-2), y.stride(0) if parts else 0, out.stride(0),
        TOP_K=k, HAS_VALID=row_valid is not None, HAS_SPLIT=split, EXPERT_START=expert_start, E=num_experts or 1,
        PARTS=parts, BLOCK=block, num_warps=4, **pdl_kwargs(y),
    )
    return out
