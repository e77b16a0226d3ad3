"""Per-head q/k RMSNorm, rotary and the K/V pool write of one attention layer in a single launch,
in place on the merged qkv projection (`qk_norm_rope_store`), including Gemma 4's forms: V normed
without weight, V taken from the raw key projection (k_eq_v), and q only (KV-shared layers)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import interpret_mode
from swaserve.kernels.kv_quant import _load_scale, _to_pool, kv_scale_args
from swaserve.kernels.norm import _weighted
from swaserve.kernels.pdl import pdl_enter, pdl_kwargs


@triton.jit
def _inv_rms(x1, x2, eps, HALF: tl.constexpr):
    """1 / rms of one head given its two float32 halves (eps inside the root)."""
    return tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv, cos_ptr, sin_ptr, qw_ptr, kw_ptr, k_buf, v_buf, locs, loc_map, k_scale, v_scale,
    stride_t, stride_c, stride_kbt, stride_kbh, stride_vbt, stride_vbh, eps, v_eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, WEIGHT_FP32: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_KV: tl.constexpr, V_NORM: tl.constexpr, V_FROM_K: tl.constexpr,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr, FP8: tl.constexpr, EMULATE: tl.constexpr,
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
    if V_FROM_K:  # k_eq_v: V is the raw key projection, before k's norm and rotation
        v1 = x1
        v2 = x2
    if HAS_NORM:
        if h < HQ:
            w_ptr = qw_ptr
        else:
            w_ptr = kw_ptr
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        r = _inv_rms(x1, x2, eps, HALF)
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

    if HAS_KV:
        if h >= HQ:  # a kv head: also writes its rotated k and its v into the pool
            j = h - HQ
            if not V_FROM_K:
                vsrc = base + HKV * (2 * HALF)  # v head j sits HKV heads after k head j
                v1 = tl.load(vsrc + offs, mask=mask, other=0.0)
                v2 = tl.load(vsrc + HALF + offs, mask=mask, other=0.0)
            if V_NORM:  # RMSNorm without weight: x * rsqrt(mean(x^2) + eps), rounded to the dtype
                v1 = v1.to(tl.float32)
                v2 = v2.to(tl.float32)
                rv = _inv_rms(v1, v2, v_eps, HALF)
                v1 = (v1 * rv).to(ty)
                v2 = (v2 * rv).to(ty)
                if not V_FROM_K:  # the v slice of qkv then holds the V attention reads, as q and k do
                    tl.store(vsrc + offs, v1, mask=mask)
                    tl.store(vsrc + HALF + offs, v2, mask=mask)
            loc = tl.load(locs + t).to(tl.int64)
            if HAS_MAP:
                # A -1 sentinel must stay -1 (and must not index the table from its end).
                loc = tl.load(loc_map + loc, mask=loc >= 0, other=-1).to(tl.int64)
            # Negative slots are skipped, never wrapped onto the pool's last slot (vllm#43810); written as
            # a limit, not `mask & (loc >= 0)`: scalar & vector masks break the 3.9 interpreter.
            ms = offs < tl.where(loc >= 0, HALF, 0)
            # int64 slot arithmetic: slot * stride overflows int32 on large pools (sglang#9344).
            # FP8 pools: the values just rounded to qkv's dtype (what the unfused path stores), quantised.
            ks = _load_scale(k_scale, FP8)
            vs = _load_scale(v_scale, FP8)
            kb = k_buf + loc * stride_kbt + j * stride_kbh
            tl.store(kb + offs, _to_pool(o1, k_buf, ks, FP8, EMULATE), mask=ms)
            tl.store(kb + HALF + offs, _to_pool(o2, k_buf, ks, FP8, EMULATE), mask=ms)
            vb = v_buf + loc * stride_vbt + j * stride_vbh
            tl.store(vb + offs, _to_pool(v1, v_buf, vs, FP8, EMULATE), mask=ms)
            tl.store(vb + HALF + offs, _to_pool(v2, v_buf, vs, FP8, EMULATE), mask=ms)


def qk_norm_rope_store(
    qkv: torch.Tensor,  # [T, width]: q|k|v, q|k (v_from_k) or q (k_buf None); q/k (and normed v) in place
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,  # [T, head_dim / 2] float32 (attention scaling already applied)
    sin: torch.Tensor,  # [T, head_dim / 2] float32
    q_weight: torch.Tensor | None,  # [head_dim] per-head RMSNorm weight; None (with k_weight): rotary only
    k_weight: torch.Tensor | None,  # [head_dim]; None when q_weight is, or when k_buf is (q only)
    eps: float,
    k_buf: torch.Tensor | None,  # [slots, num_kv_heads, head_dim], pool dtype; None: q only, no store
    v_buf: torch.Tensor | None,  # [slots, num_kv_heads, head_dim], pool dtype
    locs: torch.Tensor | None,  # [T] int32/int64: slots of this pool (or keys of loc_map)
    *,
    unit_offset: bool = True,
    weight_fp32: bool = False,
    loc_map: torch.Tensor | None = None,  # e.g. full_to_swa [full_size+2] int32: slot = loc_map[locs]
    v_norm: bool = False,
    v_from_k: bool = False,
    v_eps: float | None = None,  # the V norm's eps (default: eps)
    k_scale: torch.Tensor | None = None,  # [1] float32, device: an FP8 pool's scales (both or neither)
    v_scale: torch.Tensor | None = None,
) -> None:
    """q <- rotary(norm_q(q)), k <- rotary(norm_k(k)) in qkv, then k and v of token t go to slot
    `locs[t]` (or `loc_map[locs[t]]`) like `store_kv`; negative slots are skipped. The q/k norm forms
    are `rms_norm`'s. No host sync; graph-capturable.

    Gemma 4's forms: `v_norm` stores `v * rsqrt(mean(v^2) + v_eps)` (rounded to qkv's dtype) and writes
    it back to qkv's v slice; `v_from_k` (k_eq_v) means qkv holds only q|k `[T, (H + Hkv) * D]` and the
    stored V is the raw k before its norm and rotation (normed with `v_norm`); only qkv's k slice then
    holds the rotated K, and V exists only in the pool. `k_buf=None` (KV-shared layers): qkv holds q
    `[T, H * D]`, normed and rotated in place, nothing stored. An FP8 (e4m3) pool stores K and V as
    `store_kv` does: divided by their scales, clamped to +-448.
    """
    T = qkv.shape[0]
    has_kv = k_buf is not None
    if has_kv:
        assert v_buf is not None and locs is not None
        assert (q_weight is None) == (k_weight is None), "q and k are normed together or not at all"
        assert k_buf.shape[1:] == (num_kv_heads, head_dim) and v_buf.shape[1:] == (num_kv_heads, head_dim)
        assert k_buf.stride(2) == 1 and v_buf.stride(2) == 1 and locs.shape == (T,) and locs.is_contiguous()
        width = (num_heads + num_kv_heads * (1 if v_from_k else 2)) * head_dim
    else:
        assert v_buf is None and locs is None and loc_map is None and not (v_norm or v_from_k), "q only"
        width = num_heads * head_dim
    assert q_weight is None or k_weight is None or q_weight.dtype == k_weight.dtype, (q_weight.dtype, k_weight.dtype)
    assert qkv.shape[1] == width and head_dim % 2 == 0, (qkv.shape, width)
    assert qkv.stride(1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    ks, vs, fp8 = kv_scale_args(k_buf, k_scale, v_scale, cos) if has_kv else (cos, cos, False)
    if T == 0:
        return
    half = head_dim // 2
    _qk_norm_rope_store_kernel[(T, num_heads + (num_kv_heads if has_kv else 0))](
        # A missing k weight (q only) is passed as the q weight: both branches of the kernel's weight
        # select must have one pointer type when compiled (the interpreter does not check).
        qkv, cos, sin, q_weight if q_weight is not None else cos,
        k_weight if k_weight is not None else (q_weight if q_weight is not None else cos),
        k_buf if has_kv else qkv, v_buf if has_kv else qkv, locs if has_kv else cos,
        loc_map if loc_map is not None else (locs if has_kv else cos), ks, vs,
        qkv.stride(0), cos.stride(0), k_buf.stride(0) if has_kv else 0, k_buf.stride(1) if has_kv else 0,
        v_buf.stride(0) if has_kv else 0, v_buf.stride(1) if has_kv else 0, eps, eps if v_eps is None else v_eps,
        HQ=num_heads, HKV=num_kv_heads, HALF=half, HAS_NORM=q_weight is not None, UNIT_OFFSET=unit_offset,
        WEIGHT_FP32=weight_fp32, HAS_MAP=loc_map is not None, HAS_KV=has_kv, V_NORM=v_norm, V_FROM_K=v_from_k,
        BLOCK=triton.next_power_of_2(half), num_warps=1 if half <= 128 else 2, FP8=fp8,
        EMULATE=fp8 and interpret_mode(), **pdl_kwargs(qkv),
    )
