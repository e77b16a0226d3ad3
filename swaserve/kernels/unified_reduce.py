"""How `unified_attention` reduces a query's keys, in one order fixed by absolute positions and the
engine's `max_context` alone: keys in blocks of BLOCK_N (each block's softmax state from zero),
blocks folded into chunks of `key_chunk` keys (`_fold`, from an empty state), chunks folded into
the result in chunk order.

The two levels let a decode step take its parallelism where the batch leaves room without changing
a bit: a program may compute one key block (a few requests: many small programs) or one whole
chunk (many requests), and `_merge_kernel` folds the partials in the order an extend program folds
them in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from swaserve.kernels.common import _dot_rows, _finish, _scores
from swaserve.kernels.kv_quant import _e4m3_tile

MIN_CHUNK = 256  # keys per reduction chunk at least
MAX_CHUNKS = 32  # a full-attention layer's chunks at most (bounds the decode scratch)


def key_chunk(max_context: int) -> int:
    """Keys per reduction chunk: from the engine's max context only, so the same for every batch."""
    return max(MIN_CHUNK, triton.next_power_of_2(triton.cdiv(max_context, MAX_CHUNKS)))


@triton.jit
def _fold(M, L, ACC, m, l, acc):
    """The running softmax state (M, L, ACC) with one more partial (m, l, acc) added. An empty
    partial (m = -inf, l = acc = 0) leaves the state bit for bit; an empty state becomes the
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
def _block(q_t, k_buf, v_buf, req_to_token, full_to_swa, row, pos0, j0, lo, hi, q_pos, rmask, kvh, dk, dv, qk_scale,
           softcap, window, stride_r2t, stride_kt, stride_kh, stride_vt, stride_vh, DK: tl.constexpr,
           DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MAP: tl.constexpr,
           HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr,
           E4M3_ASM: tl.constexpr):
    """The softmax state (m, l, acc) of the key block at positions j0 .. j0 + BLOCK_N - 1, from zero, over the
    keys lo..hi the tile sees. Position p's slot is `req_to_token[row, p - pos0]` (a request table, or a
    decode step's window slot table)."""
    kp = j0 + tl.arange(0, BLOCK_N)
    # Only keys some query of the tile sees are read: older SWA slots may be freed.
    kmask = (kp >= lo) & (kp <= hi)
    slot = tl.load(req_to_token + row * stride_r2t + (kp - pos0), mask=kmask, other=0).to(tl.int64)
    if HAS_MAP:  # SWA-pool layer: prefix and new tokens alike through full_to_swa
        slot = tl.load(full_to_swa + slot, mask=kmask, other=0).to(tl.int64)
    k_t = tl.load(k_buf + slot[:, None] * stride_kt + kvh * stride_kh + dk[None, :],
                  mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
    v_t = tl.load(v_buf + slot[:, None] * stride_vt + kvh * stride_vh + dv[None, :],
                  mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
    s = _scores(_dot_rows(q_t, tl.trans(_e4m3_tile(k_t, q_t.dtype, E4M3_ASM)), UPCAST, PREC, ROWWISE),
                qk_scale, softcap, HAS_SOFTCAP)
    vis = rmask[:, None] & kmask[None, :] & (kp[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        vis = vis & (q_pos[:, None] - kp[None, :] < window)
    s = tl.where(vis, s, float("-inf"))
    # The block's state from zero, its row sum on the MMA (`_row_sum`): a row's bits do not
    # depend on how many rows its tile has (decode and extend tiles differ in height).
    m = tl.max(s, axis=1)
    p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None]).to(q_t.dtype)
    l = _row_sum(p, UPCAST, PREC, ROWWISE)
    acc = _dot_rows(p, _e4m3_tile(v_t, q_t.dtype, E4M3_ASM), UPCAST, PREC, ROWWISE)
    return m, l, acc


@triton.jit
def _keys(q_t, k_buf, v_buf, req_to_token, full_to_swa, row, pos0, first, last, lo, hi, q_pos, rmask, kvh, dk,
          dv, qk_scale, softcap, window, stride_r2t, stride_kt, stride_kh, stride_vt, stride_vh,
          DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_DV: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MAP: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
          UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr, E4M3_ASM: tl.constexpr):
    """The tile's softmax state over the aligned key blocks of positions first..last that some row
    sees (keys lo..hi): each block's state from zero (`_block`), folded in block order. One block's
    state is the block's partial bit for bit (an empty state takes a partial exactly)."""
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    ACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    start = tl.maximum(first, lo // BLOCK_N * BLOCK_N)
    end = tl.minimum(last, hi)
    for j0 in range(start, end + 1, BLOCK_N):
        m, l, acc = _block(q_t, k_buf, v_buf, req_to_token, full_to_swa, row, pos0, j0, lo, hi, q_pos, rmask, kvh,
                           dk, dv, qk_scale, softcap, window, stride_r2t, stride_kt, stride_kh, stride_vt, stride_vh,
                           DK, DV, BLOCK_N, HAS_WINDOW, HAS_MAP, HAS_SOFTCAP, UPCAST, PREC, ROWWISE, E4M3_ASM)
        M, L, ACC = _fold(M, L, ACC, m, l, acc)
    return M, L, ACC


@triton.jit
def _keys_flat(q_t, k_buf, v_buf, req_to_token, full_to_swa, row, pos0, lo, hi, q_pos, rmask, kvh, dk, dv,
               qk_scale, softcap, window, stride_r2t, stride_kt, stride_kh, stride_vt, stride_vh,
               DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MAP: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr,
               E4M3_ASM: tl.constexpr):
    """An extend program's whole reduction (keys lo..hi) as one loop over its key blocks: each block's state
    (`_block`) folded into its chunk's state, the chunk's state folded into the result at the chunk's last
    block (or the tile's). The same folds in the same order as `_keys` per chunk then `_fold` per chunk, so
    the same bits (a chunk no block of which is visited is an empty fold either way); one loop lets the
    compiler keep the next block's K/V loading across a chunk's end (`unified_launch.flat_extend`)."""
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    ACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    CM, CL, CACC = M, L, ACC  # the chunk's state
    for j0 in range(lo // BLOCK_N * BLOCK_N, hi + 1, BLOCK_N):
        m, l, acc = _block(q_t, k_buf, v_buf, req_to_token, full_to_swa, row, pos0, j0, lo, hi, q_pos, rmask, kvh,
                           dk, dv, qk_scale, softcap, window, stride_r2t, stride_kt, stride_kh, stride_vt, stride_vh,
                           DK, DV, BLOCK_N, HAS_WINDOW, HAS_MAP, HAS_SOFTCAP, UPCAST, PREC, ROWWISE, E4M3_ASM)
        CM, CL, CACC = _fold(CM, CL, CACC, m, l, acc)
        if ((j0 + BLOCK_N) % CHUNK == 0) | (j0 + BLOCK_N > hi):  # the chunk's (or the tile's) last block
            M, L, ACC = _fold(M, L, ACC, CM, CL, CACC)
            CM = tl.full([BLOCK_M], float("-inf"), tl.float32)
            CL = tl.zeros([BLOCK_M], tl.float32)
            CACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    return M, L, ACC


@triton.jit
def _merge_kernel(
    out, part_acc, part_ml, seq_lens, qo_indptr, sinks, v_scale, window, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, UNIT: tl.constexpr, NP: tl.constexpr, H: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Decode: request b's partials (one per UNIT keys: a chunk, or a key block) folded in the order
    an extend program folds them (blocks into their chunk, chunks into the result), on the decode
    tile's rows, in one flat loop (its loads pipelined); program (b, kvh, d) takes BLOCK_DV of the
    value columns (the fold is elementwise in them). `KV_FP8`: the folded result times V's scale, as
    the extend program does it. Request b's one query is token `qo_indptr[b]`; a request with more (a
    mixed step's prefill, in a captured extend step) or none (padding) is not a decode row: no work."""
    b = tl.program_id(0)
    q_lo = tl.load(qo_indptr + b).to(tl.int64)
    if tl.load(qo_indptr + b + 1) - q_lo != 1:
        return
    kvh = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    t = r // GROUP_P
    g = r % GROUP_P
    rmask = (t < 1) & (g < GROUP)
    heads = kvh * GROUP + g
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    cmask = rmask[:, None] & (dv[None, :] < DV)
    q_pos = tl.load(seq_lens + b).to(tl.int64) - 1
    lo = tl.zeros([], tl.int64)
    if HAS_WINDOW:
        lo = tl.maximum(q_pos - window + 1, 0)
    NSUB: tl.constexpr = CHUNK // UNIT  # partials per chunk
    u_lo = lo // UNIT
    base = lo // CHUNK * NSUB  # the first partial's unit
    row = (b + t.to(tl.int64)) * H + heads
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    ACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    CM = tl.full([BLOCK_M], float("-inf"), tl.float32)
    CL = tl.zeros([BLOCK_M], tl.float32)
    CACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for u in range(u_lo, q_pos // UNIT + 1):
        part = row * NP + (u - base)
        acc = tl.load(part_acc + part[:, None] * DV + dv[None, :], mask=cmask, other=0.0)
        m = tl.load(part_ml + part * 2, mask=rmask, other=float("-inf"))
        l = tl.load(part_ml + part * 2 + 1, mask=rmask, other=0.0)
        if NSUB == 1:
            M, L, ACC = _fold(M, L, ACC, m, l, acc)
        else:
            CM, CL, CACC = _fold(CM, CL, CACC, m, l, acc)
            if ((u + 1) % NSUB == 0) | (u == q_pos // UNIT):  # the chunk's last block: into the result
                M, L, ACC = _fold(M, L, ACC, CM, CL, CACC)
                CM = tl.full([BLOCK_M], float("-inf"), tl.float32)
                CL = tl.zeros([BLOCK_M], tl.float32)
                CACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if KV_FP8:
        ACC = ACC * tl.load(v_scale)
    o = _finish(ACC, M, L, sinks, heads, rmask, HAS_SINKS)
    tl.store(out + (q_lo + t)[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :],
             o.to(out.dtype.element_ty), mask=cmask)
