"""How `unified_attention` reduces a query's keys, in one order fixed by absolute positions and the
engine's `max_context` alone: keys in blocks of BLOCK_N, blocks in pieces of `key_piece` keys (an
online softmax from zero), pieces folded into chunks of `key_chunk` keys (`_fold` from an empty
state), chunks folded into the result in chunk order.

The three levels exist so that a decode step can take its parallelism where the batch leaves room,
without changing a bit: a program may compute one piece (few requests: many small programs) or one
whole chunk (many requests), and `_merge_kernel` folds the partials in the same order that an
extend program folds them in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from swaserve.kernels.common import _dot_rows, _finish, _scores

MIN_CHUNK = 256  # keys per reduction chunk at least
MAX_CHUNKS = 32  # a full-attention layer's chunks at most (bounds the decode scratch)
PIECES = 4  # pieces per chunk at most (a piece is at least one key block)


def key_chunk(max_context: int) -> int:
    """Keys per reduction chunk: from the engine's max context only, so the same for every batch."""
    return max(MIN_CHUNK, triton.next_power_of_2(triton.cdiv(max_context, MAX_CHUNKS)))


def key_piece(chunk: int, block_n: int) -> int:
    """Keys per piece of a chunk: a quarter chunk, at least one key block (a layer constant)."""
    return max(block_n, chunk // PIECES)


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
def _keys(q_t, k_buf, v_buf, req_to_token, full_to_swa, row, first, last, lo, hi, q_pos, rmask, kvh, dk, dv,
          qk_scale, softcap, window, stride_r2t, stride_kt, stride_kh, stride_vt, stride_vh,
          PIECE: tl.constexpr, FOLD_PIECES: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_WINDOW: tl.constexpr,
          HAS_MAP: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
          ROWWISE: tl.constexpr):
    """The tile's partial softmax state over the aligned key blocks of positions first..last that
    some row sees (keys lo..hi): one piece's online softmax from zero, or (`FOLD_PIECES`) a chunk:
    each piece's state folded into the chunk's at the piece's end, in one pipelined loop."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    CM = tl.full([BLOCK_M], float("-inf"), tl.float32)
    CL = tl.zeros([BLOCK_M], tl.float32)
    CACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    start = tl.maximum(first, lo // BLOCK_N * BLOCK_N)
    end = tl.minimum(last, hi)
    for j0 in range(start, end + 1, BLOCK_N):
        kp = j0 + tl.arange(0, BLOCK_N)
        # Only keys some query of the tile sees are read: older SWA slots may be freed.
        kmask = (kp >= lo) & (kp <= hi)
        slot = tl.load(req_to_token + row * stride_r2t + kp, mask=kmask, other=0).to(tl.int64)
        if HAS_MAP:  # SWA-pool layer: prefix and new tokens alike through full_to_swa
            slot = tl.load(full_to_swa + slot, mask=kmask, other=0).to(tl.int64)
        k_t = tl.load(k_buf + slot[:, None] * stride_kt + kvh * stride_kh + dk[None, :],
                      mask=kmask[:, None] & (dk[None, :] < DK), other=0.0)
        s = _scores(_dot_rows(q_t, tl.trans(k_t.to(q_t.dtype)), UPCAST, PREC, ROWWISE), qk_scale, softcap,
                    HAS_SOFTCAP)
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
        if FOLD_PIECES:
            if PIECE == BLOCK_N:  # every block is a piece
                CM, CL, CACC = _fold(CM, CL, CACC, m, l, acc)
                m = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            elif ((j0 + BLOCK_N) % PIECE == 0) | (j0 + BLOCK_N > end):
                CM, CL, CACC = _fold(CM, CL, CACC, m, l, acc)
                m = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if FOLD_PIECES:
        return CM, CL, CACC
    return m, l, acc


@triton.jit
def _merge_kernel(
    out, part_acc, part_ml, seq_lens, sinks, window, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, PIECE: tl.constexpr, PER_PIECE: tl.constexpr,
    NP: tl.constexpr, H: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Decode: request b's partials (one per chunk, or `PER_PIECE` one per piece) folded in the
    order an extend program folds them (pieces into their chunk, chunks into the result), on the
    decode tile's rows; program (b, kvh, d) takes BLOCK_DV of the value columns (the fold is
    elementwise in them)."""
    b = tl.program_id(0)
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
    NSUB: tl.constexpr = CHUNK // PIECE
    c_lo = lo // CHUNK
    row = (b + t.to(tl.int64)) * H + heads
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    ACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for c in range(c_lo, q_pos // CHUNK + 1):
        if PER_PIECE:
            CM = tl.full([BLOCK_M], float("-inf"), tl.float32)
            CL = tl.zeros([BLOCK_M], tl.float32)
            CACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            p_end = tl.minimum(c * NSUB + NSUB, q_pos // PIECE + 1)
            for pc in range(tl.maximum(c * NSUB, lo // PIECE), p_end):
                part = row * NP + (pc - c_lo * NSUB)
                acc = tl.load(part_acc + part[:, None] * DV + dv[None, :], mask=cmask, other=0.0)
                m = tl.load(part_ml + part * 2, mask=rmask, other=float("-inf"))
                l = tl.load(part_ml + part * 2 + 1, mask=rmask, other=0.0)
                CM, CL, CACC = _fold(CM, CL, CACC, m, l, acc)
        else:
            part = row * NP + (c - c_lo)
            CACC = tl.load(part_acc + part[:, None] * DV + dv[None, :], mask=cmask, other=0.0)
            CM = tl.load(part_ml + part * 2, mask=rmask, other=float("-inf"))
            CL = tl.load(part_ml + part * 2 + 1, mask=rmask, other=0.0)
        M, L, ACC = _fold(M, L, ACC, CM, CL, CACC)
    o = _finish(ACC, M, L, sinks, heads, rmask, HAS_SINKS)
    tl.store(out + (b + t.to(tl.int64))[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :],
             o.to(out.dtype.element_ty), mask=cmask)
