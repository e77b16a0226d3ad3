"""The end of a Gemma 4 decoder layer in one launch: from the feed-forward outputs to the next layer's
normed input.

    ff = norm_1(mlp) + norm_2(moe)            (the MoE layers; else ff = mlp)
    h  = (h + post_norm(ff)) * layer_scalar
    x  = next_norm(h)

In torch and `kernels.norm` that is five launches on an MoE layer (four `rms_norm` and the scalar's
product; three on a dense one), each reading and writing a `[T, hidden]` row: ~10 us a layer at one
token on an H200, two thirds of it launch and ramp. Here one program per token reads the row once and
rounds every intermediate to the activation dtype exactly where the separate launches store it, so the
results are bit for bit theirs in bf16 and fp16 (natively on an H200 too). A float32 row may differ by an
ulp on a GPU: `norm_1(mlp) + norm_2(moe)` adds two unrounded products there, and the compiler may
contract either into an FMA. `mlp` may be the down projection's float32 split-K partial sums
(`skinny_gemm`), summed here as `add_rms_norm` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.norm import _load_x, _normed
from swaserve.kernels.pdl import pdl_enter, pdl_kwargs


@triton.jit
def _ffn_tail_kernel(mlp_ptr, moe_ptr, h_ptr, w1_ptr, w2_ptr, wp_ptr, scalar_ptr, wn_ptr, h_out, x_out,
                     stride_mlp, stride_part, stride_moe, stride_h, stride_ho, stride_xo, n_cols, eps,
                     HAS_MOE: tl.constexpr, NUM_PARTS: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                     WEIGHT_FP32: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    ty = h_out.dtype.element_ty
    ff = _load_x(mlp_ptr, row, stride_mlp, stride_part, cols, mask, ty, NUM_PARTS)
    if HAS_MOE:  # norm_2(moe) with norm_1(mlp) as its residual: (r + y) in the dtype, as `rms_norm` adds it
        ff1 = _normed(ff, w1_ptr, cols, mask, n_cols, eps, ty, UNIT_OFFSET, WEIGHT_FP32)
        moe = tl.load(moe_ptr + row * stride_moe + cols, mask=mask, other=0.0).to(tl.float32)
        ff = (ff1 + _normed(moe, w2_ptr, cols, mask, n_cols, eps, ty, UNIT_OFFSET, WEIGHT_FP32)).to(ty)
        ff = ff.to(tl.float32)
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    h = (h + _normed(ff, wp_ptr, cols, mask, n_cols, eps, ty, UNIT_OFFSET, WEIGHT_FP32)).to(ty)
    # the layer scalar: bf16 * bf16 is exact in float32, then rounded, as torch's product
    h = (h.to(tl.float32) * tl.load(scalar_ptr).to(tl.float32)).to(ty)
    tl.store(h_out + row * stride_ho + cols, h, mask=mask)
    x = _normed(h.to(tl.float32), wn_ptr, cols, mask, n_cols, eps, ty, UNIT_OFFSET, WEIGHT_FP32)
    tl.store(x_out + row * stride_xo + cols, x, mask=mask)


def ffn_tail(
    mlp: torch.Tensor,  # [T, dim] in h's dtype, or float32 split-K partial sums [S, T, dim] of it
    moe: torch.Tensor | None,  # [T, dim] in h's dtype; None: a dense layer (ff = mlp)
    h: torch.Tensor,  # [T, dim]: the residual stream after attention
    norm_1: torch.Tensor | None,  # [dim] weights of the MLP's and the experts' post norms (with `moe`)
    norm_2: torch.Tensor | None,
    post_norm: torch.Tensor,  # [dim]
    layer_scalar: torch.Tensor,  # [1], h's dtype
    next_norm: torch.Tensor,  # [dim]
    eps: float,
    *,
    unit_offset: bool = False,
    weight_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(h, next_norm(h))` after the feed-forward block (the module docstring's formulas), rounded as the
    separate `rms_norm` launches and the scalar's product are. Every norm takes one weight form."""
    dim = h.shape[-1]
    h2 = h.reshape(-1, dim)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    parts = mlp.dim() == 3
    if parts:
        assert mlp.dtype == torch.float32 and mlp.shape[1:] == h2.shape and mlp.stride(2) == 1, \
            (mlp.shape, h.shape)
        mlp2, stride_part = mlp, mlp.stride(0)
    else:
        assert mlp.shape == h.shape and mlp.dtype == h.dtype, (mlp.shape, mlp.dtype, h.shape, h.dtype)
        mlp2, stride_part = mlp.reshape(-1, dim), 0
        if mlp2.stride(-1) != 1:
            mlp2 = mlp2.contiguous()
    if moe is not None:
        assert moe.shape == h.shape and moe.dtype == h.dtype and norm_1 is not None and norm_2 is not None
        moe = moe.reshape(-1, dim) if moe.stride(-1) == 1 else moe.reshape(-1, dim).contiguous()
    assert layer_scalar.numel() == 1, layer_scalar.shape
    h_out = torch.empty_like(h2)
    x_out = torch.empty_like(h2)
    if h2.shape[0]:
        block = triton.next_power_of_2(dim)
        _ffn_tail_kernel[(h2.shape[0],)](
            mlp2, moe if moe is not None else h2, h2, norm_1 if moe is not None else post_norm,
            norm_2 if moe is not None else post_norm, post_norm, layer_scalar, next_norm, h_out, x_out,
            mlp2.stride(-2), stride_part, moe.stride(0) if moe is not None else 0, h2.stride(0),
            h_out.stride(0), x_out.stride(0), dim, eps,
            HAS_MOE=moe is not None, NUM_PARTS=mlp.shape[0] if parts else 0, UNIT_OFFSET=unit_offset,
            WEIGHT_FP32=weight_fp32, BLOCK=block, num_warps=4 if block <= 2048 and not parts else 8,
            **pdl_kwargs(h2),
        )
    return h_out.view(h.shape), x_out.view(h.shape)
