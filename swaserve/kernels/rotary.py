"""Rotary embedding applied to q and k in one launch (rotate-half layout), from cos/sin tables
computed once per step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                   n_q_heads, n_k_heads, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    c = tl.load(cos_ptr + t * stride_c + offs, mask=mask, other=0.0)
    s = tl.load(sin_ptr + t * stride_c + offs, mask=mask, other=0.0)
    if h < n_q_heads:
        base = q_ptr + t * stride_qt + h * stride_qh
    else:
        base = k_ptr + t * stride_kt + (h - n_q_heads) * stride_kh
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    ty = x1.dtype
    # cos/sin are rounded to the q/k dtype first and the products rounded per op, as the torch form does.
    c = c.to(ty)
    s = s.to(ty)
    o1 = ((x1 * c).to(ty) - (x2 * s).to(ty)).to(ty)
    o2 = ((x2 * c).to(ty) + (x1 * s).to(ty)).to(ty)
    tl.store(base + offs, o1, mask=mask)
    tl.store(base + HALF + offs, o2, mask=mask)


def apply_rotary_(
    q: torch.Tensor,  # [T, Hq, D], rotated in place
    k: torch.Tensor,  # [T, Hk, D], rotated in place
    cos: torch.Tensor,  # [T, D/2] float32 (attention scaling already applied)
    sin: torch.Tensor,  # [T, D/2] float32
) -> None:
    T, hq, d = q.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and d % 2 == 0
    if T == 0:
        return
    half = d // 2
    _rotary_kernel[(T, hq + k.shape[1])](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), hq, k.shape[1],
        HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1 if half <= 128 else 2,
    )
