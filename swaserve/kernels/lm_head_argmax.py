"""Greedy decoding and temperature sampling straight from the hidden states, without writing the
logits: `argmax(softcap(x @ W.T))` per row, or `argmax(softcap(x @ W.T) / T + Gumbel noise)`, an exact
sample of `softmax(logits / T)` (the Gumbel-max trick).

The LM head is the largest GEMM of a small model's decode step (Gemma 3: 262,144 x hidden), and a
greedy step needs only each row's best token. The library GEMM writes `[M, vocab]` float32 logits
(268 MB at 256 rows) that an argmax then reads back. Here each program streams one vocab tile of
W, computes its `[BLOCK_M, BLOCK_N]` logits in registers and writes only each row's best value and
index in that tile; a second launch picks the best tile per row. Ties go to the lowest index, as
`torch.argmax` does. The soft-cap, when there is one, is applied before the comparison (it is
monotone, but it saturates in float32, so applying it keeps the same ties as the reference).

The noise comes from a counter-based hash (splitmix64) of the row's 63-bit seed and the token id, so a
row's draw depends only on its seed, never on the batch or the tiling; `gumbel_noise_ref` is the
same noise in NumPy. Uniforms carry 32 bits, fine near 0, so the exponential behind the Gumbel
variate is accurate where it matters (small values, large noise); the largest noise a draw can
produce is ~22.9, so a token more than ~23 nats (times T) below the best one is never drawn, where
its exact probability is below 1e-10.

Rows never mix and the row tile is fixed (per side of SMALL_M for greedy, one for sampling), never
M's power of 2, so a row's token does not depend on the other rows of its batch.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from swaserve.kernels.common import _dot_chain, dot_flags, jit_per_batch

SMALL_M = 64  # batches up to here take the weight-streaming tiles


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


@triton.jit
def _gumbel(seed, col):
    """Gumbel(0, 1) noise for uint64 `seed` and token id `col` (broadcastable): splitmix64 of
    seed + (col + 1) * golden; the top 32 bits as u in (0, 1); E = -log(1 - u) ~ Exp(1) (a series
    for small u, where 1 - u would round); noise = -log(E)."""
    z = seed + (col.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    u = ((z >> 32).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    e = tl.where(u < 1e-3, u + 0.5 * u * u, -tl.log(1.0 - u))
    return -tl.log(e)


def gumbel_noise_ref(seeds: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """`_gumbel` in NumPy (the tests' reference): `[rows, cols]` float32 for int64 `seeds` `[rows]`
    and token ids `cols`."""
    with np.errstate(over="ignore"):
        col = cols.astype(np.uint64)[None, :] + np.uint64(1)
        z = seeds.astype(np.uint64)[:, None] + col * np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(32)).astype(np.float32) + np.float32(0.5)) * np.float32(2.3283064365386963e-10)
    e = np.where(u < 1e-3, u + np.float32(0.5) * u * u, -np.log(np.float32(1.0) - u))
    return (-np.log(e)).astype(np.float32)


@jit_per_batch("M")
def _tile_argmax_kernel(
    x, w, part_val, part_idx, inv_temp, seeds, allowed, allowed_index, M, N, K, stride_xm, stride_wn,
    stride_am, softcap,
    HAS_SOFTCAP: tl.constexpr, NOISE: tl.constexpr, MASKED: tl.constexpr, MASK_INDEXED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
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
        # One MMA chain along K, as `bi_matmul` sums: the logits behind a token are the deterministic
        # mode's logits bit for bit, whatever the tile (native runs; the interpreter's numpy differs).
        acc = _dot_chain(a, tl.trans(b), acc, UPCAST, PREC, False)
    if HAS_SOFTCAP:
        y = acc / softcap
        # tanh via exp: saturates cleanly to +-1 and needs no libdevice (interpreter).
        acc = (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * softcap
    if NOISE:  # rows with inv_temp > 0 sample; inv_temp 0 marks a greedy row
        t = tl.load(inv_temp + rm, mask=mmask, other=0.0)
        seed = tl.load(seeds + rm, mask=mmask, other=0).to(tl.uint64)
        noisy = acc * t[:, None] + _gumbel(seed[:, None], rn[None, :])
        acc = tl.where(t[:, None] > 0, noisy, acc)
    if MASKED:  # token j of a constrained row competes only where bit j % 32 of its word j // 32 is set
        if MASK_INDEXED:
            mrow = tl.load(allowed_index + rm, mask=mmask, other=-1)
        else:
            mrow = tl.where(mmask, rm, -1)
        words = tl.load(allowed + mrow[:, None].to(tl.int64) * stride_am + (rn // 32)[None, :],
                        mask=(mrow >= 0)[:, None] & nmask[None, :], other=-1)  # unconstrained: every bit set
        acc = tl.where(((words >> (rn % 32)[None, :]) & 1) != 0, acc, float("-inf"))
    acc = tl.where(nmask[None, :], acc, float("-inf"))
    best = tl.max(acc, axis=1)
    arg = tl.argmax(acc, axis=1, tie_break_left=True)
    num_tiles = tl.num_programs(1)
    tl.store(part_val + rm * num_tiles + tile, best, mask=mmask)
    tl.store(part_idx + rm * num_tiles + tile, tile * BLOCK_N + arg, mask=mmask)


@triton.jit
def _combine_kernel(part_val, part_idx, out, out_val, num_tiles, BLOCK: tl.constexpr, WITH_VALUE: tl.constexpr):
    """One program per row: the best tile (lowest on ties, since tiles ascend) and its index (and,
    WITH_VALUE, the best value)."""
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
    if WITH_VALUE:
        tl.store(out_val + row, best_val)


@triton.jit
def _gumbel_noise_kernel(seeds, out, N, stride_om, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds + row).to(tl.uint64)
    tl.store(out + row.to(tl.int64) * stride_om + cols, _gumbel(seed, cols), mask=cols < N)


def gumbel_noise(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """`[M, n]` float32: the noise `lm_head_argmax` adds for each row's seed (`[M]` int64), for a
    sampler that has the logits: `argmax(logits / T + noise)` is then the same draw."""
    out = torch.empty(seeds.shape[0], n, dtype=torch.float32, device=seeds.device)
    if out.numel():
        _gumbel_noise_kernel[(seeds.shape[0], triton.cdiv(n, 1024))](seeds, out, n, out.stride(0), BLOCK=1024)
    return out


def launch_settings(M: int, noise: bool = False) -> dict[str, int]:
    """Tiles by batch size, from the H100 sweep (benchmarks/lm_head_sweep.py, bf16, vocab 262,144):
    up to SMALL_M rows the weight stream is the whole cost (1B: 201-207 us at 3.0 TB/s, against
    224-288 us for cuBLAS + argmax); above it the dot products start to count and 128-row tiles
    win (256 rows: 285 us against 443). The settings depend only on which side of SMALL_M the
    batch is, so a row's token changes with its batch only across that line. Sampling keeps the
    64-row tiles at every size: the noise hash is 64-bit integer work per logit, and with 128 x 256
    tiles the 1B head at 256 rows took 2.15 ms against 0.29 for greedy (most likely spills; not
    profiled)."""
    if M <= SMALL_M or noise:
        return {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 4}
    return {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 4}


def lm_head_argmax(
    x: torch.Tensor,  # [M, K], unit stride in K
    weight: torch.Tensor,  # [N, K] (vocab x hidden), unit stride in K
    softcap: float | None = None,
    inv_temperature: torch.Tensor | None = None,  # [M] float32, device: 1/T; 0 = greedy row
    seeds: torch.Tensor | None = None,  # [M] int64 in [0, 2**63), device: each sampling row's seed
    combine_block: int = 1024,  # tiles per step of the combine kernel's loop
    values: torch.Tensor | None = None,  # [M] float32: receives each row's best (soft-capped) logit
    allowed: torch.Tensor | None = None,  # [m, ceil(N/32)] int32 bitmasks: the tokens a row may take
    allowed_index: torch.Tensor | None = None,  # [M] int32: row r's mask row, -1 none; None: row r's is r
    **settings: int,  # block_m, block_n, block_k, num_warps, num_stages; default launch_settings(M)
) -> torch.Tensor:  # [M] int64
    """Each row's `argmax_j softcap(x @ W.T)[row, j]` (lowest j on ties), in two launches, with no
    logits in memory. `softcap=None` means no cap. With `inv_temperature` and `seeds`, a row with a
    positive inverse temperature takes `argmax_j (logit_j * inv_t + gumbel(seed, j))` instead: a
    sample of `softmax(logits * inv_t)`. `values` (greedy only): the best logits too, e.g. to pick
    between the vocabulary blocks of tensor-parallel ranks. `allowed` (structured outputs): a row with a
    mask takes the argmax over the tokens whose bit is set (bit j % 32 of word j // 32), as the argmax of
    its logits with the others at -inf would; `allowed_index` says which rows have one."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"hidden size {K} does not match the weight's {weight.shape[1]}")
    if (inv_temperature is None) != (seeds is None):
        raise ValueError("inv_temperature and seeds go together")
    noise = inv_temperature is not None
    if noise:
        assert inv_temperature.shape == (M,) and inv_temperature.dtype == torch.float32, inv_temperature.shape
        assert seeds.shape == (M,) and seeds.dtype == torch.int64, seeds.shape
    assert x.stride(1) == 1 and weight.stride(1) == 1, (x.stride(), weight.stride())
    if allowed is not None:
        assert allowed.dtype == torch.int32 and allowed.shape[1] * 32 >= N and allowed.stride(1) == 1, allowed.shape
        assert allowed_index is not None or allowed.shape[0] == M, (allowed.shape, M)
        assert allowed_index is None or (allowed_index.shape == (M,) and allowed_index.dtype == torch.int32)
    out = torch.empty(M, dtype=torch.int64, device=x.device)
    if M == 0:
        return out
    cfg = {**launch_settings(M, noise), **settings}
    if x.dtype.itemsize >= 4:  # 4-byte inputs: smaller tiles, two stages (shared memory)
        cfg.update(block_k=min(cfg["block_k"], 32), block_n=min(cfg["block_n"], 128),
                   num_stages=min(cfg["num_stages"], 2))
    num_tiles = triton.cdiv(N, cfg["block_n"])
    part_val = torch.empty(M, num_tiles, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(M, num_tiles, dtype=torch.int32, device=x.device)
    upcast, prec = dot_flags(x.dtype)
    _tile_argmax_kernel[(triton.cdiv(M, cfg["block_m"]), num_tiles)](
        x, weight, part_val, part_idx, inv_temperature if noise else part_val, seeds if noise else part_idx,
        allowed if allowed is not None else part_idx, allowed_index if allowed_index is not None else part_idx,
        M, N, K, x.stride(0), weight.stride(0), allowed.stride(0) if allowed is not None else 0,
        1.0 if softcap is None else float(softcap),
        HAS_SOFTCAP=softcap is not None, NOISE=noise, MASKED=allowed is not None,
        MASK_INDEXED=allowed_index is not None, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"], UPCAST=upcast, PREC=prec, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if values is not None:
        assert not noise and values.shape == (M,) and values.dtype == torch.float32, (noise, values.shape)
    _combine_kernel[(M,)](part_val, part_idx, out, values if values is not None else part_val, num_tiles,
                          BLOCK=combine_block, WITH_VALUE=values is not None, num_warps=4)
    return out
