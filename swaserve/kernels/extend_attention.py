"""Prefill/extend attention (`extend_attention`): new tokens attend a cached prefix through its
index list and each other directly from the new K/V, with causal and sliding-window masks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import _block_d, _dot, _finish, _online_step, _scores, dot_flags
from swaserve.kernels.kv_quant import kv_scale_args


@triton.jit
def _extend_kernel(
    q, k_new, v_new, out, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, prefix_lens, prefix_start,
    sinks, k_scale, v_scale, qk_scale, softcap, window,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_PSTART: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, KV_FP8: tl.constexpr,
):
    if KV_FP8:  # e4m3 K (prefix and new tokens alike): its scale folds into the logits'
        qk_scale = qk_scale * tl.load(k_scale)
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // GROUP
    q_lo = tl.load(qo_indptr + b).to(tl.int64)
    ext = tl.load(qo_indptr + b + 1).to(tl.int64) - q_lo
    m0 = mb * BLOCK_M
    if m0 >= ext:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    mmask = offs_m < ext
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q_t = tl.load(q + (q_lo + offs_m)[:, None] * stride_qt + h * stride_qh + dk[None, :],
                  mask=mmask[:, None] & (dk[None, :] < DK), other=0.0)
    plen = tl.load(prefix_lens + b).to(tl.int64)
    kv_lo = tl.load(kv_indptr + b).to(tl.int64)
    npre = tl.load(kv_indptr + b + 1).to(tl.int64) - kv_lo
    # Prefix list entry j holds position pstart + j; the builder's list ends at plen - 1.
    if HAS_PSTART:
        pstart = tl.load(prefix_start + b).to(tl.int64)
    else:
        pstart = plen - npre
    q_pos = plen + offs_m  # absolute positions of this block's queries

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Part 1: the cached prefix. With a window, skip entries no query of this block can see.
    j_lo = tl.zeros([], tl.int64)
    if HAS_WINDOW:
        j_lo = tl.maximum(plen + m0 - window + 1 - pstart, 0)
    for j0 in range(j_lo, npre, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < npre
        slot = tl.load(kv_indices + kv_lo + offs_n, mask=nmask, other=0).to(tl.int64)
        k_t = tl.load(k_buf + slot[:, None] * stride_kt + kvh * stride_kh + dk[None, :],
                      mask=nmask[:, None] & (dk[None, :] < DK), other=0.0)
        s = _scores(_dot(q_t, tl.trans(k_t.to(q_t.dtype)), UPCAST, PREC), qk_scale, softcap, HAS_SOFTCAP)
        vis = nmask[None, :] & mmask[:, None]
        if HAS_WINDOW:
            vis = vis & (q_pos[:, None] - (pstart + offs_n)[None, :] < window)
        s = tl.where(vis, s, float("-inf"))
        p, alpha, m, l = _online_step(s, m, l)
        v_t = tl.load(v_buf + slot[:, None] * stride_vt + kvh * stride_vh + dv[None, :],
                      mask=nmask[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(q_t.dtype), v_t.to(q_t.dtype), UPCAST, PREC)

    # Part 2: the new tokens, causal (key j <= query i) and windowed (i - j < W).
    n_lo = tl.zeros([], tl.int64)
    if HAS_WINDOW:
        n_lo = tl.maximum(m0 - window + 1, 0)
    n_hi = tl.minimum(ext, m0 + BLOCK_M)
    for j0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < n_hi
        k_t = tl.load(k_new + (q_lo + offs_n)[:, None] * stride_knt + kvh * stride_knh + dk[None, :],
                      mask=nmask[:, None] & (dk[None, :] < DK), other=0.0)
        s = _scores(_dot(q_t, tl.trans(k_t.to(q_t.dtype)), UPCAST, PREC), qk_scale, softcap, HAS_SOFTCAP)
        vis = nmask[None, :] & mmask[:, None] & (offs_n[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            vis = vis & (offs_m[:, None] - offs_n[None, :] < window)
        s = tl.where(vis, s, float("-inf"))
        p, alpha, m, l = _online_step(s, m, l)
        v_t = tl.load(v_new + (q_lo + offs_n)[:, None] * stride_vnt + kvh * stride_vnh + dv[None, :],
                      mask=nmask[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(q_t.dtype), v_t.to(q_t.dtype), UPCAST, PREC)

    if KV_FP8:  # e4m3 V
        acc = acc * tl.load(v_scale)
    o = _finish(acc, m, l, sinks, h + tl.zeros([BLOCK_M], tl.int32), mmask, HAS_SINKS)
    tl.store(out + (q_lo + offs_m)[:, None] * stride_ot + h * stride_oh + dv[None, :],
             o.to(out.dtype.element_ty), mask=mmask[:, None] & (dv[None, :] < DV))


def _default_config(block_d: int, elem_bytes: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by padded head dim, from an H100 sweep (triton 3.6,
    bf16, 4k-token prefill): d64 240 TFLOP/s, d256 228 (vs 114 at 32/32/4 warps), d512 126.
    fp32 tiles take twice the shared memory: halve them past d128 (d256 fp32 at 128x64 needs 295 KB)."""
    if elem_bytes >= 4 and block_d > 128:
        return (64, 32, 4, 2) if block_d <= 256 else (32, 32, 4, 2)
    if block_d <= 128:
        return 64, 64, 4, 3
    if block_d <= 256:
        return 128, 64, 8, 2
    return 64, 32, 8, 2


