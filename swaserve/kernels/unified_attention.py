"""Batch-invariant attention for decode and extend alike (`unified_attention`): every query reads its
keys, cached prefix and this step's new tokens the same way, through the request table (and
`full_to_swa` for layers in the SWA pool), in key blocks aligned to absolute positions.

Why it is invariant: a query's logits and its softmax are reduced over the same aligned blocks in
the same order whatever else is in the batch, wherever the chunk boundaries fall and whether the
token is decoded or prefilled. Blocks a query cannot see (the tile's other queries may) are exact
no-ops of the online softmax (p = 0, rescale by exp2(0) = 1, or a still-empty state). Tiles and
launch settings depend only on the head dim and dtype. No split-K: one program owns a query's keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import (
    _block_d, _dot_rows, _finish, _online_step, _scores, dot_flags, interpret_mode, jit_per_batch,
)

BLOCK_M = 64  # rows of a tile: (token, query head of the kv head's group) pairs


@jit_per_batch("stride_qt", "stride_ot")
def _unified_kernel(
    q, out, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, qo_indptr, full_to_swa, sinks,
    qk_scale, softcap, window,
    stride_r2t, stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_MAP: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    TOKS: tl.constexpr = BLOCK_M // GROUP_P
    t0 = tl.program_id(2) * TOKS
    q_lo = tl.load(qo_indptr + b).to(tl.int64)
    ext = tl.load(qo_indptr + b + 1).to(tl.int64) - q_lo
    if t0 >= ext:
        return
    r = tl.arange(0, BLOCK_M)
    t = t0 + r // GROUP_P
    g = r % GROUP_P
    rmask = (t < ext) & (g < GROUP)
    heads = kvh * GROUP + g
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q_t = tl.load(q + (q_lo + t)[:, None] * stride_qt + heads[:, None] * stride_qh + dk[None, :],
                  mask=rmask[:, None] & (dk[None, :] < DK), other=0.0)
    q0 = tl.load(seq_lens + b).to(tl.int64) - ext  # position of the request's first new token
    q_pos = q0 + t
    row = tl.load(req_pool_indices + b).to(tl.int64)
    hi = q0 + tl.minimum(ext, t0 + TOKS) - 1  # the tile's last query
    lo = tl.zeros([], tl.int64)
    if HAS_WINDOW:
        lo = tl.maximum(q0 + t0 - window + 1, 0)  # the earliest key the tile's first query sees

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j0 in range(lo // BLOCK_N * BLOCK_N, hi + 1, BLOCK_N):
        kp = j0 + tl.arange(0, BLOCK_N)
        # Only keys some query of the tile sees are read: older SWA slots may be freed.
        kmask = (kp >= lo) & (kp <= hi)
        slot = tl.load(req_to_token + row * stride_r2t + kp, mask=kmask, other=0).to(tl.int64)
        if HAS_MAP:  # SWA-pool layer: prefix and new tokens alike through full_to_swa
            slot = tl.load(full_to_swa + slot, mask=kmask, other=0).to(tl.int64)
        k_t = tl.load(k_buf + slot[:, None] * stride_kt + kvh * stride_kh + dk[None, :],
                      mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
        s = _scores(_dot_rows(q_t, tl.trans(k_t.to(q_t.dtype)), UPCAST, PREC, ROWWISE), qk_scale, softcap, HAS_SOFTCAP)
        vis = rmask[:, None] & kmask[None, :] & (kp[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            vis = vis & (q_pos[:, None] - kp[None, :] < window)
        s = tl.where(vis, s, float("-inf"))
        p, alpha, m, l = _online_step(s, m, l)
        v_t = tl.load(v_buf + slot[:, None] * stride_vt + kvh * stride_vh + dv[None, :],
                      mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot_rows(p.to(q_t.dtype), v_t.to(q_t.dtype), UPCAST, PREC, ROWWISE)

    o = _finish(acc, m, l, sinks, heads, rmask, HAS_SINKS)
    tl.store(out + (q_lo + t)[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :],
             o.to(out.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))


def unified_config(block_d: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) by padded head dim and element size: a layer's constants,
    never the batch's. Wide heads and fp32 take narrower key blocks (shared memory)."""
    if block_d > 256 or (elem_bytes >= 4 and block_d > 128):
        return 32, 4, 2
    return 64, 4, 2


def unified_attention(
    q: torch.Tensor,  # [T, H, Dk]: this step's queries, request after request
    out: torch.Tensor,  # [T, H, Dv], written
    k_buf: torch.Tensor,  # [slots, Hkv, Dk]: the layer's pool, new tokens' K/V already stored
    v_buf: torch.Tensor,  # [slots, Hkv, Dv]
    req_to_token: torch.Tensor,  # [rows, max_context] int32: full-pool slots
    req_pool_indices: torch.Tensor,  # [bs] int: table rows (0 = padded row)
    seq_lens: torch.Tensor,  # [bs] int: tokens with K/V after this step
    qo_indptr: torch.Tensor,  # [bs+1] int: queries of request b are qo_indptr[b]..[b+1]-1 (decode: arange)
    scaling: float,
    *,
    max_extend_len: int,  # host int >= every request's query count (sets the grid; 1 for decode)
    window: int | None = None,  # W keys incl. the query; None = full attention
    full_to_swa: torch.Tensor | None = None,  # [full_size+2] int32: set for a layer in the SWA pool
    logit_softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [H] float
) -> torch.Tensor:
    """Query i of request b sits at `seq_lens[b] - n_b + i` and sees keys p-W+1 .. p (0 .. p without a
    window), read at `req_to_token[row_b, pos]` (translated by `full_to_swa` when given). Padded rows
    (row 0, seq_len 1) read slot 0 and give finite values. No host sync. Returns `out`."""
    T, H, DK = q.shape
    HKV, DV = k_buf.shape[1], v_buf.shape[2]
    bs = req_pool_indices.numel()
    assert H % HKV == 0 and out.shape == (T, H, DV) and k_buf.shape[2] == DK
    for t in (q, out, k_buf, v_buf):
        assert t.stride(2) == 1, "head dims must be contiguous"
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if T == 0 or bs == 0 or max_extend_len <= 0:
        return out
    group = H // HKV
    group_p = triton.next_power_of_2(group)
    assert group_p <= BLOCK_M, f"GQA group {group} wider than a tile"
    bdk, bdv = _block_d(DK), _block_d(DV)
    block_n, warps, stages = unified_config(max(bdk, bdv), q.element_size())
    upcast, prec = dot_flags(q.dtype)
    grid = (bs, HKV, triton.cdiv(max_extend_len, BLOCK_M // group_p))
    _unified_kernel[grid](
        q, out, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, qo_indptr,
        full_to_swa if full_to_swa is not None else seq_lens, sinks if sinks is not None else q,
        scaling, logit_softcap if logit_softcap else 1.0, window if window is not None else 0,
        req_to_token.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        GROUP=group, GROUP_P=group_p, DK=DK, DV=DV, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_DK=bdk, BLOCK_DV=bdv, HAS_WINDOW=window is not None, HAS_MAP=full_to_swa is not None,
        HAS_SOFTCAP=bool(logit_softcap), HAS_SINKS=sinks is not None, UPCAST=upcast, PREC=prec,
        ROWWISE=interpret_mode(), num_warps=warps, num_stages=stages,
    )
    return out
