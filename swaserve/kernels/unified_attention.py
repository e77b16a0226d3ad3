"""Batch-invariant attention for decode and extend alike (`unified_attention`): every query reads its
keys, cached prefix and this step's new tokens the same way, through the request table (and
`full_to_swa` for layers in the SWA pool), in key blocks aligned to absolute positions.

Why it is invariant: a query's keys are cut into chunks of `key_chunk(max_context)` positions,
aligned to absolute positions (a constant of the engine, never of the batch). Each chunk's partial
softmax state is reduced from zero over the same aligned blocks in the same order, and the partials
are folded in chunk order (`_fold`). Decode steps compute the chunks in parallel programs and fold
them in a second kernel; extend steps fold them in one program, in registers: the same operations
on the same key blocks, so a query gets the same bits decoded or prefilled, whatever else is in the
batch and wherever the chunk boundaries of its prefill fall. A decode tile holds one token's query
heads (16 rows), an extend tile 64: every reduction along a row is therefore one that does not
depend on the tile's height or thread layout: the max (exact), and dot products on the MMA (q.k,
p.v, and the softmax's row sum as p times ones, `_row_sum`), whose rounding does not depend on the
instruction's M (measured per GPU with the GEMM, `bi_matmul`). Blocks and chunks a query cannot see
(the tile's other queries may) are exact no-ops (p = 0 and a rescale by exp2(0) = 1, or an empty
state that stays empty). Tiles and launch settings depend only on the head dim, GQA group, dtype and
layer kind.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import (
    _block_d, _dot_rows, _finish, _scores, dot_flags, interpret_mode, jit_per_batch,
)

BLOCK_M = 64  # rows of an extend tile: (token, query head of the kv head's group) pairs
DECODE_BLOCK_M = 16  # rows of a decode tile at least (one token's query heads, padded: the MMA's minimum)
MIN_CHUNK = 256  # keys per reduction chunk at least
MAX_CHUNKS = 32  # a full-attention layer's chunks at most (bounds the decode scratch)


def key_chunk(max_context: int) -> int:
    """Keys per reduction chunk: from the engine's max context only, so the same for every batch."""
    return max(MIN_CHUNK, triton.next_power_of_2(triton.cdiv(max_context, MAX_CHUNKS)))