def extend_attention(
    q: torch.Tensor,  # [T, H, Dk], device: new tokens, request after request
    k_new: torch.Tensor,  # [T, Hkv, Dk]: K of the new tokens
    v_new: torch.Tensor,  # [T, Hkv, Dv]
    out: torch.Tensor,  # [T, H, Dv], written
    k_buf: torch.Tensor,  # [slots, Hkv, Dk]: the layer's pool, in the prefix list's index space
    v_buf: torch.Tensor,  # [slots, Hkv, Dv]
    qo_indptr: torch.Tensor,  # [bs+1] int, device: new tokens of request b are qo_indptr[b]..[b+1]-1
    kv_indptr: torch.Tensor,  # [bs+1] int, device: prefix lists (CSR)
    kv_indices: torch.Tensor,  # [>= kv_indptr[bs]] int, device: prefix slots, oldest first
    prefix_lens: torch.Tensor,  # [bs] int, device: cached tokens before the new ones
    scaling: float,
    *,
    max_extend_len: int,  # host int, >= every request's new-token count (sets the grid)
    window: int | None = None,  # W keys incl. the query itself; None = full attention
    logit_softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [H] float: per-head sink logit
    prefix_start: torch.Tensor | None = None,  # [bs] int: position of each list's first entry
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,  # [1] float32, device: an FP8 (e4m3) pool's scales (both or neither)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """New token i of request b sits at position `p = prefix_lens[b] + i` and sees new key j iff
    `j <= i` (and `i - j < W`), and prefix entry j (position `prefix_start[b] + j`) iff `p - pos < W`
    (always without a window). `prefix_start` defaults to `prefix_lens - list length`, which is right
    for lists from `build_kv_indices` (they end at `prefix_len - 1`). Every query sees at least itself,
    so no row is empty. An FP8 pool reads as `k8 * k_scale`, `v8 * v_scale`; `k_new`/`v_new` are then
    e4m3 too, the new tokens' rows as the pool stores them, so every key is read the way a later step
    reads it. Returns `out`.
    """
    T, H, DK = q.shape
    HKV, DV = k_new.shape[1], v_new.shape[2]
    bs = prefix_lens.numel()
    assert H % HKV == 0 and k_new.shape == (T, HKV, DK) and v_new.shape == (T, HKV, DV)
    assert out.shape == (T, H, DV) and k_buf.shape[1:] == (HKV, DK) and v_buf.shape[1:] == (HKV, DV)
    for t in (q, k_new, v_new, out, k_buf, v_buf):
        assert t.stride(2) == 1, "head dims must be contiguous"
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    ks, vs, fp8 = kv_scale_args(k_buf, k_scale, v_scale, q)
    assert k_new.dtype == v_new.dtype and (k_new.dtype == k_buf.dtype or not fp8), "FP8 pool: e4m3 new K/V"
    if T == 0 or bs == 0 or max_extend_len <= 0:
        return out
    bdk, bdv = _block_d(DK), _block_d(DV)
    bm, bn, warps, stages = _default_config(max(bdk, bdv), q.element_size())
    block_m, block_n = block_m or bm, block_n or bn
    upcast, prec = dot_flags(q.dtype)
    kw = {"num_warps": num_warps or warps, "num_stages": num_stages or stages}
    grid = (bs, H, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_new, v_new, out, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, prefix_lens,
        prefix_start if prefix_start is not None else prefix_lens,
        sinks if sinks is not None else q, ks, vs, scaling, logit_softcap if logit_softcap else 1.0,
        window if window is not None else 0,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        out.stride(0), out.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        GROUP=H // HKV, DK=DK, DV=DV, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DK=bdk, BLOCK_DV=bdv,
        HAS_WINDOW=window is not None, HAS_PSTART=prefix_start is not None,
        HAS_SOFTCAP=bool(logit_softcap), HAS_SINKS=sinks is not None, UPCAST=upcast, PREC=prec, KV_FP8=fp8, **kw,
    )
    return out
