"""The fused MoE's grouped GEMM (`moe_gemm`): each block of expert-sorted (token, slot) pairs times its
expert's weights, dense (bf16/fp32), MXFP4 (uint8 e2m1 codes and e8m0 scales dequantised in registers to
the activations' dtype, fp32 accumulation: Hopper has no FP4 MMA) or block FP8 (e4m3 with a float32 scale
per 128 x 128 block: weight-only, or W8A8 on activations quantised per row and 128 inputs, as
`kernels.fp8_gemm` explains), with an optional per-expert bias and the gated activation, or GPT-OSS's
clamped SwiGLU, fused into the first GEMM's epilogue."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from swaserve.kernels.activation import ACTS, gated_act
from swaserve.kernels.common import _dot, dot_flags, interpret_mode, jit_per_batch
from swaserve.kernels.moe_dequant import _fp8_block_dot, _mx_dot, _mx_group_dot, _mx_lut_dot
from swaserve.kernels.pdl import pdl_enter, pdl_kwargs

ACT_SWIGLU_OAI = 3  # GPT-OSS: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
MOE_ACTS = {**ACTS, "swiglu_oai": ACT_SWIGLU_OAI}
DENSE_BLOCK_K = 64  # inputs per step: 128 bytes of a bf16 weight row
MXFP4_BLOCK_K = 128  # inputs per step of an MXFP4 row: 64 bytes of codes, 4 scales
FP8_BLOCK = 128  # inputs (and rows) per block-FP8 weight scale
# How the MXFP4 GEMM dequantises (`mx_mode`): every weight scaled as a bit pattern in the activations'
# dtype; or through float32 arithmetic; or each 32-input group's dots first, its scale once per column
# after them (steps of 32 inputs). All three are exact per weight; they differ in instructions per byte.
# MX_SCALED hands codes and scales to Triton's `tl.dot_scaled` (bf16 activations only; others fall back
# to MX_FLOAT), whose Hopper lowering upcasts e2m1 in the MMA operand's own register layout.
MX_BITS, MX_FLOAT, MX_GROUP, MX_SCALED, MX_LUT = 0, 1, 2, 3, 4
# MX_LUT (bf16 activations; the default): each register of four code bytes converted by table lookups
# (`moe_dequant.MX_LUT_PTX`, ~22 PTX instructions for eight weights with their scale; the compiled loop
# issues ~5.9 SASS instructions a weight in all) into two bf16 tiles whose inputs interleave in fours,
# matched by the activations' load order. On one H200 (gpt-oss-20b experts) it took 50.7 / 270 / 390 /
# 523 us at 1 / 16 / 64 / 256 tokens against dot_scaled's 71.2 / 402 / 454 / 602
# (benchmarks/results/h200_mx_lut_2026-11-29.log). Before it, dot_scaled measured fastest on one H100 at
# every size, gpt-oss-20b and -120b experts: 1.4x MX_FLOAT at 1 token, 2.0-2.8x at 16-256
# (h100_gpt_oss_moe_sweep_scaled_{20b,120b}.log; MX_FLOAT was 1.27-1.36x the bit patterns before that).
MX_MODES = {"bits": MX_BITS, "float": MX_FLOAT, "group": MX_GROUP, "scaled": MX_SCALED, "lut": MX_LUT}


def _default_mode() -> int:
    """MX_LUT, or the mode SWASERVE_MXFP4_MODE names for a whole run (decode benchmarks of the variants)."""
    name = os.environ.get("SWASERVE_MXFP4_MODE", "lut")
    if name not in MX_MODES:
        raise ValueError(f"SWASERVE_MXFP4_MODE={name!r}: one of {', '.join(MX_MODES)}")
    return MX_MODES[name]


MX_DEFAULT = _default_mode()


@triton.jit
def _swiglu_oai(g, u, alpha, limit, ty: tl.constexpr):
    """GPT-OSS's expert activation on float32 gate/up holding `ty` values, rounded once to `ty`."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    glu = g / (1.0 + tl.exp(-alpha * g))  # exp(+inf) for very negative g gives -0, not NaN
    return ((u + 1.0) * glu).to(ty)


@triton.jit
def _expert_out(acc, acc_up, alpha, limit, ty: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr):
    """A GEMM's output in `ty` from its float32 sums: with GATED, gate and up rounded as F.linear's outputs
    would be, then the activation (`_moe_gemm_kernel`'s epilogue, and `moe_split`'s after a split)."""
    if GATED:
        g, u = acc.to(ty).to(tl.float32), acc_up.to(ty).to(tl.float32)
        if ACT == 3:  # ACT_SWIGLU_OAI
            return _swiglu_oai(g, u, alpha, limit, ty)
        return gated_act(g, u, ty, ACT)
    return acc.to(ty)


