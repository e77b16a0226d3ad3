"""Fused MoE experts on the GPU: (token, slot) pairs sorted into per-expert blocks without a host sync
(`align_pairs`), then two grouped GEMMs over those blocks (`kernels.moe_gemm`: dense, MXFP4 or block-FP8 weights,
optional biases, the gated activation fused into the first), and a fixed-order combine (`fused_moe`).
Capturable in a CUDA graph: every buffer is sized from n. Under expert parallelism the weights hold a run
of the experts (`expert_start ..`): pairs routed outside it sort into no block and add nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import jit_per_batch, num_sms
from swaserve.kernels.fp8_gemm import quant_fp8_groups
from swaserve.kernels.moe_gemm import MOE_ACTS, moe_gemm
from swaserve.kernels.pdl import pdl_enter, pdl_kwargs

# Up to this many pairs (n * k) one program sorts them (`_align_kernel`: one launch, the decode case);
# above it the sort is ~30 torch ops, whose launches are small next to a prefill's GEMMs.
ALIGN_KERNEL_MAX_PAIRS = 2048
# The kernel sorts a power of two of pairs, at least this many: few compiled sizes (256 .. 2048).
_ALIGN_MIN_PAIRS = 256
_ALIGN_CHUNK = 512  # padding slots (or unused blocks) one step of the align kernel writes

W8A8_MIN_PAIRS = 128  # FP8 experts quantise their activations from this many pairs an expert on average


def num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks every routing of `num_pairs` pairs fits in: each expert's run is padded by fewer than
    `block_m` rows, and each used block holds at least one pair."""
    return min(triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m), num_pairs)


