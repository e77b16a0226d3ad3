"""Batch-invariant attention for decode and extend alike (`unified_attention`): every query reads its
keys, cached prefix and this step's new tokens the same way, through the request table (and
`full_to_swa` for layers in the SWA pool), in key blocks aligned to absolute positions.

Why it is invariant: a query's keys are reduced in one order fixed by absolute positions and the
engine's `max_context` (`unified_reduce`): each key block's softmax state from zero, blocks folded
into chunks of `key_chunk(max_context)` keys, chunks folded in order (`_fold`). A decode step
computes chunks (or, for a few requests, single key blocks) in parallel programs and folds them in
`_merge_kernel`, or (many requests) one program per request folds them in registers as an extend
program does: the same operations on the same key blocks, so a query gets the same bits decoded or
prefilled, whatever else is in the batch and wherever the chunk boundaries of its prefill fall. A
decode tile holds one token's query heads (16 rows), an extend tile 64 (32 or 16 where a step's 64-row
tiles would leave SMs idle, `extend_tile_rows`): every reduction along a row
is therefore one that does not depend on the tile's height or thread layout: the max (exact), and
dot products on the MMA (q.k, p.v, and the softmax's row sum as p times ones, `_row_sum`), whose
rounding does not depend on the instruction's M (measured per GPU with the GEMM, `bi_matmul`).
Blocks and chunks a query cannot see (the tile's other queries may) are exact no-ops (an empty state
stays empty and leaves a fold unchanged).
Tiles and launch settings depend only on the head dim, GQA group, dtype, layer kind and the launch's
request and token counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import _block_d, _finish, dot_flags, interpret_mode, jit_per_batch, num_sms
from swaserve.kernels.kv_quant import fp8_cvt_asm, kv_scale_args
from swaserve.kernels.unified_launch import (
    BLOCK_M,
    PROGRAMS,
    decode_chunks,
    decode_config,
    decode_programs,
    extend_launch,
    extend_tile_queries,
    extend_tile_rows,
    flat_extend,
    unified_config,
)
from swaserve.kernels.unified_reduce import _fold, _keys, _keys_flat, _merge_kernel, key_chunk

__all__ = ["BLOCK_M", "PROGRAMS", "decode_chunks", "decode_config", "decode_programs", "extend_rows",
           "extend_tile_queries", "key_chunk", "unified_attention", "unified_config"]


def extend_rows(tokens: int, group: int, kv_heads: int, k_buf: torch.Tensor) -> int:
    """Rows of `unified_attention`'s extend tiles over `tokens` queries (`extend_tile_rows`), given the
    layer's pool `k_buf`: 64 for an e4m3 pool read as bytes (tiles loaded as e4m3 feed the older MMA of a
    short tile 4 wide along K: another summation order, `decode_config`). A captured step's tile list
    (`extend_tile_queries(group, rows)` queries a tile) must be built for the rows its launch takes."""
    if k_buf.dtype == torch.float8_e4m3fn and not fp8_cvt_asm(k_buf.device):
        return BLOCK_M
    return extend_tile_rows(tokens, triton.next_power_of_2(group), kv_heads, num_sms(k_buf.device))



@jit_per_batch("row0", "work_len", aligned=("stride_qt", "stride_ot"))
def _unified_kernel(
    q, out, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, qo_indptr, full_to_swa, slots, sinks,
    part_acc, part_ml, k_scale, v_scale, work, qk_scale, softcap, window, row0, work_len,
    stride_r2t, stride_slots, stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt,
    stride_vh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CHUNK: tl.constexpr, SPLIT: tl.constexpr, UNIT: tl.constexpr, NP: tl.constexpr, H: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_MAP: tl.constexpr, HAS_SLOTS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    ROWWISE: tl.constexpr, KV_FP8: tl.constexpr, SINGLE: tl.constexpr, WORK: tl.constexpr,
    E4M3_ASM: tl.constexpr, FLAT: tl.constexpr,
):
    """SPLIT (decode, one token per request): program (b, kvh, s) writes the partial of the s-th
    UNIT keys (a chunk or a key block) from the first chunk's start to `part_acc` / `part_ml`
    ([T, H, NP, DV] / [T, H, NP, 2] float32) for `_merge_kernel`. Otherwise program (b, kvh, tile)
    folds every chunk of its tile and writes `out` (extend, and a decode step's request programs).
    `HAS_SLOTS` (decode, sliding layers): request b's keys lo.. are read from `slots[b]`, its window's
    SWA slots, one gather instead of two (`HAS_MAP` is then off). Program b serves request row0 + b.
    `KV_FP8`: e4m3 K/V; K's scale multiplies the logit scale, V's the folded result before `_finish`
    (here and in `_merge_kernel` alike, so decode and extend stay the same bits).
    `SINGLE` (a decode launch): a request with other than one query is not its row (a captured extend
    step's decode launch spans every request row). `WORK`: program (i, kvh) takes the tile `work[:, i]`
    (request, first query: `unified_work.extend_tiles`), so the grid does not depend on the batch."""
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale)
    TOKS: tl.constexpr = BLOCK_M // GROUP_P
    if WORK:
        b = tl.load(work + tl.program_id(0))
        t0 = tl.load(work + work_len + tl.program_id(0))
    else:
        b = tl.program_id(0) + row0
        t0 = 0 if SPLIT else tl.program_id(2) * TOKS  # (a split program's third index is its key unit)
    kvh = tl.program_id(1)
    q_lo = tl.load(qo_indptr + b).to(tl.int64)
    ext = tl.load(qo_indptr + b + 1).to(tl.int64) - q_lo
    if t0 >= ext:
        return
    if SINGLE:
        if ext != 1:
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
    if HAS_SLOTS:  # position p's slot at slots[b, p - lo]
        table, trow, pos0, stride_t = slots, b, lo, stride_slots
    else:  # at req_to_token[row, p] (then full_to_swa where HAS_MAP)
        table, trow, pos0, stride_t = req_to_token, row, tl.zeros([], tl.int64), stride_r2t
    if SPLIT:
        s = tl.program_id(2)
        first = c_lo * CHUNK + s * UNIT
        if (first + UNIT <= lo) | (first > hi):
            return
        m, l, acc = _keys(q_t, k_buf, v_buf, table, full_to_swa, trow, pos0, first, first + UNIT - 1, lo,
                          hi, q_pos, rmask, kvh, dk, dv, qk_scale, softcap, window, stride_t, stride_kt,
                          stride_kh, stride_vt, stride_vh, DK, DV, BLOCK_M, BLOCK_N, BLOCK_DV, HAS_WINDOW,
                          HAS_MAP, HAS_SOFTCAP, UPCAST, PREC, ROWWISE, E4M3_ASM)
        part = ((b + t) * H + heads) * NP + s  # [BLOCK_M] int64: by request row, as `_merge_kernel` reads
        tl.store(part_acc + part[:, None] * DV + dv[None, :], acc,
                 mask=rmask[:, None] & (dv[None, :] < DV))
        tl.store(part_ml + part * 2, m, mask=rmask)
        tl.store(part_ml + part * 2 + 1, l, mask=rmask)
    else:
        if FLAT:  # one loop over the key blocks (`_keys_flat`): the same folds in the same order
            M, L, ACC = _keys_flat(q_t, k_buf, v_buf, table, full_to_swa, trow, pos0, lo, hi, q_pos, rmask, kvh,
                                   dk, dv, qk_scale, softcap, window, stride_t, stride_kt, stride_kh, stride_vt,
                                   stride_vh, DK, DV, BLOCK_M, BLOCK_N, BLOCK_DV, CHUNK, HAS_WINDOW, HAS_MAP,
                                   HAS_SOFTCAP, UPCAST, PREC, ROWWISE, E4M3_ASM)
        else:
            M = tl.full([BLOCK_M], float("-inf"), tl.float32)
            L = tl.zeros([BLOCK_M], tl.float32)
            ACC = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            for c in range(c_lo, c_hi + 1):
                m, l, acc = _keys(q_t, k_buf, v_buf, table, full_to_swa, trow, pos0, c * CHUNK,
                                  c * CHUNK + CHUNK - 1, lo, hi, q_pos, rmask, kvh, dk, dv, qk_scale, softcap,
                                  window, stride_t, stride_kt, stride_kh, stride_vt, stride_vh, DK, DV, BLOCK_M,
                                  BLOCK_N, BLOCK_DV, HAS_WINDOW, HAS_MAP, HAS_SOFTCAP, UPCAST, PREC, ROWWISE,
                                  E4M3_ASM)
                M, L, ACC = _fold(M, L, ACC, m, l, acc)
        if KV_FP8:
            ACC = ACC * tl.load(v_scale)
        o = _finish(ACC, M, L, sinks, heads, rmask, HAS_SINKS)
        tl.store(out + (q_lo + t)[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :],
                 o.to(out.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))


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
    programs: str | None = None,  # decode programs per "block", "chunk" or "request" (default: by batch)
    slots: torch.Tensor | None = None,  # [bs, >= window] int32: `window_slots` (decode, sliding layers)
    launch: tuple[int, int, int] | None = None,  # (rows, warps, stages) of a program (sweeps)
    first_row: int = 0,  # extend: requests before it are another launch's (a mixed step's decode rows)
    k_scale: torch.Tensor | None = None,  # [1] float32, device: an FP8 (e4m3) pool's scales (both or neither)
    v_scale: torch.Tensor | None = None,
    work: torch.Tensor | None = None,  # [2, W] int32: extend tiles (`unified_work.extend_tiles`), the grid's
    tile_rows: int | None = None,  # with `work`: the rows of the tiles it lists (`extend_tile_queries(group, rows)`)
    flat: bool | None = None,  # extend: one loop over the key blocks (None: `flat_extend`, off for FP8 pools)
) -> torch.Tensor:
    """Query i of request b sits at `seq_lens[b] - n_b + i` and sees keys p-W+1 .. p (0 .. p without a
    window), read at `req_to_token[row_b, pos]` (translated by `full_to_swa` when given). Padded rows
    (row 0, seq_len 1) read slot 0 and give finite values. A decode batch (`max_extend_len` 1) splits
    its keys over programs by chunk, by key block where chunk programs would leave most of the GPU
    idle (a few requests), or not at all where requests alone fill it (`decode_programs`): the same
    bits every way. A decode step of a sliding layer may pass `slots` (`window_slots`: the window's
    slots, translated once a step) instead of reading the table and `full_to_swa` per key. An extend
    may start at request `first_row` (the rows before it being another launch's: a mixed step's
    decodes) with every tensor whole, so a split compiles nothing new (sliced pointers would change
    their alignment, a specialisation). A decode launch (`max_extend_len` 1) takes the requests that
    have one query, at `qo_indptr[b]`; with `work` an extend launch takes the tiles listed there
    (`unified_work.extend_tiles`): then the grid depends on no batch, and a captured extend step runs
    both over every request row of its static inputs. Every launch setting depends on static shapes
    only, so it can be captured. An FP8 pool reads as `k8 * k_scale`, `v8 * v_scale`. No host sync. Returns `out`."""
    T, H, DK = q.shape
    HKV, DV = k_buf.shape[1], v_buf.shape[2]
    bs = req_pool_indices.numel()
    assert H % HKV == 0 and out.shape == (T, H, DV) and k_buf.shape[2] == DK
    for t in (q, out, k_buf, v_buf):
        assert t.stride(2) == 1, "head dims must be contiguous"
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if T == 0 or bs <= first_row or max_extend_len <= 0:
        return out
    group = H // HKV
    group_p = triton.next_power_of_2(group)
    assert group_p <= BLOCK_M, f"GQA group {group} wider than a tile"
    bdk, bdv = _block_d(DK), _block_d(DV)
    decode = max_extend_len == 1 and work is None  # an extend over a tile list may hold one-token tiles
    if work is not None:
        assert tile_rows is not None and tile_rows >= max(16, group_p) and tile_rows in (16, 32, 64), tile_rows
    rows = BLOCK_M if decode else tile_rows if work is not None else extend_rows(T, group, HKV, k_buf)
    if flat is None:
        flat = not decode and k_buf.element_size() != 1 and flat_extend(q.device)
    block_n, warps, stages = extend_launch(rows, max(bdk, bdv), q.element_size(), flat)
    max_context = req_to_token.shape[1]
    chunk = chunk or key_chunk(max_context)
    assert chunk % block_n == 0, f"chunk {chunk} is not a multiple of the key block {block_n}"
    upcast, prec = dot_flags(q.dtype)
    ks, vs, fp8 = kv_scale_args(k_buf, k_scale, v_scale, q)
    asm = fp8 and fp8_cvt_asm(q.device)  # e4m3 tiles convert before shared memory: the 16-row decode tile
    if decode:
        assert first_row == 0, "a decode launch spans every request row"
        nc = decode_chunks(max_context, chunk, window)
        programs = programs or decode_programs(bs * HKV, nc, chunk // block_n, num_sms(q.device))
        assert programs in PROGRAMS, programs
    split = decode and programs != "request"  # partials, then the merge
    np_ = 1
    part_acc = part_ml = out  # unused unless split
    if split:
        np_ = nc * (chunk // block_n if programs == "block" else 1)
        part_acc = torch.empty(bs, H, np_, DV, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(bs, H, np_, 2, dtype=torch.float32, device=q.device)
    if launch is not None:
        block_m, warps, stages = launch
    elif decode:
        block_m, warps, stages = decode_config(group_p, window is not None, programs,
                                               warps if fp8 and not asm else None)
    else:
        block_m = rows
    if work is not None:
        assert work.dtype == torch.int32 and work.shape[0] == 2 and work.is_contiguous(), work.shape
        grid = (work.shape[1], HKV, 1)
    else:
        grid = (bs - first_row, HKV, np_ if split else triton.cdiv(max_extend_len, block_m // group_p))
    const = dict(GROUP=group, GROUP_P=group_p, DV=DV, BLOCK_M=block_m, CHUNK=chunk,
                 UNIT=block_n if split and programs == "block" else chunk, NP=np_, H=H,
                 HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, KV_FP8=fp8)
    has_slots = decode and slots is not None
    if has_slots:
        assert window is not None and slots.dtype == torch.int32, "slots: int32, for a sliding layer"
        assert slots.shape[0] >= bs and slots.shape[1] >= window and slots.stride(1) == 1, slots.shape
    sinks_arg, window_arg = sinks if sinks is not None else q, window if window is not None else 0
    _unified_kernel[grid](
        q, out, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, qo_indptr,
        full_to_swa if full_to_swa is not None else seq_lens, slots if has_slots else seq_lens, sinks_arg,
        part_acc, part_ml, ks, vs, work if work is not None else qo_indptr,
        scaling, logit_softcap if logit_softcap else 1.0, window_arg, first_row,
        work.shape[1] if work is not None else 0,
        req_to_token.stride(0), slots.stride(0) if has_slots else 0, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        DK=DK, BLOCK_N=block_n, BLOCK_DK=bdk, BLOCK_DV=bdv, SPLIT=split,
        HAS_MAP=full_to_swa is not None and not has_slots, HAS_SLOTS=has_slots,
        HAS_SOFTCAP=bool(logit_softcap), UPCAST=upcast, PREC=prec, ROWWISE=interpret_mode(), SINGLE=decode,
        WORK=work is not None, E4M3_ASM=asm, FLAT=flat, **const,
        num_warps=warps, num_stages=stages,
    )
    if split:
        # Per-block partials are many for a few requests: their fold is split over value columns.
        mdv = max(16, bdv // 4) if programs == "block" else bdv
        _merge_kernel[(bs, HKV, bdv // mdv)](out, part_acc, part_ml, seq_lens, qo_indptr, sinks_arg, vs,
                                             window_arg, out.stride(0), out.stride(1), BLOCK_DV=mdv, **const,
                                             num_warps=warps)
    return out
