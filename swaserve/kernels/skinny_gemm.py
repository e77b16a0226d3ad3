"""Weight-streaming GEMM for decode-sized batches: `x @ W.T` with few rows (M <= 64), split over K.

At decode the projections read every weight byte once for a handful of rows, so the GEMM is a
bandwidth problem: it needs enough programs in flight to saturate HBM. A narrow output (o_proj,
down_proj: N = hidden) gives cuBLAS few tiles, and it splits K with a separate reduce kernel. Here
each program streams one (N-block, K-range) tile of W and writes float32 partial sums
`[splits, M, N]`; the kernel that reads the result next (the residual add + norm) sums them, so
the reduce costs no launch. `skinny_gated_gemm` is the gate/up form: each program streams matching
gate and up rows and writes `act(gate) * up`, so the activation costs no launch either.
Rows never mix: a row's result depends only on its own input, the split count and the tile, never
on M, so padded graph batches and eager agree bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from swaserve.kernels.activation import ACTS, gated_act
from swaserve.kernels.common import _dot, dot_flags, jit_per_batch
from swaserve.kernels.pdl import pdl_kwargs, pdl_release, pdl_wait

MAX_M = 64  # the row tile; larger batches use the library GEMM


def use_skinny(x: torch.Tensor) -> bool:
    """Whether the layers take the skinny GEMMs for input `x`: opt-in (SWASERVE_SKINNY_GEMM=1),
    CUDA, 2-D, 1..MAX_M rows. Off by default: each GEMM is faster than cuBLAS alone on an H100, but
    not inside a decode step. Without PDL the step got slower (Gemma 3 1B at bs 1 1.54 -> 1.76 ms);
    with PDL and the first weight tile loaded before the wait it is level with the cuBLAS step
    (1.55 ms at bs 1, 2.00 vs 2.02 ms at bs 64; benchmarks/NOTES.md, session 6)."""
    return (os.environ.get("SWASERVE_SKINNY_GEMM") == "1" and x.is_cuda and x.dim() == 2
            and 0 < x.shape[0] <= MAX_M)


@jit_per_batch("M", "stride_os")
def _skinny_gemm_kernel(
    x, w, out, M, N, K, stride_xm, stride_wn, stride_os, stride_om,
    K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    w_rows = w + rn[:, None].to(tl.int64) * stride_wn
    k_lo = split * K_PER_SPLIT
    # The first weight tile is loaded before the PDL wait (weights are read-only during a step).
    rk = k_lo + tl.arange(0, BLOCK_K)
    b = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & (rk[None, :] < K), other=0.0)
    pdl_wait(USE_PDL)
    a = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & (rk[None, :] < K), other=0.0)
    acc = _dot(a, tl.trans(b), UPCAST, PREC)
    for k0 in range(BLOCK_K, K_PER_SPLIT, BLOCK_K):  # constant trip count: the loads pipeline
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        a = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += _dot(a, tl.trans(b), UPCAST, PREC)
    tl.store(out + split * stride_os + rm[:, None] * stride_om + rn[None, :],
             acc.to(out.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@jit_per_batch("M")
def _skinny_gated_kernel(
    x, w, out, M, I, K, stride_xm, stride_wn, stride_om,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_release(USE_PDL)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < I
    gate_rows = w + rn[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + I * stride_wn
    # The first gate and up tiles are loaded before the PDL wait (weights are read-only).
    rk = tl.arange(0, BLOCK_K)
    wmask = nmask[:, None] & (rk[None, :] < K)
    bg = tl.load(gate_rows + rk[None, :], mask=wmask, other=0.0)
    bu = tl.load(up_rows + rk[None, :], mask=wmask, other=0.0)
    pdl_wait(USE_PDL)
    a = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & (rk[None, :] < K), other=0.0)
    acc_g = _dot(a, tl.trans(bg), UPCAST, PREC)
    acc_u = _dot(a, tl.trans(bu), UPCAST, PREC)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        a = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wmask = nmask[:, None] & kmask[None, :]
        bg = tl.load(gate_rows + rk[None, :], mask=wmask, other=0.0)
        bu = tl.load(up_rows + rk[None, :], mask=wmask, other=0.0)
        acc_g += _dot(a, tl.trans(bg), UPCAST, PREC)
        acc_u += _dot(a, tl.trans(bu), UPCAST, PREC)
    ty = out.dtype.element_ty
    # gate and up rounded to the dtype first, as the unfused GEMM's output would be.
    y = gated_act(acc_g.to(ty).to(tl.float32), acc_u.to(ty).to(tl.float32), ty, ACT)
    tl.store(out + rm[:, None] * stride_om + rn[None, :], y, mask=mmask[:, None] & nmask[None, :])


def _tile_k(dtype: torch.dtype, block_k: int, num_stages: int) -> tuple[int, int]:
    """4-byte inputs get half the K tile and two stages, so the pipeline fits in shared memory."""
    if dtype.itemsize >= 4:
        return min(block_k, 64), min(num_stages, 2)
    return block_k, num_stages


def skinny_gemm_splits(N: int, K: int, num_sms: int, block_n: int = 64, block_k: int = 128,
                       max_splits: int = 8) -> int:
    """Splits of K so that N-blocks x splits gives about two programs per SM (none when the N-blocks
    alone fill the SMs); a function of the weight shape only (never of M), so every batch size
    rounds the same way. At most `max_splits`: the reader holds every part of a row in registers,
    and at 15 parts a 64-row add+norm spilled (measured 1B bs 64 step 2.14 -> 2.25 ms)."""
    nblocks = triton.cdiv(N, block_n)
    if nblocks >= num_sms:
        return 1
    want = max(1, triton.cdiv(2 * num_sms, nblocks))
    return max(1, min(want, max_splits, triton.cdiv(K, block_k)))


def skinny_gemm(
    x: torch.Tensor,  # [M, K], unit stride in K (rows in blocks of block_m)
    weight: torch.Tensor,  # [N, K], unit stride in K (a Linear's weight)
    splits: int,
    *,
    block_n: int = 64,
    block_k: int | None = None,
    block_m: int = MAX_M,
    num_warps: int = 4,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`splits == 1`: `x @ W.T` in x's dtype, `[M, N]`. `splits > 1`: float32 partial sums
    `[splits, M, N]` whose sum over dim 0 is `x @ W.T` (K-ranges are whole `block_k` multiples;
    trailing splits past K hold zeros). The row tile is fixed (`block_m`, not M's power of 2) so a
    row's rounding cannot depend on how many rows came with it."""
    M, K = x.shape
    N = weight.shape[0]
    block_k, num_stages = _tile_k(x.dtype, block_k or 128, num_stages or 3)
    assert weight.shape[1] == K and x.stride(1) == 1 and weight.stride(1) == 1, (x.shape, weight.shape)
    k_per_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    if out is None:
        shape = (M, N) if splits == 1 else (splits, M, N)
        out = torch.empty(shape, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    if M == 0:
        return out
    o3 = out.unsqueeze(0) if splits == 1 else out
    assert o3.shape == (splits, M, N) and o3.stride(2) == 1, o3.shape
    upcast, prec = dot_flags(x.dtype)
    _skinny_gemm_kernel[(triton.cdiv(N, block_n), splits, triton.cdiv(M, block_m))](
        x, weight, o3, M, N, K, x.stride(0), weight.stride(0), o3.stride(0), o3.stride(1),
        K_PER_SPLIT=k_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=upcast, PREC=prec, num_warps=num_warps, num_stages=num_stages, **pdl_kwargs(x),
    )
    return out


def skinny_gated_gemm(
    x: torch.Tensor,  # [M, K], M <= block_m, unit stride in K
    weight: torch.Tensor,  # [2I, K]: gate rows [0, I), up rows [I, 2I) (MergedLinear's gate_up)
    activation: str,  # "silu", "gelu" or "gelu_tanh"
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    block_m: int = MAX_M,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:  # [M, I] in x's dtype
    """`act(x @ Wg.T) * (x @ Wu.T)` in one launch, rounded as the GEMM + `act_and_mul` would be.

    Default tiles from the H100 sweep (benchmarks/skinny_gemm_sweep.py, bf16): 64 x 128 at
    Gemma 3 1B's K = 1152 (14.4 us vs 16.7 for cuBLAS + act_and_mul at 64 rows), 32 x 64 at 4B's
    K = 2560 (42.3 vs 44.7; 64 x 128 took 47.0 there). That sweep ran 4 pipeline stages; the
    default is 3 since the first tile is loaded ahead of the loop (4 no longer fit at K = 1152),
    and the sweep has not been rerun."""
    M, K = x.shape
    wide = K > 2048
    block_n = block_n or (32 if wide else 64)
    block_k, num_stages = _tile_k(x.dtype, block_k or (64 if wide else 128), num_stages or 3)
    if activation not in ACTS:
        raise ValueError(f"unsupported activation {activation!r}; supported: {sorted(ACTS)}")
    if M > block_m:
        raise ValueError(f"skinny_gated_gemm takes at most {block_m} rows, got {M}")
    assert weight.shape[0] % 2 == 0 and weight.shape[1] == K and x.stride(1) == 1 and weight.stride(1) == 1
    inter = weight.shape[0] // 2
    out = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    upcast, prec = dot_flags(x.dtype)
    _skinny_gated_kernel[(triton.cdiv(inter, block_n),)](
        x, weight, out, M, inter, K, x.stride(0), weight.stride(0), out.stride(0),
        ACT=ACTS[activation], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=upcast, PREC=prec, num_warps=num_warps, num_stages=num_stages, **pdl_kwargs(x),
    )
    return out
