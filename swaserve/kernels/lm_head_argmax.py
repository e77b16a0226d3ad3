"""Greedy decoding straight from the hidden states: `argmax(softcap(x @ W.T))` per row without
writing the logits.

The LM head is the largest GEMM of a small model's decode step (Gemma 3: 262,144 x hidden), and a
greedy step needs only each row's best token. The library GEMM writes `[M, vocab]` float32 logits
(268 MB at 256 rows) that an argmax then reads back. Here each program streams one vocab tile of
W, computes its `[BLOCK_M, BLOCK_N]` logits in registers and writes only each row's best value and
index in that tile; a second launch picks the best tile per row. Ties go to the lowest index, as
`torch.argmax` does. The soft-cap, when there is one, is applied before the comparison (it is
monotone, but it saturates in float32, so applying it keeps the same ties as the reference).

Rows never mix and the row tile is fixed per side of SMALL_M (not M's power of 2), so a row's token
does not depend on the other rows of its batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import dot_flags, jit_per_batch

SMALL_M = 64  # batches up to here take the weight-streaming tiles


@jit_per_batch("M")
def _tile_argmax_kernel(
    x, w, part_val, part_idx, M, N, K, stride_xm, stride_wn, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    # Row blocks vary fastest, so the programs that share a W tile run together and read it once
    # from HBM (the others hit L2).
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tile = tl.program_id(1)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        a = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b), input_precision=PREC)
    if HAS_SOFTCAP:
        y = acc / softcap
        # tanh via exp: saturates cleanly to +-1 and needs no libdevice (interpreter).
        acc = (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * softcap
    acc = tl.where(nmask[None, :], acc, float("-inf"))
    best = tl.max(acc, axis=1)
    arg = tl.argmax(acc, axis=1, tie_break_left=True)
    num_tiles = tl.num_programs(1)
    tl.store(part_val + rm * num_tiles + tile, best, mask=mmask)
    tl.store(part_idx + rm * num_tiles + tile, tile * BLOCK_N + arg, mask=mmask)


@triton.jit
def _combine_kernel(part_val, part_idx, out, num_tiles, BLOCK: tl.constexpr):
    """One program per row: the best tile (lowest on ties, since tiles ascend) and its index."""
    row = tl.program_id(0)
    base = row.to(tl.int64) * num_tiles
    best_val = tl.full([], float("-inf"), tl.float32)
    best_tile = tl.full([], 0, tl.int32)
    for t0 in range(0, num_tiles, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        v = tl.load(part_val + base + t, mask=t < num_tiles, other=float("-inf"))
        m = tl.max(v, axis=0)
        better = m > best_val  # strictly: an equal value in a later chunk has a higher index
        best_tile = tl.where(better, t0 + tl.argmax(v, axis=0, tie_break_left=True), best_tile)
        best_val = tl.where(better, m, best_val)
    tl.store(out + row, tl.load(part_idx + base + best_tile).to(tl.int64))


def launch_settings(M: int) -> dict[str, int]:
    """Tiles by batch size, from the H100 sweep (benchmarks/lm_head_sweep.py, bf16, vocab 262,144):
    up to SMALL_M rows the weight stream is the whole cost (1B: 201-207 us at 3.0 TB/s, against
    224-288 us for cuBLAS + argmax); above it the dot products start to count and 128-row tiles
    win (256 rows: 285 us against 443). The settings depend only on which side of SMALL_M the
    batch is, so a row's token changes with its batch only across that line."""
    if M <= SMALL_M:
        return {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 4}
    return {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 4}


def lm_head_argmax(
    x: torch.Tensor,  # [M, K], unit stride in K
    weight: torch.Tensor,  # [N, K] (vocab x hidden), unit stride in K
    softcap: float | None = None,
    combine_block: int = 1024,  # tiles per step of the combine kernel's loop
    **settings: int,  # block_m, block_n, block_k, num_warps, num_stages; default launch_settings(M)
) -> torch.Tensor:  # [M] int64
    """Each row's `argmax_j softcap(x @ W.T)[row, j]` (lowest j on ties), in two launches, with no
    logits in memory. `softcap=None` means no cap."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"hidden size {K} does not match the weight's {weight.shape[1]}")
    assert x.stride(1) == 1 and weight.stride(1) == 1, (x.stride(), weight.stride())
    out = torch.empty(M, dtype=torch.int64, device=x.device)
    if M == 0:
        return out
    cfg = {**launch_settings(M), **settings}
    if x.dtype.itemsize >= 4:  # 4-byte inputs: smaller tiles, two stages (shared memory)
        cfg.update(block_k=min(cfg["block_k"], 32), block_n=min(cfg["block_n"], 128),
                   num_stages=min(cfg["num_stages"], 2))
    num_tiles = triton.cdiv(N, cfg["block_n"])
    part_val = torch.empty(M, num_tiles, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(M, num_tiles, dtype=torch.int32, device=x.device)
    upcast, prec = dot_flags(x.dtype)
    _tile_argmax_kernel[(triton.cdiv(M, cfg["block_m"]), num_tiles)](
        x, weight, part_val, part_idx, M, N, K, x.stride(0), weight.stride(0),
        1.0 if softcap is None else float(softcap),
        HAS_SOFTCAP=softcap is not None, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"], UPCAST=upcast, PREC=prec, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    _combine_kernel[(M,)](part_val, part_idx, out, num_tiles, BLOCK=combine_block, num_warps=4)
    return out
