"""Quantised expert weights dequantised inside the MoE GEMM's K loop (`kernels.moe_gemm`). MXFP4: FP4 e2m1
codes (two a byte, the low nibble the even input) and their 32-input groups' e8m0 scale bytes, to the
activations' dtype, exactly (each value a power of two times one of 0, 0.5, 1, 1.5, 2, 3, 4, 6). Block
FP8: e4m3 weights with a float32 scale per 128 x 128 block."""

from __future__ import annotations

import triton
import triton.language as tl

from swaserve.kernels.common import _dot


@triton.jit
def _mx_values(code, scale, ty: tl.constexpr):
    """MXFP4 values in `ty` (bf16 or fp32), exactly: FP4 e2m1 codes (0..15, int32) times their e8m0 scale
    bytes 2^(s-127), built as bit patterns without a multiply. A code of exponent e >= 1 and mantissa m is
    2^(e-1) (1 + m/2), so its scaled value has exponent field e + s - 1 and mantissa bit m; code 1 (0.5)
    has exponent field s - 1 and no mantissa; code 0 is 0. The sign is the code's bit 3. Values whose
    exponent field would be < 1 (scales below 2^-125, which no quantiser emits) read as 0."""
    mag = code & 7
    exp = (mag >> 1) + scale - 1
    mant = tl.where(mag >= 2, mag & 1, 0)
    zero = (mag == 0) | (exp < 1)
    if ty == tl.bfloat16:
        bits = tl.where(zero, 0, (exp << 7) | (mant << 6)) | ((code & 8) << 12)
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    bits = tl.where(zero, 0, (exp << 23) | (mant << 22)) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True).to(ty)


