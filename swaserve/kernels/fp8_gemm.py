"""Block-FP8 GEMM (`fp8_gemm`): `x @ dequant(W).T (+ bias)` for e4m3 weights `[N, K]` with one float32
scale per 128 x 128 block (or per row and 128 inputs: merged projections whose parts are not whole
128-row blocks), fp32 accumulation, and the per-token-group activation quantiser (`quant_fp8_groups`).

Two ways through the K loop, one kernel (`A_FP8`):
- weight-only (W8A16): bf16 activations as they are, each weight tile converted e4m3 -> bf16 in
  registers (exact), one bf16 MMA per 128 inputs, its fp32 result times the block's scale:
  `acc += dot(a, w) * w_scale`. Decode is a bandwidth problem: the weight bytes are half of bf16's
  and nothing else is read or launched; the activations keep their bf16 precision.
- W8A8: activations quantised per row and 128 inputs (amax/448, dynamic) by one small launch, then an
  fp8 MMA (twice bf16's peak on Hopper): `acc += dot(a8, w8) * a_scale * w_scale`. Prefill is a
  FLOPs problem: from ~128 rows a GEMM over fp8 weights is compute-bound (2 M flops per weight byte
  against the H100's ~295 bf16 flops per byte of HBM), so fp8 MMAs are where the time goes.
`fp8_gemm` picks W8A8 from `W8A8_MIN_ROWS` rows (`act_fp8` overrides; benchmarks/fp8_gemm.py measures
both at every size: the weight-only form's 64-row tile already lost to W8A8 at 64 rows). Rows never mix: a row's result depends on its own input, the tile and the mode,
so padded graph rows are inert (an all-zero row quantises with a finite scale and gives 0).
Deterministic mode (`batch_invariant`): weight-only and one tiling for every M, so a row's bits do
not depend on how many rows share the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import _dot, dot_flags, interpret_mode, jit_per_batch, num_sms

BLOCK = 128  # inputs per scale (weights and activations), rows per weight scale in the block layout
FP8_MAX = 448.0
# From here W8A8 beats weight-only on every measured projection (H200, benchmarks/fp8_gemm.py: at 64 rows
# 30 against 58 us on MiMo's q/k/v, 44 against 89 on its dense gate/up; Gemma 4's down 15.0 against 13.4 the
# one loss); below it the weight-only form streams the weight with nothing else launched.
W8A8_MIN_ROWS = 64
_EPS = 1e-10


@triton.jit
def _round_e4m3(v, EMULATE: tl.constexpr):
    """float32 values in [-448, 448] -> e4m3fn, rounded to nearest even. EMULATE (the interpreter, whose
    float32 -> fp8 cast of triton 3.9 drops the carry when rounding up crosses a power of two, e.g.
    127.1 -> 64): round in float32 first (3 mantissa bits; subnormals below 2^-6 to multiples of
    2^-9) so the cast is exact. The GPU's cast rounds the same way in one instruction."""
    if EMULATE:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
        sub = (tl.abs(v) + 24576.0) - 24576.0  # 1.5 * 2^14: float32 spacing 2^-9 there
        sub = sub.to(tl.int32, bitcast=True) | (bits & -2147483648)  # the sign kept, -0 included
        v = tl.where(tl.abs(v) < 0.015625, sub, rounded).to(tl.float32, bitcast=True)
    return v.to(tl.float8e4nv)


@jit_per_batch("M", aligned=("stride_xm", "stride_qm", "stride_sm"))
def _quant_groups_kernel(x, q, s, M, K, stride_xm, stride_qm, stride_sm, ROWS: tl.constexpr,
                         GROUP: tl.constexpr, EMULATE: tl.constexpr):
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rk = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    v = tl.load(x + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (div_rn), as torch's: Triton's `/` on fp32 is the GPU's approximate division, and a
    # last-bit difference moves scales and codes off the reference's (seen on H100).
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), 1e-10), 448.0)  # [ROWS]
    qv = tl.clamp(tl.math.div_rn(v, scale[:, None]), -448.0, 448.0)
    tl.store(q + rm[:, None].to(tl.int64) * stride_qm + rk[None, :], _round_e4m3(qv, EMULATE), mask=mask)
    tl.store(s + rm * stride_sm + tl.program_id(1), scale, mask=rm < M)


