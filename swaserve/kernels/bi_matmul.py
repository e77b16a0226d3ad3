"""Batch-invariant GEMM (`bi_linear`): `x @ W.T (+ bias)` whose every output element is reduced in
the same order whatever M is, so a row never depends on how many other rows share the launch
(deterministic inference mode).

The order: K is cut into chunks whose count and length depend only on the weight's shape and the
GPU (`num_chunks`, never on M); each chunk's product is accumulated from zero in steps of BLOCK_K
(fixed per dtype), and the chunk sums are added in chunk order into a float32 total. A tile only
decides which outputs a program owns, not how one output is summed, so the tiling may follow M
(`tiling`): narrow tiles with the chunks split over programs for decode-sized batches (enough
programs to stream the weight; the last of a tile's programs adds their float32 partials in chunk
order) and wide tiles with the chunks looped in one program for prefill. On tensor cores this rests
on a fact measured per GPU (`benchmarks/bi_gemm_sweep.py`; the kernel tests run natively with
SWASERVE_KERNEL_TESTS_ON_GPU=1): an MMA's rounding does not depend on the instruction's M/N shape,
so every tiling gives bitwise equal rows (H100: 0 of 1,368 tiling x split x M cases differ).
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


# Tilings from the widest (most reuse of each loaded tile) to the narrowest (most programs);
# measured on the H100 (benchmarks/results/h100_bi_gemm_sweep.log): 128x128 pays only for wide
# weights (the LM head, gate/up), and a launch wants at least one program per SM.
WIDE = Tiling(128, 128, 4, 4)
TILINGS: tuple[Tiling, ...] = (Tiling(64, 128, 4, 4), Tiling(64, 64, 4, 4), Tiling(16, 64, 4, 4), Tiling(16, 32, 4, 6))
WIDE_N = 8192  # output columns from which WIDE leads the list
CHUNK_TILE_N = 32  # the decode tiling's width: chunks are counted so that its programs fill the GPU
MIN_CHUNK = 1024  # keys of K per chunk at least: a wide-tile program loops CHUNK / BLOCK_K steps per chunk


def block_k(dtype: torch.dtype) -> int:
    return 32 if dtype.itemsize >= 4 else 64  # fp32 tiles take twice the shared memory


def tiling(m: int, n: int, chunks: int, sms: int, dtype: torch.dtype) -> Tiling:
    """The widest tiling of the list whose programs (split over the chunks where its tiles alone
    leave SMs idle) fill the GPU; the narrowest for decode-sized batches (M <= 16) and when none does."""
    t = TILINGS[-1]
    if m > 16:
        for cand in ((WIDE,) if n >= WIDE_N else ()) + TILINGS:
            tiles = triton.cdiv(m, cand.block_m) * triton.cdiv(n, cand.block_n)
            if (tiles if tiles >= sms else tiles * chunks) >= sms:
                t = cand
                break
    if dtype.itemsize >= 4:  # fp32: half the stages (shared memory), and at most 64x128 tiles
        t = Tiling(min(t.block_m, 64), t.block_n, 4, 2)
    return t


def plan(m: int, n: int, chunks: int, sms: int, dtype: torch.dtype, tile: Tiling | None = None) -> tuple[Tiling, bool]:
    """(tiling, split) of a launch (`tile` or the rule's): chunks split over programs when the tiles
    alone leave SMs idle."""
    t = tile or tiling(m, n, chunks, sms, dtype)
    return t, chunks > 1 and triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n) < sms


def num_chunks(n: int, k: int, sms: int, bk: int = 64) -> tuple[int, int]:
    """(chunks, chunk length) for an [n, k] weight: about two programs per SM for a decode-sized
    batch when the chunks are split, chunks of at least MIN_CHUNK keys; a function of the weight
    shape and the GPU only."""
    tiles = triton.cdiv(n, CHUNK_TILE_N)
    want = max(1, min(triton.cdiv(2 * sms, tiles), k // MIN_CHUNK))
    chunk = triton.cdiv(triton.cdiv(k, want), bk) * bk
    return triton.cdiv(k, chunk), chunk


@jit_per_batch("M", "stride_xm", "stride_om", "stride_pm")
def _bi_matmul_kernel(
    x, w, bias, out, part, counters, M, N, K, CHUNK, NUM_CHUNKS,
    stride_xm, stride_wn, stride_wk, stride_om, stride_ps, stride_pm,
    SPLIT: tl.constexpr, ONE_CHUNK: tl.constexpr, FUSED_SUM: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    X_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr,
):
    # Tiles in groups of GROUP_M row tiles per column tile: a group's programs share weight tiles in L2.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % rows_in_group
    pid_n = (pid % group) // rows_in_group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    # Rows and columns past the edge read row/column 0 (results masked at the store): loads need no
    # mask along M or N, and none along K when K is a multiple of BLOCK_K, so they vectorise.
    stride_xm = tl.multiple_of(stride_xm, X_ALIGN)
    a_rows = x + tl.where(mmask, rm, 0).to(tl.int64)[:, None] * stride_xm
    w_rows = w + tl.where(nmask, rn, 0).to(tl.int64)[:, None] * stride_wn
    if SPLIT:  # one chunk per program
        k_lo = tl.program_id(1) * CHUNK
        k_hi = tl.minimum(K, k_lo + CHUNK)
    else:
        k_lo = 0
        k_hi = K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if ONE_CHUNK:  # a split program's chunk, or a weight of one chunk: one accumulator
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc = _step(acc, a_rows, w_rows, k0, k_hi, stride_wk, EVEN_K, BLOCK_K, UPCAST, PREC, ROWWISE)
        total = acc
    else:  # every chunk from zero, added in chunk order into the total
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for c in range(NUM_CHUNKS):
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            c_hi = tl.minimum(K, (c + 1) * CHUNK)
            for k0 in range(c * CHUNK, c_hi, BLOCK_K):
                acc = _step(acc, a_rows, w_rows, k0, c_hi, stride_wk, EVEN_K, BLOCK_K, UPCAST, PREC, ROWWISE)
            total += acc
    if SPLIT:
        tile = pid_m * tiles_n + pid_n
        tl.store(part + tl.program_id(1) * stride_ps + rm[:, None].to(tl.int64) * stride_pm + rn[None, :], total,
                 mask=mmask[:, None] & nmask[None, :])
        if FUSED_SUM:
            # The last of a tile's chunk programs to finish adds the partials, so no second launch.
            # Its release (after the barrier) publishes this program's stores, the last one's
            # acquire makes every chunk's visible, and it resets the counter for the next launch.
            tl.debug_barrier()
            if tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu") == NUM_CHUNKS - 1:
                tl.store(counters + tile, 0)
                total = _sum_partials(part, rm, rn, mmask, nmask, NUM_CHUNKS, stride_ps, stride_pm, BLOCK_M, BLOCK_N)
                _store(total, bias, out, rm, rn, mmask, nmask, stride_om, HAS_BIAS)
    else:
        _store(total, bias, out, rm, rn, mmask, nmask, stride_om, HAS_BIAS)


@triton.jit
def _step(acc, a_rows, w_rows, k0, k_hi, stride_wk, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
          UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr):
    """acc + the product of one BLOCK_K slice of K."""
    rk = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        a = tl.load(a_rows + rk[None, :])
        b = tl.load(w_rows + rk[None, :].to(tl.int64) * stride_wk)
    else:
        kmask = rk < k_hi
        a = tl.load(a_rows + rk[None, :], mask=kmask[None, :], other=0.0)
        b = tl.load(w_rows + rk[None, :].to(tl.int64) * stride_wk, mask=kmask[None, :], other=0.0)
    # b is [BLOCK_N, BLOCK_K], K innermost: vector loads from an output-major weight.
    return acc + _dot_rows(a, tl.trans(b), UPCAST, PREC, ROWWISE)


@triton.jit
def _sum_partials(part, rm, rn, mmask, nmask, NUM_CHUNKS, stride_ps, stride_pm, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The chunks' float32 partials of a tile added in chunk order, as the one-program form adds them
    (read past L1, which is not coherent across SMs)."""
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c in range(NUM_CHUNKS):
        total += tl.load(part + c * stride_ps + rm[:, None].to(tl.int64) * stride_pm + rn[None, :],
                         mask=mmask[:, None] & nmask[None, :], other=0.0, cache_modifier=".cg")
    return total


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
    total = _sum_partials(part, rm, rn, mmask, nmask, NUM_CHUNKS, stride_ps, stride_pm, BLOCK_M, BLOCK_N)
    _store(total, bias, out, rm, rn, mmask, nmask, stride_om, HAS_BIAS)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
MAX_SPLIT_TILES = 4096  # counters per device: a split launch has fewer tiles than the GPU has SMs


def split_counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed tile counters for the fused chunk sum (every launch leaves them zero; one
    stream at a time uses them), allocated on first use outside CUDA-graph capture; None inside
    a capture that finds none yet (that launch sums in a second kernel)."""
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[device]


_COMPILED: set[tuple] = set()
WARM_ROWS = 16384  # precompile the launch variants of every M up to this the first time a weight is seen


def _launch_variants(m_max: int, n: int, chunks: int, sms: int, dtype: torch.dtype) -> set[tuple[Tiling, bool]]:
    """(tiling, split) of every M in 1..m_max: a few, as the tiling widens with M."""
    return {plan(m, n, chunks, sms, dtype) for m in range(1, m_max + 1)}


def _precompile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                chunks: int, sms: int) -> None:
    """Compile, on the first launch for a weight's shape and layout, every variant a later batch may
    launch (one row each), so no batch size meets a JIT compile while serving (the engine's warm-up
    forward is that first launch). Not inside a CUDA-graph capture."""
    key = (x.device, x.dtype, out_dtype, weight.shape, weight.stride(), bias is not None)
    if key in _COMPILED or torch.cuda.is_current_stream_capturing():
        return
    _COMPILED.add(key)
    for t, split in _launch_variants(WARM_ROWS, weight.shape[0], chunks, sms, x.dtype):
        bi_linear(x[:1], weight, bias, out_dtype, split=split, tile=t)


def bi_linear(
    x: torch.Tensor,  # [M, K], unit stride in K
    weight: torch.Tensor,  # [N, K] any strides (an input-major [K, N] weight's .t() works)
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # default x's dtype (float32: the LM head's logits)
    split: bool | None = None,  # None: split programs when the row tiles alone leave SMs idle
    tile: Tiling | None = None,  # None: `tiling(...)`; any tiling gives the same bits (tests, sweeps)
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
    if tile is None and x.is_cuda:
        _precompile(x, weight, bias, out_dtype, chunks, sms)
    t, auto_split = plan(M, N, chunks, sms, x.dtype, tile)
    split = chunks > 1 and (auto_split if split is None else split)
    tiles = triton.cdiv(M, t.block_m) * triton.cdiv(N, t.block_n)
    counters = split_counters(x.device) if split and tiles <= MAX_SPLIT_TILES else None
    upcast, prec = dot_flags(x.dtype)
    has_bias = bias is not None
    # 16-byte aligned rows (every real shape): the row stride is promised to the compiler.
    x_align = 16 // x.itemsize if x.stride(0) % (16 // x.itemsize) == 0 and x.data_ptr() % 16 == 0 else 1
    # Float32 partials only when split (otherwise `out` stands in for the unused pointers).
    part = torch.empty(chunks, M, N, dtype=torch.float32, device=x.device) if split else out
    _bi_matmul_kernel[(tiles, chunks if split else 1)](
        x, weight, bias if has_bias else x, out, part, counters if counters is not None else out, M, N, K,
        chunk, chunks, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0), part.stride(0),
        part.stride(1 if split else 0), SPLIT=split, ONE_CHUNK=split or chunks == 1, FUSED_SUM=counters is not None,
        HAS_BIAS=has_bias, EVEN_K=K % bk == 0, X_ALIGN=x_align, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=bk, GROUP_M=8, UPCAST=upcast, PREC=prec, ROWWISE=interpret_mode(),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    if split and counters is None:
        _sum_chunks_kernel[(triton.cdiv(M, 16), triton.cdiv(N, 128))](
            part, bias if has_bias else x, out, M, N, chunks, part.stride(0), part.stride(1), out.stride(0),
            HAS_BIAS=has_bias, BLOCK_M=16, BLOCK_N=128, num_warps=4)
    return out
