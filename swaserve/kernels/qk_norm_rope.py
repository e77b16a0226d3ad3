"""Per-head q/k RMSNorm, rotary and the K/V pool write of one attention layer in a single launch,
in place on the merged qkv projection (`qk_norm_rope_store`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.norm import _weighted
from swaserve.kernels.pdl import pdl_enter, pdl_kwargs


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv, cos_ptr, sin_ptr, qw_ptr, kw_ptr, k_buf, v_buf, locs, loc_map,
    stride_t, stride_c, stride_kbt, stride_kbh, stride_vbt, stride_vbh, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, WEIGHT_FP32: tl.constexpr, HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # q heads, then k heads: contiguous in qkv, so one base formula serves both
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    ty = qkv.dtype.element_ty
    base = qkv + t * stride_t + h * (2 * HALF)
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    if HAS_NORM:
        if h < HQ:
            w_ptr = qw_ptr
        else:
            w_ptr = kw_ptr
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        # Rounded to the qkv dtype before the rotation, as the normed q/k tensor would be.
        x1 = _weighted(x1 * r, w1, ty, UNIT_OFFSET, WEIGHT_FP32)
        x2 = _weighted(x2 * r, w2, ty, UNIT_OFFSET, WEIGHT_FP32)
    # Rotary exactly as `_rotary_kernel`: cos/sin rounded to the dtype first, every op rounded.
    c = tl.load(cos_ptr + t * stride_c + offs, mask=mask, other=0.0).to(ty)
    s = tl.load(sin_ptr + t * stride_c + offs, mask=mask, other=0.0).to(ty)
    o1 = ((x1 * c).to(ty) - (x2 * s).to(ty)).to(ty)
    o2 = ((x2 * c).to(ty) + (x1 * s).to(ty)).to(ty)
    tl.store(base + offs, o1, mask=mask)
    tl.store(base + HALF + offs, o2, mask=mask)

    if h >= HQ:  # a kv head: also writes its rotated k and its v into the pool
        j = h - HQ
        loc = tl.load(locs + t).to(tl.int64)
        if HAS_MAP:
            # A -1 sentinel must stay -1 (and must not index the table from its end).
            loc = tl.load(loc_map + loc, mask=loc >= 0, other=-1).to(tl.int64)
        # Negative slots are skipped, never wrapped onto the pool's last slot (vllm#43810); written as a
        # limit, not `mask & (loc >= 0)`: scalar & vector masks break the 3.9 interpreter.
        ms = offs < tl.where(loc >= 0, HALF, 0)
        # int64 slot arithmetic: slot * stride overflows int32 on large pools (sglang#9344).
        kb = k_buf + loc * stride_kbt + j * stride_kbh
        tl.store(kb + offs, o1.to(k_buf.dtype.element_ty), mask=ms)
        tl.store(kb + HALF + offs, o2.to(k_buf.dtype.element_ty), mask=ms)
        vsrc = base + HKV * (2 * HALF)  # v head j sits HKV heads after k head j
        vb = v_buf + loc * stride_vbt + j * stride_vbh
        tl.store(vb + offs, tl.load(vsrc + offs, mask=ms).to(v_buf.dtype.element_ty), mask=ms)
        tl.store(vb + HALF + offs, tl.load(vsrc + HALF + offs, mask=ms).to(v_buf.dtype.element_ty), mask=ms)


def qk_norm_rope_store(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim], q|k|v; q and k rewritten in place
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,  # [T, head_dim / 2] float32 (attention scaling already applied)
    sin: torch.Tensor,  # [T, head_dim / 2] float32
    q_weight: torch.Tensor | None,  # [head_dim] per-head RMSNorm weight; None (with k_weight): rotary only
    k_weight: torch.Tensor | None,  # [head_dim]
    eps: float,
    k_buf: torch.Tensor,  # [slots, num_kv_heads, head_dim], pool dtype
    v_buf: torch.Tensor,  # [slots, num_kv_heads, head_dim], pool dtype
    locs: torch.Tensor,  # [T] int32/int64: slots of this pool (or keys of loc_map)
    *,
    unit_offset: bool = True,
    weight_fp32: bool = False,
    loc_map: torch.Tensor | None = None,  # e.g. full_to_swa [full_size+2] int32: slot = loc_map[locs]
) -> None:
    """q <- rotary(norm_q(q)), k <- rotary(norm_k(k)) in qkv, then k and v of token t go to slot
    `locs[t]` (or `loc_map[locs[t]]`) like `store_kv`; negative slots are skipped. The norm forms are
    `rms_norm`'s. No host sync; graph-capturable."""
    T = qkv.shape[0]
    assert (q_weight is None) == (k_weight is None), "q and k are normed together or not at all"
    assert q_weight is None or q_weight.dtype == k_weight.dtype, (q_weight.dtype, k_weight.dtype)
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0, qkv.shape
    assert qkv.stride(1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    assert k_buf.shape[1:] == (num_kv_heads, head_dim) and v_buf.shape[1:] == (num_kv_heads, head_dim)
    assert k_buf.stride(2) == 1 and v_buf.stride(2) == 1 and locs.shape == (T,) and locs.is_contiguous()
    if T == 0:
        return
    half = head_dim // 2
    _qk_norm_rope_store_kernel[(T, num_heads + num_kv_heads)](
        qkv, cos, sin, q_weight if q_weight is not None else cos, k_weight if k_weight is not None else cos,
        k_buf, v_buf, locs, loc_map if loc_map is not None else locs,
        qkv.stride(0), cos.stride(0), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), eps,
        HQ=num_heads, HKV=num_kv_heads, HALF=half, HAS_NORM=q_weight is not None, UNIT_OFFSET=unit_offset,
        WEIGHT_FP32=weight_fp32, HAS_MAP=loc_map is not None, BLOCK=triton.next_power_of_2(half),
        num_warps=1 if half <= 128 else 2, **pdl_kwargs(qkv),
    )