def quant_fp8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, K]` (unit stride in K) -> (float8_e4m3fn `[M, K]`, float32 `[M, ceil(K/128)]`): each row's
    run of 128 inputs scaled by max(amax, 1e-10)/448, as `layers.fp8.quantize_act_groups` in torch."""
    M, K = x.shape
    assert x.stride(1) == 1, x.stride()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, triton.cdiv(K, BLOCK), dtype=torch.float32, device=x.device)
    if M:
        rows = 16
        _quant_groups_kernel[(triton.cdiv(M, rows), triton.cdiv(K, BLOCK))](
            x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), ROWS=rows, GROUP=BLOCK, EMULATE=interpret_mode(), num_warps=4)
    return q, s


@jit_per_batch("M", aligned=("stride_am", "stride_asm", "stride_om"))
def _fp8_gemm_kernel(
    a, a_s, w, w_s, bias, out, M, N, K,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    SCALE_ROWS: tl.constexpr, A_FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """out[M, N] = sum over K blocks of dot(a, w^T) times the blocks' scales. `w` [N, K] e4m3,
    `w_s` [ceil(N/SCALE_ROWS), ceil(K/128)]; A_FP8: `a` e4m3 with `a_s` [M, ceil(K/128)]."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # grouped order: GROUP_M row tiles share each weight tile in L2
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    a_rows = a + rm[:, None].to(tl.int64) * stride_am
    w_cols = w + rn[None, :].to(tl.int64) * stride_wn
    ws_cols = w_s + (rn // SCALE_ROWS) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        at = tl.load(a_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wt = tl.load(w_cols + rk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        wsc = tl.load(ws_cols + k0 // 128, mask=nmask, other=0.0)  # [BLOCK_N]
        if A_FP8:
            asc = tl.load(a_s + rm * stride_asm + k0 // 128, mask=mmask, other=0.0)  # [BLOCK_M]
            acc += tl.dot(at, wt) * asc[:, None] * wsc[None, :]
        else:
            acc += _dot(at, wt.to(at.dtype), UPCAST, PREC) * wsc[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _tiles(M: int, N: int, act_fp8: bool, dtype: torch.dtype, sms: int, batch_invariant: bool
           ) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_warps, num_stages). Prefill (W8A8): 128 x 128 tiles. Decode:
    the row tile fits M, and the column tile narrows until there are about two programs per SM to
    stream the weight. fp32 activations (parity runs) take 64-input steps so the stages fit."""
    block_k = 64 if dtype.itemsize >= 4 else BLOCK
    if batch_invariant:
        return 64, 64, block_k, 4, 3
    if act_fp8:
        return (64 if M <= 64 else 128), 128, BLOCK, (4 if M <= 64 else 8), 3
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n = 128
    while block_n > 32 and triton.cdiv(M, block_m) * triton.cdiv(N, block_n) < 2 * sms:
        block_n //= 2
    return block_m, block_n, block_k, 4, (3 if dtype.itemsize >= 4 else 4)


def fp8_gemm(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32, unit stride in K
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, unit stride in K
    scale: torch.Tensor,  # [ceil(N/scale_rows), ceil(K/128)] float32
    bias: torch.Tensor | None = None,  # [N]
    *,
    scale_rows: int = BLOCK,  # 128: block scales; 1: a scale per row and 128 inputs
    act_fp8: bool | None = None,  # None: W8A8 from W8A8_MIN_ROWS rows (never in batch_invariant mode)
    batch_invariant: bool = False,
    tile: tuple[int, int, int, int, int] | None = None,  # (block_m, block_n, block_k, warps, stages): sweeps
) -> torch.Tensor:  # [M, N] in x's dtype
    M, K = x.shape
    N = weight.shape[0]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape[1] == K, (weight.dtype, weight.shape, K)
    assert x.stride(1) == 1 and weight.stride(1) == 1, (x.stride(), weight.stride())
    assert scale.shape == (triton.cdiv(N, scale_rows), triton.cdiv(K, BLOCK)) and scale.dtype == torch.float32, (
        scale.shape, scale.dtype, scale_rows)
    assert scale_rows in (1, BLOCK), scale_rows
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if batch_invariant:
        act_fp8 = False
    elif act_fp8 is None:
        act_fp8 = M >= W8A8_MIN_ROWS and x.dtype != torch.float32
    bm, bn, bk, warps, stages = tile or _tiles(M, N, act_fp8, x.dtype, num_sms(x.device), batch_invariant)
    assert BLOCK % bk == 0, bk
    if act_fp8:
        a, a_s = quant_fp8_groups(x)
        upcast, prec = False, "tf32"
    else:
        a, a_s = x, scale  # a_s unused
        upcast, prec = dot_flags(x.dtype)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _fp8_gemm_kernel[grid](
        a, a_s, weight, scale, bias if bias is not None else scale, out, M, N, K,
        a.stride(0), a_s.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        SCALE_ROWS=scale_rows, A_FP8=act_fp8, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, UPCAST=upcast, PREC=prec,
        num_warps=warps, num_stages=stages,
    )
    return out