@jit_per_batch("num_pairs")
def _moe_gemm_kernel(
    a_ptr, as_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, sorted_pairs, block_expert,
    num_pairs, n_out, n_in, stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_be,
    stride_om, stride_os, k_per_split, alpha, limit,
    A_PER_TOKEN: tl.constexpr, TOP_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr, MX_MODE: tl.constexpr, MX_ASM: tl.constexpr,
    SPLIT: tl.constexpr, FP8: tl.constexpr, A_FP8: tl.constexpr, SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out[pair, cols] = a[row(pair)] @ w[e, cols].T (+ bias[e, cols]) for the block's expert e; with
    GATED, w holds gate rows [0, n_out) and up rows [n_out, 2 n_out) and out = act(gate) * up. row(pair)
    is the token (pair // TOP_K) when A_PER_TOKEN, else the pair itself. MXFP4: w is [E, rows, n_in/2]
    code bytes and s [E, rows, n_in/32] scales (strides in bytes). FP8: w is [E, rows, n_in] e4m3 and s
    [E, ceil(rows/SCALE_ROWS), ceil(n_in/128)] float32; A_FP8: a is e4m3 with `as` [rows of a, ceil(n_in/128)].
    SPLIT (split-K): program (b, c, s) sums inputs [s * k_per_split, (s + 1) * k_per_split) only and stores
    float32 partials to out + s * stride_os (gate at cols, up at n_out + cols); split 0 adds the bias;
    `moe_split.finish_split` sums them and applies the activation."""
    pdl_enter(USE_PDL)
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
    k_lo, k_hi = 0, n_in
    if SPLIT:
        k_lo = tl.program_id(2) * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, n_in)
    a_base = a_ptr + a_row[:, None] * stride_am
    w_base = w_ptr + e * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4 and MX_MODE == 2:  # MX_GROUP: a group's scale once per column, after its dots
        gb = tl.arange(0, 16)  # the 16 code bytes of one 32-input group
        sg_base = s_ptr + e * stride_se + cols * stride_sn
        for k0 in range(k_lo, k_hi, 32):
            byte = k0 // 2 + gb
            k_ok = byte < n_in // 2
            a_mask = row_ok[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & col_ok[None, :]
            a_ptrs = a_base + (2 * byte)[None, :]
            acc = _mx_group_dot(a_ptrs, a_mask, w_base + byte[:, None], sg_base + k0 // 32, w_mask, col_ok, acc,
                                UPCAST, PREC)
            if GATED:
                acc_up = _mx_group_dot(a_ptrs, a_mask, w_base + n_out * stride_wn + byte[:, None],
                                       sg_base + n_out * stride_sn + k0 // 32, w_mask, col_ok, acc_up, UPCAST, PREC)
    elif MXFP4 and MX_MODE == 3:  # MX_SCALED: a [M, K] bf16, codes [K/2, N] packed along K, scales [N, K/32]
        ks = tl.arange(0, BLOCK_K)
        kb = tl.arange(0, BLOCK_K // 2)
        kg = tl.arange(0, BLOCK_K // 32)
        sc_base = s_ptr + e * stride_se + cols[:, None] * stride_sn
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a = tl.load(a_base + (k0 + ks)[None, :], mask=row_ok[:, None] & ((k0 + ks) < n_in)[None, :], other=0.0)
            byte = k0 // 2 + kb
            w_mask = (byte < n_in // 2)[:, None] & col_ok[None, :]
            grp = k0 // 32 + kg
            s_mask = col_ok[:, None] & (grp < n_in // 32)[None, :]
            w = tl.load(w_base + byte[:, None], mask=w_mask, other=0)
            sc = tl.load(sc_base + grp[None, :], mask=s_mask, other=127)
            acc = tl.dot_scaled(a, None, "bf16", w, sc, "e2m1", acc=acc)
            if GATED:
                wu = tl.load(w_base + n_out * stride_wn + byte[:, None], mask=w_mask, other=0)
                su = tl.load(sc_base + n_out * stride_sn + grp[None, :], mask=s_mask, other=127)
                acc_up = tl.dot_scaled(a, None, "bf16", wu, su, "e2m1", acc=acc_up)
    elif MXFP4 and MX_MODE == 4:  # MX_LUT: w_A / w_B hold inputs 8 (b // 4) + b % 4 (+ 4) of byte b
        kb = tl.arange(0, BLOCK_K // 2)
        ia = (kb // 4) * 8 + kb % 4
        s_base = s_ptr + e * stride_se + cols[None, :] * stride_sn
        for k0 in range(k_lo, k_hi, BLOCK_K):
            byte = k0 // 2 + kb
            k_ok = byte < n_in // 2  # whole 4-byte runs: n_in is a multiple of 32
            a_mask = row_ok[:, None] & k_ok[None, :]
            a_A = tl.load(a_base + (k0 + ia)[None, :], mask=a_mask, other=0.0)
            a_B = tl.load(a_base + (k0 + ia + 4)[None, :], mask=a_mask, other=0.0)
            g0, groups = k0 // 32, n_in // 32
            acc = _mx_lut_dot(a_A, a_B, w_base, s_base, byte, g0, groups, col_ok, acc, MX_ASM, UPCAST, PREC)
            if GATED:
                acc_up = _mx_lut_dot(a_A, a_B, w_base + n_out * stride_wn, s_base + n_out * stride_sn, byte, g0,
                                     groups, col_ok, acc_up, MX_ASM, UPCAST, PREC)
    elif FP8:
        ks = tl.arange(0, BLOCK_K)
        ws_base = s_ptr + e * stride_se + (cols // SCALE_ROWS)[None, :] * stride_sn
        wsu_base = s_ptr + e * stride_se + ((cols + n_out) // SCALE_ROWS)[None, :] * stride_sn
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + ks) < n_in
            a = tl.load(a_base + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_scale = 0.0
            if A_FP8:
                a_scale = tl.load(as_ptr + a_row * stride_asm + k0 // 128, mask=row_ok, other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            acc = _fp8_block_dot(a, a_scale, w_base + (k0 + ks)[:, None], ws_base + k0 // 128, w_mask, col_ok, acc,
                                 A_FP8, UPCAST, PREC)
            if GATED:
                acc_up = _fp8_block_dot(a, a_scale, w_base + n_out * stride_wn + (k0 + ks)[:, None],
                                        wsu_base + k0 // 128, w_mask, col_ok, acc_up, A_FP8, UPCAST, PREC)
    elif MXFP4:
        kb = tl.arange(0, BLOCK_K // 2)  # code bytes of one step: inputs 2kb (low nibble) and 2kb + 1
        s_base = s_ptr + e * stride_se + cols[None, :] * stride_sn
        for k0 in range(k_lo, k_hi, BLOCK_K):
            byte = k0 // 2 + kb
            k_ok = byte < n_in // 2
            a_mask = row_ok[:, None] & k_ok[None, :]
            a_even = tl.load(a_base + (2 * byte)[None, :], mask=a_mask, other=0.0)
            a_odd = tl.load(a_base + (2 * byte + 1)[None, :], mask=a_mask, other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            acc = _mx_dot(a_even, a_odd, w_base + byte[:, None], s_base + (byte // 16)[:, None], w_mask, acc,
                          MX_MODE, UPCAST, PREC)
            if GATED:
                up_w, up_s = w_base + n_out * stride_wn, s_base + n_out * stride_sn
                acc_up = _mx_dot(a_even, a_odd, up_w + byte[:, None], up_s + (byte // 16)[:, None], w_mask,
                                 acc_up, MX_MODE, UPCAST, PREC)
    else:
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + ks) < n_in
            a = tl.load(a_base + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += _dot(a, w, UPCAST, PREC)
            if GATED:
                wu = tl.load(w_base + n_out * stride_wn + (k0 + ks)[:, None],
                             mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc_up += _dot(a, wu, UPCAST, PREC)
    if HAS_BIAS and (not SPLIT or tl.program_id(2) == 0):
        b_base = bias_ptr + e * stride_be + cols
        acc += tl.load(b_base, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_base + n_out, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SPLIT:  # float32 partials; the activation after their sum (`finish_split`)
        part = out_ptr + tl.program_id(2) * stride_os + pair[:, None] * stride_om + cols[None, :]
        keep = row_ok[:, None] & col_ok[None, :]
        tl.store(part, acc, mask=keep)
        if GATED:
            tl.store(part + n_out, acc_up, mask=keep)
        return
    y = _expert_out(acc, acc_up, alpha, limit, out_ptr.dtype.element_ty, GATED, ACT)
    tl.store(out_ptr + pair[:, None] * stride_om + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


def moe_gemm(
    a: torch.Tensor,  # [n or pairs, n_in] activations (x per token, or h per pair)
    w: torch.Tensor,  # [E, rows, n_in] dense or e4m3, or [E, rows, n_in/32, 16] uint8 MXFP4 codes
    scales: torch.Tensor | None,  # [E, rows, n_in/32] uint8 e8m0 (MXFP4); FP8: [E, ceil(rows/scale_rows),
    # ceil(n_in/128)] float32; None for dense weights
    bias: torch.Tensor | None,  # [E, rows]
    out: torch.Tensor,  # [pairs, n_out], written at the sorted pairs' rows only; split_k > 1: float32
    # partials [split_k, pairs, rows] (`moe_split.finish_split` / `fused_moe.combine` sum them)
    sorted_pairs: torch.Tensor,  # [blocks * block_m] int32
    block_expert: torch.Tensor,  # [blocks] int32
    num_pairs: int,
    *,
    top_k: int,
    a_per_token: bool,
    gated: bool,  # rows = 2 n_out (gate rows first), out = act(gate) * up
    activation: str = "silu",
    alpha: float = 1.0,
    limit: float = 0.0,
    block_m: int,
    block_n: int,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,  # software-pipelining depth (None: Triton's default)
    mx_mode: int = MX_DEFAULT,
    scale_rows: int = FP8_BLOCK,  # FP8: weight rows per scale (128, or 1: a scale per row)
    a_scales: torch.Tensor | None = None,  # FP8 W8A8: `a` is e4m3, these its [rows of a, ceil(n_in/128)] scales
    split_k: int = 1,  # programs a block's inputs are split over (each a run of whole K steps)
) -> None:
    split = split_k > 1
    n_in = a.shape[1]
    if split:
        assert out.dtype == torch.float32 and out.dim() == 3 and out.shape[0] == split_k, (out.shape, out.dtype)
        n_out = out.shape[2] // (2 if gated else 1)
    else:
        n_out = out.shape[1]
    fp8 = w.dtype == torch.float8_e4m3fn
    mx = scales is not None and not fp8
    E, rows = w.shape[:2]
    assert rows == (2 if gated else 1) * n_out, (w.shape, n_out, gated)
    if fp8:
        assert scales is not None and scales.dtype == torch.float32 and scale_rows in (1, FP8_BLOCK), scale_rows
        assert w.shape == (E, rows, n_in) and w.stride(2) == 1, (w.shape, w.stride())
        assert scales.shape == (E, triton.cdiv(rows, scale_rows), triton.cdiv(n_in, FP8_BLOCK)), scales.shape
        assert scales.stride(2) == 1 and (a_scales is None or a.dtype == torch.float8_e4m3fn)
    elif mx:
        assert w.dtype == scales.dtype == torch.uint8 and n_in % 32 == 0, (w.dtype, scales.dtype, n_in)
        assert w.shape == (E, rows, n_in // 32, 16), w.shape
        assert scales.shape == (E, rows, n_in // 32), scales.shape
        assert w.stride(3) == 1 and w.stride(2) == 16 and scales.stride(2) == 1
    else:
        assert w.shape == (E, rows, n_in) and w.stride(2) == 1, (w.shape, w.stride())
    assert a.stride(1) == 1 and out.stride(-1) == 1
    if bias is not None:
        assert bias.shape == (E, rows) and bias.stride(1) == 1, bias.shape
    if fp8:  # 128 inputs per step (one scale); fp32 activations 64 so the stages fit in shared memory
        block_k = block_k or (64 if a.dtype == torch.float32 else FP8_BLOCK)
        assert FP8_BLOCK % block_k == 0, block_k
    block_k = block_k or (MXFP4_BLOCK_K if mx else DENSE_BLOCK_K)
    if mx_mode in (MX_SCALED, MX_LUT) and a.dtype != torch.bfloat16:
        mx_mode = MX_FLOAT  # dot_scaled and the LUT's tiles take bf16 activations, not float32
    a_fp8 = a_scales is not None
    upcast, prec = (False, "tf32") if a_fp8 else dot_flags(a.dtype)
    s = scales if mx or fp8 else w  # an unused pointer argument still needs a tensor
    a_s = a_scales if a_fp8 else s
    step = 32 if mx and mx_mode == MX_GROUP else block_k
    k_per_split = triton.cdiv(triton.cdiv(n_in, split_k), step) * step  # whole K steps
    _moe_gemm_kernel[(block_expert.numel(), triton.cdiv(n_out, block_n), split_k)](
        a, a_s, w, s, bias if bias is not None else w, out, sorted_pairs, block_expert,
        num_pairs, n_out, n_in, a.stride(0), a_s.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(-2), out.stride(0) if split else 0, k_per_split,
        float(alpha), float(limit),
        A_PER_TOKEN=a_per_token, TOP_K=top_k, GATED=gated, ACT=MOE_ACTS[activation], HAS_BIAS=bias is not None,
        MXFP4=mx, MX_MODE=mx_mode, MX_ASM=not interpret_mode(), SPLIT=split, FP8=fp8, A_FP8=a_fp8,
        SCALE_ROWS=scale_rows, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, PREC=prec,
        num_warps=num_warps, **({"num_stages": num_stages} if num_stages else {}), **pdl_kwargs(a),
    )
