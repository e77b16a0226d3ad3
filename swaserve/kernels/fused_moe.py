"""Fused MoE experts on the GPU: (token, slot) pairs sorted into per-expert blocks without a host sync
(`align_pairs`), then two grouped GEMMs over those blocks, the gated activation fused into the first,
and a fixed-order combine (`fused_moe`). Capturable in a CUDA graph: every buffer is sized from n."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.activation import ACTS, gated_act
from swaserve.kernels.common import _dot, dot_flags


def align_pairs(
    topk_ids: torch.Tensor,  # [n, k] int: expert of each (token, slot)
    num_experts: int,
    block_m: int,
    row_valid: torch.Tensor | None = None,  # [n] bool: False rows route nothing
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the n*k pairs by expert into blocks of `block_m` rows, one expert per block.

    Returns `sorted_pairs` `[max_blocks * block_m]` int32 (pair index t*k + j, or the sentinel n*k
    in padding) and `block_expert` `[max_blocks]` int32 (-1: an unused block), where
    `max_blocks = ceil((n*k + E*(block_m-1)) / block_m)` bounds every routing. Expert e's pairs are
    in token order. Only device ops whose sizes depend on n, never on the routing: no host sync."""
    n, k = topk_ids.shape
    N, E, dev = n * k, num_experts, topk_ids.device
    ids = topk_ids.reshape(-1).long()
    if row_valid is not None:
        ids = torch.where(row_valid[:, None].expand(n, k).reshape(-1), ids, E)  # sentinel expert E sorts last
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
    dest = torch.where(real, starts[e] + rank, -1)
    max_blocks = triton.cdiv(N + E * (block_m - 1), block_m)
    sorted_pairs = torch.full((max_blocks * block_m + 1,), N, dtype=torch.int32, device=dev)
    # Sentinel pairs (invalid rows) go to the spare last element, which is cut off below.
    sorted_pairs.scatter_(0, torch.where(dest >= 0, dest, max_blocks * block_m), order.to(torch.int32))
    block_start = torch.arange(max_blocks, device=dev) * block_m
    be = torch.searchsorted(ends, block_start, right=True)  # first expert whose padded run ends after it
    block_expert = torch.where(be < E, be, -1).to(torch.int32)
    return sorted_pairs[:-1], block_expert


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_pairs, block_expert,
    num_pairs, n_out, n_in, stride_am, stride_we, stride_wn, stride_om,
    A_PER_TOKEN: tl.constexpr, TOP_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """out[pair, cols] = a[row(pair)] @ w[e, cols].T for the block's expert e; with GATED, w holds gate
    rows [0, n_out) and up rows [n_out, 2 n_out) and out = act(gate) * up. row(pair) is the token
    (pair // TOP_K) when A_PER_TOKEN, else the pair itself."""
    b = tl.program_id(0)
    e = tl.load(block_expert + b).to(tl.int64)
    if e < 0:
        return
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs + rows).to(tl.int64)
    row_ok = pair < num_pairs
    a_row = pair // TOP_K if A_PER_TOKEN else pair
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_row[:, None] * stride_am
    w_base = w_ptr + e * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k_ok = (k0 + ks) < n_in
        a = tl.load(a_base + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += _dot(a, w, UPCAST, PREC)
        if GATED:
            wu = tl.load(w_base + n_out * stride_wn + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :],
                         other=0.0)
            acc_up += _dot(a, wu, UPCAST, PREC)
    ty = out_ptr.dtype.element_ty
    if GATED:
        # Rounded as F.linear's outputs and the torch activation would be.
        y = gated_act(acc.to(ty).to(tl.float32), acc_up.to(ty).to(tl.float32), ty, ACT)
    else:
        y = acc.to(ty)
    tl.store(out_ptr + pair[:, None] * stride_om + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


_SMS: dict[torch.device, int] = {}


def _num_sms(device: torch.device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return _SMS[device]


def _block_m(num_pairs: int, num_experts: int) -> int:
    # Decode: a few pairs per expert, so a small block wastes the least; prefill: fuller tiles.
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def fused_moe(
    x: torch.Tensor,  # [n, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H], gate rows first
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [n, k] float32
    topk_ids: torch.Tensor,  # [n, k] int
    activation: str,  # "silu", "gelu" or "gelu_tanh"
    row_valid: torch.Tensor | None = None,  # [n] bool
    block_m: int | None = None,
) -> torch.Tensor:  # [n, H], x's dtype
    """sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)) with e = ids[t, j], summed over j in order
    in float32; rows with `row_valid` False are 0."""
    if activation not in ACTS:
        raise ValueError(f"unsupported activation {activation!r}; supported: {sorted(ACTS)}")
    n, H = x.shape
    E, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    assert w_gate_up.shape == (E, 2 * inter, H) and w_down.shape == (E, H, inter), (w_gate_up.shape, w_down.shape)
    assert x.stride(1) == 1 and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1
    if n == 0:
        return torch.zeros_like(x)
    bm = block_m or _block_m(n * k, E)
    sorted_pairs, block_expert = align_pairs(topk_ids, E, bm, row_valid)
    blocks = block_expert.numel()
    h = torch.empty(n * k, inter, dtype=x.dtype, device=x.device)  # [pairs, I]
    y = torch.empty(n * k, H, dtype=x.dtype, device=x.device)  # [pairs, H]
    bn, bk = 64, 64
    warps = 4
    upcast, prec = dot_flags(x.dtype)
    # Few tokens (decode) hit few experts: narrower column tiles of the first GEMM keep enough programs
    # streaming the active experts' weights to fill the GPU (bs 1 on an H100: 8 experts, 88 -> 352).
    bn1, active = bn, min(E, n * k)
    while bn1 > 16 and active * triton.cdiv(inter, bn1) < 2 * _num_sms(x.device):
        bn1 //= 2
    _moe_gemm_kernel[(blocks, triton.cdiv(inter, bn1))](
        x, w_gate_up, h, sorted_pairs, block_expert, n * k, inter, H,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0),
        A_PER_TOKEN=True, TOP_K=k, GATED=True, ACT=ACTS[activation], BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk,
        UPCAST=upcast, PREC=prec, num_warps=warps,
    )
    _moe_gemm_kernel[(blocks, triton.cdiv(H, bn))](
        h, w_down, y, sorted_pairs, block_expert, n * k, H, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        A_PER_TOKEN=False, TOP_K=k, GATED=False, ACT=0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        UPCAST=upcast, PREC=prec, num_warps=warps,
    )
    out = combine(y.view(n, k, H), topk_weights)
    if row_valid is not None:
        out = torch.where(row_valid[:, None], out, 0.0)  # their rows of y were never written
    return out.to(x.dtype)


def combine(y: torch.Tensor, weights: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """`[n, k, H]` expert outputs, `[n, k]` weights -> `[n, H]` float32: one reduction over the k slots,
    whose order depends on k and H only (not on n or the routing), so a row's sum is reproducible.
    In blocks of `rows` tokens: the float32 products of a long prefill would need n*k*H*4 bytes."""
    out = torch.empty(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for i in range(0, y.shape[0], rows):
        out[i : i + rows] = (y[i : i + rows].float() * weights[i : i + rows, :, None]).sum(1)
    return out
