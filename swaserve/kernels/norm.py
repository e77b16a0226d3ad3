"""Fused RMSNorm: one launch per call instead of the ~8 elementwise kernels of the torch form, with
the residual add of Gemma's sandwich norms folded in (`residual + norm(x)`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, res_ptr, out_ptr, stride_x, stride_res, stride_out, n_cols, eps,
                     UNIT_OFFSET: tl.constexpr, WEIGHT_FP32: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    xhat = x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: (1 + w) * x̂ in float32
        y = (xhat * (1.0 + w)).to(out_ptr.dtype.element_ty)
    elif WEIGHT_FP32:  # GPT-OSS: w * x̂ in float32
        y = (w * xhat).to(out_ptr.dtype.element_ty)
    else:  # Llama: x̂ cast back first, then w * x̂ in the input dtype
        y = (w.to(out_ptr.dtype.element_ty) * xhat.to(out_ptr.dtype.element_ty)).to(out_ptr.dtype.element_ty)
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
            num_warps=4 if block <= 2048 else 8,
        )
    return out.view(x.shape)