@triton.jit
def _mx_values_float(code, scale):
    """The same values through float32 arithmetic (`MX_FLOAT`): e2m1 placed into a float32's exponent
    and mantissa (codes 0 and 1 apart: no subnormal a flush-to-zero multiply could lose), times the
    scale 2^(s-127) built as a float32 (s = 0 reads as 0)."""
    mag = code & 7
    normal = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    val = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
    val = tl.where((code & 8) != 0, -val, val)
    return val * (scale << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_dot(a_even, a_odd, w_ptrs, s_ptrs, mask, acc, MODE: tl.constexpr, UPCAST: tl.constexpr,
            PREC: tl.constexpr):
    """acc + a @ W for one K step of an MXFP4 weight: `w_ptrs` [K/2, N] code bytes (low nibble the even
    input, high the odd), `s_ptrs` [K/2, N] the scale of each byte's group; `a_even`/`a_odd` [M, K/2] the
    activations of the even and odd inputs, so no register shuffle interleaves the nibbles. The weights
    are dequantised to the activations' dtype as bit patterns (MX_BITS) or through float32 (MX_FLOAT)."""
    q = tl.load(w_ptrs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(s_ptrs, mask=mask, other=127).to(tl.int32)
    ty: tl.constexpr = a_even.dtype
    if MODE == 1:  # MX_FLOAT
        w_even = _mx_values_float(q & 15, scale).to(ty)
        w_odd = _mx_values_float(q >> 4, scale).to(ty)
    else:
        w_even = _mx_values(q & 15, scale, ty)
        w_odd = _mx_values(q >> 4, scale, ty)
    return acc + _dot(a_even, w_even, UPCAST, PREC) + _dot(a_odd, w_odd, UPCAST, PREC)


@triton.jit
def _mx_group_dot(a_ptrs_even, a_mask, w_ptrs, s_ptrs, w_mask, s_mask, acc, UPCAST: tl.constexpr,
                  PREC: tl.constexpr):
    """acc + a @ W for one 32-input group of an MXFP4 weight (`MX_GROUP`): its 16 code bytes per column
    `w_ptrs` [16, N] dequantised without their scale (exact e2m1 values), two dots, then the group's one
    scale per column `s_ptrs` [N] applied to the [M, N] partial sum (a power of two: exact)."""
    q = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.int32)
    a_even = tl.load(a_ptrs_even, mask=a_mask, other=0.0)
    a_odd = tl.load(a_ptrs_even + 1, mask=a_mask, other=0.0)
    ty: tl.constexpr = a_even.dtype
    w_even = _mx_values(q & 15, 127, ty)  # scale 2^0: the code's own value
    w_odd = _mx_values(q >> 4, 127, ty)
    part = _dot(a_even, w_even, UPCAST, PREC) + _dot(a_odd, w_odd, UPCAST, PREC)
    scale = (tl.load(s_ptrs, mask=s_mask, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return acc + part * scale[None, :]


@triton.jit
def _fp8_block_dot(a, a_scale, w_ptrs, ws_ptrs, w_mask, col_ok, acc, A_FP8: tl.constexpr, UPCAST: tl.constexpr,
                   PREC: tl.constexpr):
    """acc + one 128-input step of a block-FP8 weight: `w_ptrs` [K, N] e4m3, `ws_ptrs` [1, N] the scale of
    each column's block; `a` [M, K] e4m3 with `a_scale` [M] (A_FP8: an fp8 MMA) or in the activations'
    dtype (the weights converted to it in registers, exactly)."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    ws = tl.load(ws_ptrs, mask=col_ok[None, :], other=0.0)
    if A_FP8:
        return acc + tl.dot(a, w) * a_scale[:, None] * ws
    return acc + _dot(a, w.to(a.dtype), UPCAST, PREC) * ws


# MX_LUT's conversion of four code bytes (eight e2m1 values, inputs 8p .. 8p+7 of a step) to bf16 in one
# register's worth of integer work (`MX_LUT_PTX`): the magnitudes (3 bits a nibble, in input order in the
# low 16 bits) index two 8-entry byte tables with `prmt` (the bf16 high and low bytes of 0, 0.5, 1, 1.5, 2, 3, 4, 6), the
# sign bits are merged into the high bytes, two more `prmt`s interleave high and low bytes into bf16
# pairs, and one `fma.rn.bf16x2` each applies the group's scale 2^(s-127) (exact: a power of two; + -0
# keeps a zero's sign). Outputs: $0 $1 = inputs 8p .. 8p+3 (the w_A half), $2 $3 = 8p+4 .. 8p+7 (w_B).
MX_LUT_PTX = """{
.reg .b32 c, c2, ha, hb, la, lb, h0, l0, h1, l1, qs, s0, s1, t, ss, nz;
mov.b32 ha, 0x3F3F3F00; mov.b32 hb, 0x40404040; mov.b32 la, 0xC0800000; mov.b32 lb, 0xC0804000;
and.b32 c, $4, 0x77777777; shr.u32 c2, c, 16;
prmt.b32 h0, ha, hb, c; prmt.b32 l0, la, lb, c; prmt.b32 h1, ha, hb, c2; prmt.b32 l1, la, lb, c2;
shl.b32 qs, $4, 4; prmt.b32 s0, qs, $4, 0x5140; prmt.b32 s1, qs, $4, 0x7362;
lop3.b32 h0, h0, s0, 0x80808080, 0xF8; lop3.b32 h1, h1, s1, 0x80808080, 0xF8;
and.b32 t, $5, 0xFF; shl.b32 t, t, 7; prmt.b32 ss, t, t, 0x1010; mov.b32 nz, 0x80008000;
prmt.b32 $0, l0, h0, 0x5140; prmt.b32 $1, l0, h0, 0x7362;
prmt.b32 $2, l1, h1, 0x5140; prmt.b32 $3, l1, h1, 0x7362;
fma.rn.bf16x2 $0, $0, ss, nz; fma.rn.bf16x2 $1, $1, ss, nz;
fma.rn.bf16x2 $2, $2, ss, nz; fma.rn.bf16x2 $3, $3, ss, nz;
}"""
_MX_LUT_ASM = tl.constexpr(MX_LUT_PTX)  # (a jit function reads module globals only as constexprs)


@triton.jit
def _mx_lut_dot(a_A, a_B, w_base, s_base, byte, g0, n_groups, col_ok, acc, ASM: tl.constexpr, UPCAST: tl.constexpr,
                PREC: tl.constexpr):
    """acc + a @ W for one K step of an MXFP4 weight (`MX_LUT`, bf16 activations): the step's code bytes
    `byte` [K/2] (absolute, from `w_base` [1, N] pointers; groups g0 .. of `s_base`) as two bf16 tiles, w_A
    holding at byte b the weight of input 8 (b // 4) + b % 4 of the step and w_B that of input
    8 (b // 4) + 4 + b % 4 (what one register of four bytes converts to, `MX_LUT_PTX`); `a_A` / `a_B`
    [M, K/2] the matching activations. The scales are loaded once a group and broadcast over its 16
    bytes. Without ASM (the interpreter) the same tiles come from `_mx_values` on bytes loaded in that order."""
    G: tl.constexpr = byte.shape[0] // 16
    N: tl.constexpr = col_ok.shape[0]
    grp = g0 + tl.arange(0, G)
    sg = tl.load(s_base + grp[:, None], mask=(grp < n_groups)[:, None] & col_ok[None, :], other=127)  # [G, N]
    s = tl.reshape(tl.broadcast_to(sg[:, None, :], (G, 16, N)), (G * 16, N))  # each byte's group scale
    mask = (byte < 16 * n_groups)[:, None] & col_ok[None, :]
    if ASM:
        q = tl.load(w_base + byte[:, None], mask=mask, other=0)
        w_A, w_B = tl.inline_asm_elementwise(asm=_MX_LUT_ASM, constraints="=r,=r,=r,=r,r,r", args=[q, s],
                                             dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        src = (byte // 4) * 4 + (byte % 4) // 2  # the byte holding w_A's input; w_B's is 2 further
        odd = ((byte % 2) == 1)[:, None]
        qa = tl.load(w_base + src[:, None], mask=mask, other=0).to(tl.int32)
        qb = tl.load(w_base + (src + 2)[:, None], mask=mask, other=0).to(tl.int32)
        s32 = s.to(tl.int32)
        w_A = _mx_values(tl.where(odd, qa >> 4, qa & 15), s32, tl.bfloat16)
        w_B = _mx_values(tl.where(odd, qb >> 4, qb & 15), s32, tl.bfloat16)
    return acc + _dot(a_A, w_A, UPCAST, PREC) + _dot(a_B, w_B, UPCAST, PREC)
