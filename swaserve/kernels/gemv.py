"""Weight-streaming GEMV for one row: `x @ W.T (+ b)`, each program a block of W's rows read once over the
whole of K, the products summed in registers (no split over K, so no partial sums and no reduce launch),
the next K tile loaded before the current one is folded, so two are in flight a program.

Why: at batch 1 a decode step's projections are a bandwidth problem of a few microseconds each, where the
library picks skinny tensor-core tiles with a split-K reduce for the narrow outputs (o_proj, down_proj).
On an H200 (`benchmarks/gemv_sweep.py`, `results/h200_gemv_sweep_2026-11-29.log`) this kernel was faster
than cuBLAS on the projections whose output is at most twice their input (Gemma 3 1B's qkv 5.13 -> 3.04
us, down 9.57 -> 7.13; Gemma-4-26B-A4B's o_proj 10.91 -> 8.68) and not on the wider ones (1B's gate_up:
11.1 against 12.4 at best), which stay on the library (`use_gemv`). A first form that also took 2-4 rows,
summing each tile across its rows, was up to 3.4x slower than cuBLAS there
(`results/h200_gemv_first_1to4rows_2026-11-29.log`), so this one takes one row only. Decode at batch 1,
ctx 1024, library -> GEMV (`results/h200_gemv_decode_2026-11-29.log`): 1B 1.453 -> 1.263 ms, 4B 3.115 ->
2.920, Gemma-4-26B-A4B 4.100 -> 3.917, GPT-OSS-20B 2.769 -> 2.638.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import num_sms
from swaserve.kernels.pdl import pdl_kwargs, pdl_release, pdl_wait

# On by default; SWASERVE_GEMV=0 keeps every projection on the library GEMM.
_ENABLED = os.environ.get("SWASERVE_GEMV", "1") != "0"


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a projection of input `x` takes `gemv`: one row on a GPU, a 16-bit float weight (unit column
    stride) of 1024 to twice its input's outputs (narrower ones are a few programs; wider ones the library
    streams faster)."""
    N, K = weight.shape
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and 1024 <= N <= 2 * K and weight.stride(1) == 1
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype and _ENABLED)


def gemv_config(N: int, K: int, sms: int) -> tuple[int, int, int]:
    """(block_n, block_k, warps): the tallest block of 8, 4 or 2 rows that gives every SM four programs, and K
    tiles of 512, or 1024 for 2-row blocks from K = 4096 and for any block from K = 10240 (the fastest of
    12 settings, or within noise of it, on each shape of one H200 sweep, `benchmarks/gemv_sweep.py`)."""
    block_n = next((bn for bn in (8, 4) if triton.cdiv(N, bn) >= 4 * sms), 2)
    if K < 1024:
        return block_n, max(64, triton.next_power_of_2(K) // 2), 4
    block_k = 1024 if (block_n == 2 and K >= 4096) or K >= 10240 else 512
    return block_n, block_k, 4


@triton.jit
def _gemv_kernel(x, w, b, out, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_release(USE_PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rn_safe = tl.where(nmask, rn, 0)  # rows past N read row 0 (never stored): no row mask on the stream
    rk = tl.arange(0, BLOCK_K)
    w_rows = w + rn_safe[:, None].to(tl.int64) * stride_wn + rk[None, :]
    # The first weight tile before the PDL wait (weights are read-only during a step).
    if EVEN_K:
        wt = tl.load(w_rows)
    else:
        wt = tl.load(w_rows, mask=rk[None, :] < K, other=0.0)
    pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed over K once, at the end
    # Tile k0 is loaded while the one before it (always whole) is folded.
    for k0 in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            nxt = tl.load(w_rows + k0)
        else:
            nxt = tl.load(w_rows + k0, mask=(k0 + rk < K)[None, :], other=0.0)
        acc += wt.to(tl.float32) * tl.load(x + (k0 - BLOCK_K) + rk).to(tl.float32)[None, :]
        wt = nxt
    last = ((K - 1) // BLOCK_K) * BLOCK_K
    acc += wt.to(tl.float32) * tl.load(x + last + rk, mask=last + rk < K, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out + rn, y.to(out.dtype.element_ty), mask=nmask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for one row `x` [1, K] (contiguous) and `weight` [N, K] (any row stride, unit
    column stride): float32 sums, the result `[1, N]` in x's dtype. Launch settings default to `gemv_config`."""
    K = x.shape[-1]
    N = weight.shape[0]
    assert x.shape == (1, K) and x.is_contiguous() and weight.shape[1] == K, (x.shape, weight.shape)
    assert weight.stride(1) == 1, "a unit column stride"
    bn, bk, warps = gemv_config(N, K, num_sms(x.device) if x.is_cuda else 8)
    bn, bk, warps = block_n or bn, block_k or bk, num_warps or warps
    if out is None:
        out = torch.empty(1, N, device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, weight, bias if bias is not None else weight, out, N, K, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, num_warps=warps, num_stages=1, **pdl_kwargs(x))
    return out
