"""Batch-invariant GEMM (`bi_linear`): `x @ W.T (+ bias)` whose every output element is reduced in
the same order whatever M is, so a row never depends on how many other rows share the launch
(deterministic inference mode).

The order: one chain of MMAs along K, from zero, each step's product added by the MMA itself into
the accumulator (`_dot_chain`); no split of K, ever. A tile (block_m x block_n), its K step
(block_k) and which operand is the MMA's M side (`swap`) only decide which outputs a program owns
and how many MMAs one loop step issues, not the order in which an output's products are added, so
the tiling may follow M: narrow tiles with long K steps for decode-sized batches (enough programs and
bytes in flight to stream the weight), wide ones for prefill. On tensor cores this rests on a fact
measured per GPU (`benchmarks/bi_gemm_sweep.py`, and the kernel tests natively with
SWASERVE_KERNEL_TESTS_ON_GPU=1): a chained MMA's rounding depends neither on the instruction's shape
or operand order nor on how the chain is cut into loop steps, so every tiling gives bitwise equal rows.

An earlier form cut K into chunks summed from zero and added in order, so decode could split the
chunks over programs; on the H100 the second accumulator and the restarted pipelines cost 20-75%
against one chain (benchmarks/results/h100_bi_gemm_chunk_ablation.log), and one chain with narrow
tiles streams the weight as fast.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import _dot_chain, dot_flags, interpret_mode, jit_per_batch, num_sms


class Tiling(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap: bool = False  # weight rows on the MMA's M side, x rows on its N (W_tile @ x_tile^T, transposed)


# Per band of M (rows up to the key), tilings from the widest to the narrowest, by the K step of the
# narrow tiles (256 for K >= 2048, else 128); a launch takes the first whose tiles fill half the SMs,
# else the narrowest. Past 256 rows, BIG tiles give way to WIDE ones where WIDE's last wave is fuller
# (`_waves`). Measured on the H100 (benchmarks/results/h100_bi_gemm_sweep*.log):
# - decode-sized batches stream the weight fastest with narrow tiles, long K steps and deep pipelines;
# - up to 16 rows with the operands swapped (4B at one row 94 -> 84 us a layer, `_swapped_tiles.log`);
# - 6-8 stages from 65 rows, and at one row for narrow weights (1B at 256 rows 56.4 -> 49.5 us a layer,
#   4B 143 -> 121, 4B at 128 rows 105 -> 98: `_deep_stages.log`, `_rule_deep_stages.log`);
# - prefill with 256 x 128 tiles (1B at 2048 rows 266 -> 225 us a layer, 4B 746 -> 706).
# The tiling never changes a result's bits, only its speed.
WIDE = Tiling(128, 128, 64, 4, 4)
BIG = Tiling(256, 128, 64, 8, 3)
_LADDERS = {
    kx: (
        (16, (Tiling(16, 128, 128, 4, 4, True), Tiling(16, 64, 128, 4, 8, True), Tiling(16, 32, 256, 2, 6))),
        (64, (Tiling(64, 128, 64, 4, 4), Tiling(64, 32, kx, 4, 4), Tiling(64, 16, 256, 4, 4))),
        (128, (Tiling(64, 128, 64, 4, 4), Tiling(64, 64, 128, 4, 6, True), Tiling(64, 32, kx, 4, 4))),
        (256, (Tiling(128, 128, 64, 4, 6), Tiling(64, 128, 64, 4, 8), Tiling(64, 64, 128, 4, 6, True),
               Tiling(64, 32, kx, 4, 4))),
        (None, (BIG, WIDE, Tiling(64, 128, 64, 4, 4), Tiling(64, 64, 128, 4, 4))),
    )
    for kx in (128, 256)
}
INTERPRET_BLOCK_K = 32  # the interpreter sums each K step apart (`_dot_chain`): one step for every tiling


def tiling(m: int, n: int, k: int, dtype: torch.dtype, sms: int) -> Tiling:
    """The launch settings for an [m, k] x [n, k]^T product on a GPU with `sms` SMs (any tiling gives
    the same bits)."""
    return _tiling(m, n, k, dtype, sms, interpret_mode())


def _tiles(t: Tiling, m: int, n: int) -> int:
    return triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)


def _waves(t: Tiling, m: int, n: int, sms: int) -> float:
    """How full the launch's waves are on average (one program per SM at these tile sizes)."""
    tiles = _tiles(t, m, n)
    return tiles / (triton.cdiv(tiles, sms) * sms)