@triton.jit
def _fold(M, L, ACC, m, l, acc):
    """The running softmax state (M, L, ACC) with one more chunk's partial (m, l, acc) added. An
    empty partial (m = -inf, l = acc = 0) leaves the state bit for bit; an empty state becomes the
    partial bit for bit."""
    m_new = tl.maximum(M, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(M - m_safe)
    b = tl.exp2(m - m_safe)
    return m_new, L * a + l * b, ACC * a[:, None] + acc * b[:, None]


@triton.jit
def _row_sum(p, UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr):
    """Row sums of p [R, N] in an order that depends on N only: a product with ones, one chain of
    MMAs along N like the kernel's other dots (a float32 p: an exact FMA chain), where `tl.sum`'s
    order follows the tile's thread layout, which changes with R (16-row decode, 64-row extend)."""
    ones = tl.full([p.shape[1], 16], 1.0, p.dtype)
    return tl.max(_dot_rows(p, ones, UPCAST, PREC, ROWWISE), axis=1)  # 16 equal columns


@triton.jit
def _chunk(q_t, k_buf, v_buf, req_to_token, full_to_swa, row, c, lo, hi, q_pos, rmask, kvh, dk, dv,
           qk_scale, softcap, window, stride_r2t, stride_kt, stride_kh, stride_vt, stride_vh,
           CHUNK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MAP: tl.constexpr,
           HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr):
    """Chunk c's partial softmax state of the tile's rows, from zero over its aligned key blocks that
    some row of the tile sees (keys lo..hi)."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    start = tl.maximum(c * CHUNK, lo // BLOCK_N * BLOCK_N)
    end = tl.minimum(c * CHUNK + CHUNK - 1, hi)
    for j0 in range(start, end + 1, BLOCK_N):
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
        # The online-softmax step, its row sum on the MMA (`_row_sum`): a row's bits do not depend
        # on how many rows its tile has (decode and extend tiles differ in height).
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None]).to(q_t.dtype)
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + _row_sum(p, UPCAST, PREC, ROWWISE)
        m = m_new
        v_t = tl.load(v_buf + slot[:, None] * stride_vt + kvh * stride_vh + dv[None, :],
                      mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot_rows(p, v_t.to(q_t.dtype), UPCAST, PREC, ROWWISE)
    return m, l, acc


@jit_per_batch("stride_qt", "stride_ot")
def _unified_kernel(
    q, out, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, qo_indptr, full_to_swa, sinks,
    part_acc, part_ml, qk_scale, softcap, window,
    stride_r2t, stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CHUNK: tl.constexpr, SPLIT: tl.constexpr, NC: tl.constexpr, H: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_MAP: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr,
):
    """SPLIT (decode, one token per request): program (b, kvh, s) writes chunk c_lo + s's partial to
    `part_acc` / `part_ml` ([T, H, NC, DV] / [T, H, NC, 2] float32) for `_merge_kernel`. Otherwise
    program (b, kvh, tile) folds every chunk of its tile and writes `out`."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    TOKS: tl.constexpr = BLOCK_M // GROUP_P
    if SPLIT:
        t0 = 0
    else:
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

    c_lo, c_hi = lo // CHUNK, hi // CHUNK
    if SPLIT:
        c = c_lo + tl.program_id(2)
        if c > c_hi:
            return
        m, l, acc = _chunk(q_t, k_buf, v_buf, req_to_token, full_to_swa, row, c, lo, hi, q_pos, rmask, kvh,
                           dk, dv, qk_scale, softcap, window, stride_r2t, stride_kt, stride_kh, stride_vt,
                           stride_vh, CHUNK, DK, DV, BLOCK_M, BLOCK_N, BLOCK_DV, HAS_WINDOW, HAS_MAP,
                           HAS_SOFTCAP, UPCAST, PREC, ROWWISE)
        part = ((q_lo + t) * H + heads) * NC + tl.program_id(2)  # [BLOCK_M] int64
        tl.store(part_acc + part[:, None] * DV + dv[None, :], acc,
                 mask=rmask[:, None] & (dv[None, :] < DV))
        tl.store(part_ml + part * 2, m, mask=rmask)
        tl.store(part_ml + part * 2 + 1, l, mask=rmask)
    else:
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        ACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for c in range(c_lo, c_hi + 1):
            m, l, acc = _chunk(q_t, k_buf, v_buf, req_to_token, full_to_swa, row, c, lo, hi, q_pos, rmask,
                               kvh, dk, dv, qk_scale, softcap, window, stride_r2t, stride_kt, stride_kh,
                               stride_vt, stride_vh, CHUNK, DK, DV, BLOCK_M, BLOCK_N, BLOCK_DV, HAS_WINDOW,
                               HAS_MAP, HAS_SOFTCAP, UPCAST, PREC, ROWWISE)
            M, L, ACC = _fold(M, L, ACC, m, l, acc)
        o = _finish(ACC, M, L, sinks, heads, rmask, HAS_SINKS)
        tl.store(out + (q_lo + t)[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :],
                 o.to(out.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))


@triton.jit
def _merge_kernel(
    out, part_acc, part_ml, seq_lens, sinks, window, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, NC: tl.constexpr, H: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Decode: request b's chunk partials folded in chunk order, on the main kernel's tile shape
    (so `_fold` runs the same operations as in an extend program)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    t = r // GROUP_P
    g = r % GROUP_P
    rmask = (t < 1) & (g < GROUP)
    heads = kvh * GROUP + g
    dv = tl.arange(0, BLOCK_DV)
    q_pos = tl.load(seq_lens + b).to(tl.int64) - 1
    lo = tl.zeros([], tl.int64)
    if HAS_WINDOW:
        lo = tl.maximum(q_pos - window + 1, 0)
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    ACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for s in range(0, q_pos // CHUNK - lo // CHUNK + 1):
        part = ((b + t.to(tl.int64)) * H + heads) * NC + s
        acc = tl.load(part_acc + part[:, None] * DV + dv[None, :], mask=rmask[:, None] & (dv[None, :] < DV),
                      other=0.0)
        m = tl.load(part_ml + part * 2, mask=rmask, other=float("-inf"))
        l = tl.load(part_ml + part * 2 + 1, mask=rmask, other=0.0)
        M, L, ACC = _fold(M, L, ACC, m, l, acc)
    o = _finish(ACC, M, L, sinks, heads, rmask, HAS_SINKS)
    tl.store(out + (b + t.to(tl.int64))[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :],
             o.to(out.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))


def unified_config(block_d: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) by padded head dim and element size: a layer's constants,
    never the batch's. Wide heads and fp32 take narrower key blocks (shared memory)."""
    if block_d > 256 or (elem_bytes >= 4 and block_d > 128):
        return 32, 4, 2
    return 64, 4, 2


def decode_config(group_p: int, sliding: bool) -> tuple[int, int, int]:
    """(rows, num_warps, num_stages) of a decode program: one token's query heads in the smallest
    tile the MMA takes; its key block is the extend tile's. A sliding layer's keys sit behind two
    gathers (table, then `full_to_swa`): a third stage in flight helps there, not in full layers
    (H100, benchmarks/results/h100_unified_attention_sweep.log)."""
    return max(DECODE_BLOCK_M, group_p), 4, 3 if sliding else 2


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
    chunk: int | None = None,  # keys per reduction chunk (default `key_chunk(max_context)`; tests)
    decode_launch: tuple[int, int, int] | None = None,  # (rows, warps, stages) of a decode program (sweeps)
) -> torch.Tensor:
    """Query i of request b sits at `seq_lens[b] - n_b + i` and sees keys p-W+1 .. p (0 .. p without a
    window), read at `req_to_token[row_b, pos]` (translated by `full_to_swa` when given). Padded rows
    (row 0, seq_len 1) read slot 0 and give finite values. A decode batch (`max_extend_len` 1) splits
    its keys over programs by chunk, and every launch setting depends on static shapes only, so it
    can be captured. No host sync. Returns `out`."""
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
    max_context = req_to_token.shape[1]
    chunk = chunk or key_chunk(max_context)
    assert chunk % block_n == 0, f"chunk {chunk} is not a multiple of the key block {block_n}"
    upcast, prec = dot_flags(q.dtype)
    split = max_extend_len == 1
    nc = 1
    part_acc = part_ml = out  # unused unless split
    if split:
        assert T == bs, "a decode batch has one query per request"
        nc = triton.cdiv(max_context, chunk)
        if window is not None:
            nc = min(nc, (window - 1) // chunk + 2)  # chunks a window can overlap
        part_acc = torch.empty(T, H, nc, DV, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(T, H, nc, 2, dtype=torch.float32, device=q.device)
    block_m = BLOCK_M
    if split:
        block_m, warps, stages = decode_launch or decode_config(group_p, window is not None)
    grid = (bs, HKV, nc if split else triton.cdiv(max_extend_len, BLOCK_M // group_p))
    const = dict(GROUP=group, GROUP_P=group_p, DV=DV, BLOCK_M=block_m, BLOCK_DV=bdv, CHUNK=chunk, NC=nc, H=H,
                 HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None)
    sinks_arg, window_arg = sinks if sinks is not None else q, window if window is not None else 0
    _unified_kernel[grid](
        q, out, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, qo_indptr,
        full_to_swa if full_to_swa is not None else seq_lens, sinks_arg, part_acc, part_ml,
        scaling, logit_softcap if logit_softcap else 1.0, window_arg,
        req_to_token.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        DK=DK, BLOCK_N=block_n, BLOCK_DK=bdk, SPLIT=split, HAS_MAP=full_to_swa is not None,
        HAS_SOFTCAP=bool(logit_softcap), UPCAST=upcast, PREC=prec, ROWWISE=interpret_mode(), **const,
        num_warps=warps, num_stages=stages,
    )
    if split:
        _merge_kernel[(bs, HKV)](out, part_acc, part_ml, seq_lens, sinks_arg, window_arg, out.stride(0),
                                 out.stride(1), **const, num_warps=warps)
    return out
