"""Fused RMSNorm: one launch per call instead of the ~8 elementwise kernels of the torch form, with
the residual add of Gemma's sandwich norms folded in (`residual + norm(x)`), and `add_rms_norm`: that
add plus the next norm of the layer in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import jit_per_batch
from swaserve.kernels.pdl import pdl_enter, pdl_kwargs


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, res_ptr, out_ptr, stride_x, stride_res, stride_out, n_cols, eps,
                     UNIT_OFFSET: tl.constexpr, WEIGHT_FP32: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = _normed(x, w_ptr, cols, mask, n_cols, eps, out_ptr.dtype.element_ty, UNIT_OFFSET, WEIGHT_FP32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        y = (r + y).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., dim] on CUDA (or CPU under TRITON_INTERPRET)
    weight: torch.Tensor,  # [dim]
    eps: float,
    *,
    unit_offset: bool = False,
    weight_fp32: bool = False,
    residual: torch.Tensor | None = None,  # [..., dim]: returns residual + norm(x)
) -> torch.Tensor:
    """Statistics in float32; the three weight forms of `layers.norm.RMSNorm`."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, dim) if residual is not None else x2
    if res2.stride(-1) != 1:
        res2 = res2.contiguous()
    if x2.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, res2, out, x2.stride(0), res2.stride(0), out.stride(0), dim, eps,
            UNIT_OFFSET=unit_offset, WEIGHT_FP32=weight_fp32, HAS_RES=residual is not None, BLOCK=block,
            num_warps=4 if block <= 2048 else 8, **pdl_kwargs(x2),
        )
    return out.view(x.shape)


@triton.jit
def _xhat(x, n_cols, eps):
    """A float32 row normalised by its root mean square (masked columns hold 0)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)


@triton.jit
def _weighted(xhat, w, ty: tl.constexpr, UNIT_OFFSET: tl.constexpr, WEIGHT_FP32: tl.constexpr):
    """The three weight forms of `RMSNorm`, rounded to `ty` (xhat and w in float32): Gemma's (1 + w) * x̂
    and the float32-weight w * x̂ in float32; Llama's x̂ cast back first, then w * x̂ in the dtype."""
    if UNIT_OFFSET:
        y = (xhat * (1.0 + w)).to(ty)
    elif WEIGHT_FP32:
        y = (w * xhat).to(ty)
    else:
        y = (w.to(ty) * xhat.to(ty)).to(ty)
    return y


@triton.jit
def _normed(x, w_ptr, cols, mask, n_cols, eps, ty: tl.constexpr, UNIT_OFFSET: tl.constexpr,
            WEIGHT_FP32: tl.constexpr):
    """`rms_norm` of a float32 row (weight at `w_ptr`), rounded to `ty` as `_rms_norm_kernel` stores it."""
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return _weighted(_xhat(x, n_cols, eps), w, ty, UNIT_OFFSET, WEIGHT_FP32)


@triton.jit
def _load_x(x_ptr, row, stride_x, stride_part, cols, mask, ty: tl.constexpr, NUM_PARTS: tl.constexpr):
    """Row of x in float32. NUM_PARTS > 0: x is split-K partial sums [NUM_PARTS, T, dim] (float32),
    summed in order and rounded to `ty`, as the GEMM's own output would have been."""
    if NUM_PARTS == 0:
        return tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros(cols.shape, tl.float32)
    for s in tl.static_range(NUM_PARTS):  # unrolled: every part's load is in flight at once
        acc += tl.load(x_ptr + s * stride_part + row * stride_x + cols, mask=mask, other=0.0)
    return acc.to(ty).to(tl.float32)


@jit_per_batch("stride_part")
def _add_rms_norm_kernel(x_ptr, res_ptr, pw_ptr, nw_ptr, h_ptr, y_ptr,
                         stride_x, stride_part, stride_res, stride_h, stride_y, n_cols, eps,
                         UNIT_OFFSET: tl.constexpr, WEIGHT_FP32: tl.constexpr, HAS_POST: tl.constexpr,
                         NUM_PARTS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    ty = h_ptr.dtype.element_ty
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    x = _load_x(x_ptr, row, stride_x, stride_part, cols, mask, ty, NUM_PARTS)
    if HAS_POST:
        h = (r + _normed(x, pw_ptr, cols, mask, n_cols, eps, ty, UNIT_OFFSET, WEIGHT_FP32)).to(ty)
    else:
        h = (r + x.to(ty)).to(ty)
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    # The second norm reads h as rounded to the dtype, as if it had been stored and reloaded.
    y = _normed(h.to(tl.float32), nw_ptr, cols, mask, n_cols, eps, ty, UNIT_OFFSET, WEIGHT_FP32)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


def add_rms_norm(
    x: torch.Tensor,  # [T, dim] in residual's dtype, rows may be strided; or float32 split-K partial
    #                   sums [S, T, dim] of it (`skinny_gemm`), summed here
    residual: torch.Tensor,  # [T, dim]
    post_weight: torch.Tensor | None,  # [dim]: h = residual + norm(x); None: h = residual + x
    next_weight: torch.Tensor,  # [dim]
    eps: float,
    *,
    unit_offset: bool = False,
    weight_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(h, norm(h))` with `h = residual + post_norm(x)`: a sandwich norm's residual add and the next
    block's input norm in one launch, rounded exactly as the two `rms_norm` calls would be."""
    dim = residual.shape[-1]
    res2 = residual.reshape(-1, dim)
    if res2.stride(-1) != 1:
        res2 = res2.contiguous()
    parts = x.dim() == 3
    if parts:
        assert x.dtype == torch.float32 and x.shape[1:] == res2.shape and x.stride(2) == 1, (x.shape, res2.shape)
        x2, stride_part = x, x.stride(0)
    else:
        assert x.shape == residual.shape and x.dtype == residual.dtype, (x.shape, residual.shape)
        x2, stride_part = x.reshape(-1, dim), 0
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
    h = torch.empty_like(res2)
    y = torch.empty_like(res2)
    if res2.shape[0]:
        block = triton.next_power_of_2(dim)
        _add_rms_norm_kernel[(res2.shape[0],)](
            x2, res2, post_weight if post_weight is not None else next_weight, next_weight, h, y,
            x2.stride(-2), stride_part, res2.stride(0), h.stride(0), y.stride(0), dim, eps,
            UNIT_OFFSET=unit_offset, WEIGHT_FP32=weight_fp32, HAS_POST=post_weight is not None,
            NUM_PARTS=x.shape[0] if parts else 0, BLOCK=block,
            num_warps=4 if block <= 2048 and not parts else 8,  # parts: fewer registers per thread
            **pdl_kwargs(res2),
        )
    return h.view(residual.shape), y.view(residual.shape)