@functools.lru_cache(maxsize=4096)
def _tiling(m: int, n: int, k: int, dtype: torch.dtype, sms: int, interpret: bool) -> Tiling:
    ladder = next(ts for top, ts in _LADDERS[256 if k >= 2048 else 128] if top is None or m <= top)
    fills = [t for t in ladder if _tiles(t, m, n) >= sms // 2]
    t = fills[0] if fills else ladder[-1]
    if t == BIG and _waves(WIDE, m, n, sms) > _waves(BIG, m, n, sms) + 0.05:
        t = WIDE  # e.g. 160 BIG tiles on 132 SMs: a second wave of 28
    return _fit(t, dtype, interpret)


def _fit(t: Tiling, dtype: torch.dtype, interpret: bool) -> Tiling:
    if interpret:
        return t._replace(block_k=INTERPRET_BLOCK_K)
    if dtype.itemsize >= 4:  # fp32 (no tensor cores): quarter-size K steps, two stages (shared memory)
        return Tiling(min(t.block_m, 64), min(t.block_n, 64), min(t.block_k, 32), 4, 2, t.swap)
    return t


# Only M changes from batch to batch. The row strides stay specialised (16-divisible in every real
# shape): unspecialised, the H100 build loaded x without cp.async and stored element by element
# (gate/up at 8192 rows 1136 against 484 us; benchmarks/results/h100_bi_gemm_specialisation.log).
@jit_per_batch("M")
def _bi_matmul_kernel(
    x, w, bias, out, M, N, K, stride_xm, stride_wn, stride_wk, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr,
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
    a_rows = x + tl.where(mmask, rm, 0).to(tl.int64)[:, None] * stride_xm
    w_rows = w + tl.where(nmask, rn, 0).to(tl.int64)[:, None] * stride_wn
    if SWAP:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(a_rows + rk[None, :])
            b = tl.load(w_rows + rk[None, :].to(tl.int64) * stride_wk)
        else:  # past K: zeros, whose products add exact zeros to the chain
            kmask = rk < K
            a = tl.load(a_rows + rk[None, :], mask=kmask[None, :], other=0.0)
            b = tl.load(w_rows + rk[None, :].to(tl.int64) * stride_wk, mask=kmask[None, :], other=0.0)
        # b is [BLOCK_N, BLOCK_K], K innermost: vector loads from an output-major weight.
        if SWAP:
            acc_t = _dot_chain(b, tl.trans(a), acc_t, UPCAST, PREC, ROWWISE)
        else:
            acc = _dot_chain(a, tl.trans(b), acc, UPCAST, PREC, ROWWISE)
    if SWAP:
        acc = tl.trans(acc_t)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


_COMPILED: set[tuple] = set()
WARM_ROWS = 16384  # precompile the launch variants of every M up to this the first time a weight is seen


def _precompile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None) -> None:
    """Compile, on the first launch for a weight's shape and layout, every tiling a later batch may
    launch (one row each), so no batch size meets a JIT compile while serving (the engine's warm-up
    forward is that first launch). Not inside a CUDA-graph capture."""
    key = (x.device, x.dtype, out_dtype, weight.shape, weight.stride(), bias is not None)
    if key in _COMPILED or torch.cuda.is_current_stream_capturing():
        return
    _COMPILED.add(key)
    N, K = weight.shape
    sms, interp = num_sms(x.device), interpret_mode()
    # The uncached rule: WARM_ROWS sizes would evict the cache entries of the batches actually served.
    for t in {_tiling.__wrapped__(m, N, K, x.dtype, sms, interp) for m in range(1, WARM_ROWS + 1)}:
        bi_linear(x[:1], weight, bias, out_dtype, tile=t)


def bi_linear(
    x: torch.Tensor,  # [M, K], unit stride in K
    weight: torch.Tensor,  # [N, K] any strides (an input-major [K, N] weight's .t() works)
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # default x's dtype (float32: the LM head's logits)
    tile: Tiling | None = None,  # None: `tiling(...)`; any tiling gives the same bits (tests, sweeps)
) -> torch.Tensor:  # [M, N]
    """`x @ weight.T + bias`, every output element reduced in the same order whatever M is."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and x.stride(1) == 1, (x.shape, x.stride(), weight.shape)
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return out
    if tile is None and x.is_cuda:
        _precompile(x, weight, bias, out_dtype)
    t = tiling(M, N, K, x.dtype, num_sms(x.device)) if tile is None else _fit(tile, x.dtype, interpret_mode())
    upcast, prec = dot_flags(x.dtype)
    has_bias = bias is not None
    grid = (triton.cdiv(M, t.block_m) * triton.cdiv(N, t.block_n),)
    _bi_matmul_kernel[grid](
        x, weight, bias if has_bias else x, out, M, N, K, x.stride(0), weight.stride(0), weight.stride(1),
        out.stride(0), HAS_BIAS=has_bias, EVEN_K=K % t.block_k == 0, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=8, SWAP=t.swap, UPCAST=upcast, PREC=prec,
        ROWWISE=interpret_mode(),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out