def align_pairs(
    topk_ids: torch.Tensor,  # [n, k] int: expert of each (token, slot)
    num_experts: int,
    block_m: int,
    row_valid: torch.Tensor | None = None,  # [n] bool: False rows route nothing
    use_kernel: bool | None = None,  # None: the one-program kernel when n*k <= ALIGN_KERNEL_MAX_PAIRS
    expert_start: int = 0,  # expert parallelism: the weights hold global experts expert_start + 0..E-1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the n*k pairs by expert into blocks of `block_m` rows, one expert per block.

    Returns `sorted_pairs` `[blocks * block_m]` int32 (pair index t*k + j, or the sentinel n*k in
    padding) and `block_expert` `[blocks]` int32 (-1: an unused block), `blocks = num_blocks(...)`.
    Used blocks come first, experts in ascending order (local index `topk_ids - expert_start`), each
    expert's pairs in token order; pairs whose expert is outside `expert_start .. + E - 1` (another
    rank's) are left out like invalid rows'. Both paths give identical results and use only device
    work sized from n: no host sync."""
    n, k = topk_ids.shape
    N, E, dev = n * k, num_experts, topk_ids.device
    blocks = num_blocks(N, E, block_m)
    if use_kernel if use_kernel is not None else N <= ALIGN_KERNEL_MAX_PAIRS:
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
        block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
        valid = row_valid.view(torch.uint8) if row_valid is not None else ids  # bool as bytes
        pairs = max(triton.next_power_of_2(N), _ALIGN_MIN_PAIRS)
        _align_kernel[(1,)](
            ids, valid, sorted_pairs, block_expert, N, blocks,
            TOP_K=k, E=E, E_PAD=triton.next_power_of_2(E), HAS_VALID=row_valid is not None,
            EXPERT_START=expert_start, BLOCK_M=block_m, PAIRS=pairs, CHUNK=_ALIGN_CHUNK,
            num_warps=4 if pairs <= 1024 else 8, **pdl_kwargs(ids),
        )
        return sorted_pairs, block_expert
    ids = topk_ids.reshape(-1).long()
    if expert_start:
        ids = ids - expert_start
    if row_valid is not None:
        ids = torch.where(row_valid[:, None].expand(n, k).reshape(-1), ids, E)  # sentinel expert E sorts last
    ids = torch.where((ids >= 0) & (ids < E), ids, E)  # another rank's expert: the sentinel too
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))[:E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E] padded end of each expert's run
    starts = ends - padded
    order = torch.sort(ids, stable=True).indices  # pairs grouped by expert, token order inside
    sorted_ids = ids[order]
    first = counts.cumsum(0) - counts  # [E] start of each expert's run in `order`
    real = sorted_ids < E
    e = sorted_ids.clamp(max=E - 1)
    rank = torch.arange(N, device=dev) - first[e]
    spare = blocks * block_m
    dest = torch.where(real, starts[e] + rank, spare)  # sentinel pairs (invalid rows) go to the spare slot
    sorted_pairs = torch.full((spare + 1,), N, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    be = torch.searchsorted(ends, torch.arange(blocks, device=dev) * block_m, right=True)
    block_expert = torch.where(be < E, be, -1).to(torch.int32)
    return sorted_pairs[:-1], block_expert


@jit_per_batch("num_pairs", "blocks")
def _align_kernel(
    ids_ptr, valid_ptr, sorted_pairs, block_expert, num_pairs, blocks,
    TOP_K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, HAS_VALID: tl.constexpr,
    EXPERT_START: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """`align_pairs` in one program over all `PAIRS >= num_pairs` pairs at once. A histogram counts
    each expert's pairs and lays the padded runs out; one sort of the keys `expert * PAIRS + pair`
    (left-out pairs after every expert) groups the pairs by expert in token order, so the pair at
    sorted position i goes to its run's start plus i minus its expert's first sorted position. The
    first slot of every used block holds a pair, which names the block's expert. Real slots and
    padding slots are disjoint sets, so no store overwrites another."""
    pdl_enter(USE_PDL)
    p = tl.arange(0, PAIRS)
    e = _pair_expert(ids_ptr, valid_ptr, p, num_pairs, TOP_K, HAS_VALID, EXPERT_START, E)
    counts = tl.histogram(e, E_PAD, mask=e >= 0)  # [E_PAD]; experts >= E count nothing
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E_PAD] padded end of each run
    starts = ends - padded
    first = tl.cumsum(counts, axis=0) - counts  # [E_PAD] each expert's first position in sorted order
    key = tl.sort(tl.where(e >= 0, e, E_PAD) * PAIRS + p)
    se, sp = key // PAIRS, key % PAIRS  # expert and pair at each sorted position
    placed = se < E_PAD
    dest = p + tl.gather(starts - first, tl.where(placed, se, 0), 0)
    tl.store(sorted_pairs + dest, sp, mask=placed)
    tl.store(block_expert + dest // BLOCK_M, se, mask=placed & (dest % BLOCK_M == 0))
    # Padding: each run's tail [start + count, end), then every slot (and block) after the last run.
    tail = starts[:, None] + counts[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [E_PAD, BLOCK_M]
    tl.store(sorted_pairs + tail, tl.full([E_PAD, BLOCK_M], 0, tl.int32) + num_pairs,
             mask=tail < ends[:, None])
    total = tl.sum(padded, axis=0)
    for s0 in range(total, blocks * BLOCK_M, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_pairs + s, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=s < blocks * BLOCK_M)
    for b0 in range(total // BLOCK_M, blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        tl.store(block_expert + b, tl.full([CHUNK], -1, tl.int32), mask=b < blocks)


@triton.jit
def _pair_expert(ids_ptr, valid_ptr, p, num_pairs, TOP_K: tl.constexpr, HAS_VALID: tl.constexpr,
                 EXPERT_START: tl.constexpr, E: tl.constexpr):
    """Local expert of pairs `p` [CHUNK]; -1 past the end, for invalid rows and for experts outside
    `EXPERT_START .. EXPERT_START + E - 1` (another rank's)."""
    ok = p < num_pairs
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + p // TOP_K, mask=ok, other=0) != 0)
    e = tl.load(ids_ptr + p, mask=ok, other=-1).to(tl.int32) - EXPERT_START
    return tl.where(ok & (e >= 0) & (e < E), e, -1)


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, ids_ptr, out_ptr, valid_ptr, n_cols, stride_y, stride_out,
    TOP_K: tl.constexpr, HAS_VALID: tl.constexpr, HAS_SPLIT: tl.constexpr, EXPERT_START: tl.constexpr,
    E: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out[t] = sum_j w[t, j] * y[t*K + j], j = 0..K-1 in order, in float32, over the slots whose
    expert these weights hold (`HAS_SPLIT`: `EXPERT_START .. + E - 1`, else all); 0 for an invalid row. Rows of y no pair
    wrote (an invalid row, another rank's expert) are never loaded."""
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
        yj = tl.load(y_ptr + (t * TOP_K + j) * stride_y + cols, mask=here, other=0.0).to(tl.float32)
        acc += tl.where(here, wj * yj, 0.0)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


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
    y = torch.empty(n * k, H, dtype=x.dtype, device=x.device)  # [pairs, H]
    bn = 64
    # Few tokens (decode) hit few experts: narrower column tiles of the first GEMM keep enough programs
    # streaming the active experts' weights to fill the GPU (bs 1 on an H100: 8 experts, 88 -> 352).
    bn1, active = bn, min(E, n * k)
    while not batch_invariant and bn1 > 16 and active * triton.cdiv(inter, bn1) < 2 * num_sms(x.device):
        bn1 //= 2
    act = {"alpha": 1.0 if alpha is None else alpha, "limit": 0.0 if limit is None else limit}
    tune = dict(tuning or {})
    if "block_n" in tune:
        bn = bn1 = tune.pop("block_n")
    fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    if not fp8 or batch_invariant:
        act_fp8 = False
    elif act_fp8 is None:
        act_fp8 = x.dtype != torch.float32 and n * k >= W8A8_MIN_PAIRS * E
    xa, xs = quant_fp8_groups(x) if act_fp8 else (x, None)
    moe_gemm(xa, w_gate_up, gate_up_scales, gate_up_bias, h, sorted_pairs, block_expert, n * k, top_k=k,
             a_per_token=True, gated=True, activation=activation, **act, block_m=bm, block_n=bn1,
             block_k=block_k, scale_rows=gate_up_scale_rows, a_scales=xs, **tune)
    # Rows of h no pair wrote (padded rows) quantise to garbage that no block reads.
    ha, hs = quant_fp8_groups(h) if act_fp8 else (h, None)
    moe_gemm(ha, w_down, down_scales, down_bias, y, sorted_pairs, block_expert, n * k, top_k=k,
             a_per_token=False, gated=False, block_m=bm, block_n=bn, block_k=block_k, a_scales=hs, **tune)
    held = {} if expert_start is None else {"topk_ids": topk_ids, "expert_start": expert_start, "num_experts": E}
    return combine(y, topk_weights, row_valid, x.dtype, **held)


def combine(
    y: torch.Tensor,  # [n*k, H]: pair t*k + j's expert output
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
    assert y.shape[0] == n * k and y.stride(1) == 1, (y.shape, y.stride())
    weights = weights if weights.is_contiguous() else weights.contiguous()
    out = torch.empty(n, y.shape[1], dtype=dtype, device=y.device)
    valid = row_valid.view(torch.uint8) if row_valid is not None else weights  # bool as bytes
    split = num_experts is not None
    ids = weights if not split else topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    _combine_kernel[(n, triton.cdiv(y.shape[1], block))](
        y, weights, ids, out, valid, y.shape[1], y.stride(0), out.stride(0),
        TOP_K=k, HAS_VALID=row_valid is not None, HAS_SPLIT=split, EXPERT_START=expert_start, E=num_experts or 1,
        BLOCK=block, num_warps=4, **pdl_kwargs(y),
    )
    return out
