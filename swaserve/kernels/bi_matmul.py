"""Batch-invariant GEMM (`bi_linear`): `x @ W.T (+ bias)` whose every output element is reduced in
the same order whatever M is, so a row never depends on how many other rows share the launch
(deterministic inference mode).

The order: K is cut into chunks whose count and length depend only on the weight's shape and the
GPU (`num_chunks`, never on M); each chunk's product is accumulated from zero in steps of BLOCK_K
(fixed per dtype), and the chunk sums are added in chunk order into a float32 total. A tile only
decides which outputs a program owns, not how one output is summed, so the tiling may follow M
(`tiling`): narrow tiles with the chunks split over programs for decode-sized batches (enough
programs to stream the weight; a second launch adds their float32 partials in chunk order) and
wide tiles with the chunks looped in one program for prefill. On tensor cores this rests on one
fact measured per GPU (`benchmarks/bi_gemm_sweep.py`, tests/gpu): an MMA's rounding does not
depend on the instruction's M/N shape, so every tiling of the table gives bitwise equal rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import _dot_rows, dot_flags, interpret_mode, jit_per_batch, num_sms


class Tiling(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# By rows M: decode-sized batches stream the weight through narrow tiles, prefill chunks reuse it
# through wide ones (measured on the H100: benchmarks/results/h100_bi_gemm_sweep.log).
TILINGS: tuple[tuple[int, Tiling], ...] = (
    (64, Tiling(64, 64, 4, 4)),
    (256, Tiling(64, 128, 4, 4)),
    (1 << 62, Tiling(128, 128, 8, 3)),
)
CHUNK_TILE_N = 64  # the decode tiling's width: chunks are counted so that its programs fill the GPU
MIN_CHUNK = 512  # keys of K per chunk at least: a wide-tile program loops CHUNK / BLOCK_K steps per chunk


def block_k(dtype: torch.dtype) -> int:
    return 32 if dtype.itemsize >= 4 else 64  # fp32 tiles take twice the shared memory


def tiling(m: int, dtype: torch.dtype) -> Tiling:
    for rows, t in TILINGS:
        if m <= rows:
            break
    if dtype.itemsize >= 4:  # fp32: half the stages (shared memory), and at most 64x128 tiles
        t = Tiling(min(t.block_m, 64), t.block_n, 4, 2)
    return t


def num_chunks(n: int, k: int, sms: int, bk: int = 64) -> tuple[int, int]:
    """(chunks, chunk length) for an [n, k] weight: about two programs per SM for a decode-sized
    batch when the chunks are split; a function of the weight shape and the GPU only."""
    tiles = triton.cdiv(n, CHUNK_TILE_N)
    want = max(1, min(triton.cdiv(2 * sms, tiles), k // MIN_CHUNK))
    chunk = triton.cdiv(triton.cdiv(k, want), bk) * bk
    return triton.cdiv(k, chunk), chunk


@jit_per_batch("M", "stride_xm", "stride_om", "stride_pm")
def _bi_matmul_kernel(
    x, w, bias, out, part, M, N, K, CHUNK, NUM_CHUNKS,
    stride_xm, stride_wn, stride_wk, stride_om, stride_ps, stride_pm,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    if SPLIT:
        c_lo = tl.program_id(2)
        c_hi = c_lo + 1
    else:
        c_lo = 0
        c_hi = NUM_CHUNKS
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c in range(c_lo, c_hi):
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # every chunk from zero: the split form's partial
        k_end = tl.minimum(K, (c + 1) * CHUNK)
        for k0 in range(c * CHUNK, k_end, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < k_end
            a = tl.load(x + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0)
            # [BLOCK_N, BLOCK_K] with K innermost: vector loads from an output-major weight.
            b = tl.load(w + rn[:, None].to(tl.int64) * stride_wn + rk[None, :].to(tl.int64) * stride_wk,
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc += _dot_rows(a, tl.trans(b), UPCAST, PREC, ROWWISE)
        total += acc
    if SPLIT:
        tl.store(part + tl.program_id(2) * stride_ps + rm[:, None].to(tl.int64) * stride_pm + rn[None, :], total,
                 mask=mmask[:, None] & nmask[None, :])
    else:
        _store(total, bias, out, rm, rn, mmask, nmask, stride_om, HAS_BIAS)


@triton.jit
def _store(total, bias, out, rm, rn, mmask, nmask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        total += tl.load(bias + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :], total.to(out.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@jit_per_batch("M", "stride_om", "stride_pm")
def _sum_chunks_kernel(part, bias, out, M, N, NUM_CHUNKS, stride_ps, stride_pm, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c in range(0, NUM_CHUNKS):  # chunk order, as the one-program form adds them
        total += tl.load(part + c * stride_ps + rm[:, None].to(tl.int64) * stride_pm + rn[None, :],
                         mask=mmask[:, None] & nmask[None, :], other=0.0)
    _store(total, bias, out, rm, rn, mmask, nmask, stride_om, HAS_BIAS)


def bi_linear(
    x: torch.Tensor,  # [M, K], unit stride in K
    weight: torch.Tensor,  # [N, K] any strides (an input-major [K, N] weight's .t() works)
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # default x's dtype (float32: the LM head's logits)
    split: bool | None = None,  # None: split programs when the row tiles alone leave SMs idle
    tile: Tiling | None = None,  # None: `tiling(M)`; any tiling gives the same bits (tests, sweeps)
) -> torch.Tensor:  # [M, N]
    """`x @ weight.T + bias`, every output element reduced in the same order whatever M is."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and x.stride(1) == 1, (x.shape, x.stride(), weight.shape)
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return out
    bk = block_k(x.dtype)
    sms = num_sms(x.device)
    chunks, chunk = num_chunks(N, K, sms, bk)
    t = tile or tiling(M, x.dtype)
    grid_mn = (triton.cdiv(M, t.block_m), triton.cdiv(N, t.block_n))
    if split is None:
        split = chunks > 1 and grid_mn[0] * grid_mn[1] < sms
    upcast, prec = dot_flags(x.dtype)
    has_bias = bias is not None
    part = torch.empty(chunks if split else 1, M if split else 1, N, dtype=torch.float32, device=x.device)
    _bi_matmul_kernel[(*grid_mn, chunks if split else 1)](
        x, weight, bias if has_bias else x, out, part, M, N, K, chunk, chunks,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0), part.stride(0), part.stride(1),
        SPLIT=split, HAS_BIAS=has_bias, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=bk,
        UPCAST=upcast, PREC=prec, ROWWISE=interpret_mode(), num_warps=t.num_warps, num_stages=t.num_stages,
    )
    if split:
        _sum_chunks_kernel[(triton.cdiv(M, 16), triton.cdiv(N, 128))](
            part, bias if has_bias else x, out, M, N, chunks, part.stride(0), part.stride(1), out.stride(0),
            HAS_BIAS=has_bias, BLOCK_M=16, BLOCK_N=128, num_warps=4)
    return out
