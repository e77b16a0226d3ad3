"""Split-K flash-decoding over CSR key lists (`decode_attention`): stage 1 attends each split,
stage 2 (or, with split counters, the last split program of stage 1) combines them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import _block_d, _dot, _finish, _online_step, _scores, dot_flags
from swaserve.kernels.kv_quant import kv_scale_args
from swaserve.kernels.pdl import pdl_enter, pdl_kwargs


@triton.jit
def _split_bounds(n, split, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) of one split and the number of non-empty splits. Chunks are whole BLOCK_N
    multiples of at least MIN_CHUNK (>= BLOCK_N, so n = 0 gives 0 splits, not a division by 0)."""
    chunk = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, MIN_CHUNK)
    lo = split * chunk
    return lo, tl.minimum(n, lo + chunk), tl.cdiv(n, chunk)


@triton.jit
def _decode_stage1(
    q, k_buf, v_buf, kv_indptr, kv_indices, out, mid_o, mid_lse, sinks, counters, k_scale, v_scale,
    qk_scale, softcap,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, DIRECT: tl.constexpr, FUSED_REDUCE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    USE_PDL: tl.constexpr, KV_FP8: tl.constexpr, FP8_AS_F16: tl.constexpr,
):
    pdl_enter(USE_PDL)
    if KV_FP8:  # e4m3 K: its scale folds into the logits' (`kernels.kv_quant`)
        qk_scale = qk_scale * tl.load(k_scale)
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    hblk = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    # GQA: the query heads sharing one kv head form the M dim of the dots, so K/V load once.
    g = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = g < GROUP
    heads = kvh * GROUP + g
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q_t = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + dk[None, :],
                  mask=hmask[:, None] & (dk[None, :] < DK), other=0.0)
    if FP8_AS_F16:  # e4m3 tiles convert to fp16 in one instruction per pair; the MMAs run in fp16
        q_t = q_t.to(tl.float16)

    start = tl.load(kv_indptr + b).to(tl.int64)
    n = tl.load(kv_indptr + b + 1).to(tl.int64) - start
    lo, hi, _ = _split_bounds(n, split, NUM_SPLITS, MIN_CHUNK, BLOCK_N)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        offs = j0 + tl.arange(0, BLOCK_N)
        nmask = offs < hi
        slot = tl.load(kv_indices + start + offs, mask=nmask, other=0).to(tl.int64)
        k_t = tl.load(k_buf + slot[:, None] * stride_kt + kvh * stride_kh + dk[None, :],
                      mask=nmask[:, None] & (dk[None, :] < DK), other=0.0)
        s = _scores(_dot(q_t, tl.trans(k_t.to(q_t.dtype)), UPCAST, PREC), qk_scale, softcap,
                    HAS_SOFTCAP)
        s = tl.where(nmask[None, :], s, float("-inf"))
        p, alpha, m, l = _online_step(s, m, l)
        v_t = tl.load(v_buf + slot[:, None] * stride_vt + kvh * stride_vh + dv[None, :],
                      mask=nmask[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(q_t.dtype), v_t.to(q_t.dtype), UPCAST, PREC)
    if KV_FP8:  # e4m3 V: every split's output carries its scale, so the combine needs none
        acc = acc * tl.load(v_scale)

    if DIRECT:
        # One split: finish here and skip stage 2 (and its launch).
        o = _finish(acc, m, l, sinks, heads, hmask, HAS_SINKS)
        tl.store(out + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
                 o.to(out.dtype.element_ty), mask=hmask[:, None] & (dv[None, :] < DV))
    else:
        # Empty splits write nothing; stage 2 recomputes which splits exist.
        # (scalar & vector masks come out int32 in the triton 3.9 interpreter: compare instead)
        ok = g < tl.where(lo < hi, GROUP, 0)
        l = tl.where(l > 0, l, 1.0)
        o = acc / l[:, None]
        tl.store(mid_o + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + dv[None, :],
                 o, mask=ok[:, None] & (dv[None, :] < DV))
        tl.store(mid_lse + b * stride_lb + heads * stride_lh + split, m + tl.log2(l), mask=ok)
        if FUSED_REDUCE:
            # The last of this (request, head block)'s split programs to finish combines them, so
            # no stage-2 launch. Its release (after the barrier) publishes this program's stores;
            # the last one's acquire makes every split's visible; it resets the counter for the
            # next launch. Partials are read past L1 (.cg): L1 is not coherent across SMs.
            tl.debug_barrier()
            cnt = counters + b * (tl.num_programs(1)) + tl.program_id(1)
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                tl.store(cnt, 0)
                _, _, nsplits = _split_bounds(n, 0, NUM_SPLITS, MIN_CHUNK, BLOCK_N)
                acc, m, l = _combine_splits(mid_o, mid_lse, b, heads, hmask, nsplits, dv, DV,
                                            stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, BLOCK_H, BLOCK_DV)
                o = _finish(acc, m, l, sinks, heads, hmask, HAS_SINKS)
                tl.store(out + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
                         o.to(out.dtype.element_ty), mask=hmask[:, None] & (dv[None, :] < DV))


@triton.jit
def _combine_splits(mid_o, mid_lse, b, heads, hmask, nsplits, dv, DV: tl.constexpr,
                    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, R: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Merge the first `nsplits` split results of `heads` ([R]) of request b: (acc, m, l) with
    acc [R, BLOCK_DV] the lse-weighted sum of the split outputs, m the max lse, l the weights' sum."""
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, BLOCK_DV], tl.float32)
    for s in range(nsplits):
        lse = tl.load(mid_lse + b * stride_lb + heads * stride_lh + s, mask=hmask, other=float("-inf"),
                      cache_modifier=".cg")
        o = tl.load(mid_o + b * stride_mb + heads[:, None] * stride_mh + s * stride_ms + dv[None, :],
                    mask=hmask[:, None] & (dv[None, :] < DV), other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # masked rows: no NaN
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * o
        l = l * alpha + w
        m = m_new
    return acc, m, l


@triton.jit
def _decode_stage2(
    kv_indptr, out, mid_o, mid_lse, sinks,
    stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(kv_indptr + b + 1).to(tl.int64) - tl.load(kv_indptr + b).to(tl.int64)
    _, _, nsplits = _split_bounds(n, 0, NUM_SPLITS, MIN_CHUNK, BLOCK_N)
    dv = tl.arange(0, BLOCK_DV)
    # Rank-1 ([1]-shaped) heads so the combine and `_finish` are shared with the 2-D kernels.
    heads = h + tl.zeros([1], tl.int32)
    acc, m, l = _combine_splits(mid_o, mid_lse, b, heads, heads >= 0, nsplits, dv, DV,
                                stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, 1, BLOCK_DV)
    o = _finish(acc, m, l, sinks, heads, heads >= 0, HAS_SINKS)
    tl.store(out + b * stride_ob + h * stride_oh + dv[None, :], o.to(out.dtype.element_ty),
             mask=dv[None, :] < DV)


def split_counter_count(bs: int, num_heads: int, num_kv_heads: int, block_h: int | None = None) -> int:
    """Entries of `split_counters` a launch uses: one per (request, kv head, head block) program."""
    group = num_heads // num_kv_heads
    block_h = block_h or min(64, max(16, triton.next_power_of_2(group)))
    return bs * num_kv_heads * triton.cdiv(group, block_h)


def num_kv_splits_for(
    bs: int, num_heads: int, num_kv_heads: int, max_kv_len: int, num_sms: int,
    block_n: int = 32, max_splits: int = 64,
) -> int:
    """Host-side split count for one graph batch size (static inputs only, so it can be frozen
    into a capture): one split once bs * kv-head programs fill the SMs (the stage-2 pass then
    costs more than it saves), else about two waves of programs, down to one `block_n` block of
    keys per split. Pass `max_kv_len` = the window for SWA layers, the context limit for full ones.

    From an H100 sweep (benchmarks/decode_attention_sweep.py, graph-timed, Gemma 3 1B/4B heads):
    at 1-16 requests, splits of one 32-key block beat 128-key splits by 10-25%."""
    group = num_heads // num_kv_heads
    programs = bs * num_kv_heads * triton.cdiv(group, min(64, max(16, triton.next_power_of_2(group))))
    if programs >= num_sms:
        return 1
    return max(1, min(max_splits, triton.cdiv(2 * num_sms, programs), triton.cdiv(max_kv_len, block_n)))


def decode_attention(
    q: torch.Tensor,  # [bs, H, Dk], device
    k_buf: torch.Tensor,  # [slots, Hkv, Dk] the layer's pool, in the index list's space
    v_buf: torch.Tensor,  # [slots, Hkv, Dv]
    kv_indptr: torch.Tensor,  # [bs+1] int32/int64, device
    kv_indices: torch.Tensor,  # [>= kv_indptr[bs]] int32/int64, device: slots, oldest first
    out: torch.Tensor,  # [bs, H, Dv], written
    scaling: float,
    *,
    logit_softcap: float = 0.0,  # > 0: logits -> cap * tanh(logits / cap) (after scaling)
    sinks: torch.Tensor | None = None,  # [H] float: per-head sink logit, in the denominator only
    num_kv_splits: int = 8,  # max splits per request: the grid's 3rd dim (fixed per graph)
    min_split_len: int = 0,  # keys per split at least; > 0 with a fixed tile = deterministic splits
    mid_o: torch.Tensor | None = None,  # [bs, H, num_kv_splits, Dv] float32 scratch (graph buffers)
    mid_lse: torch.Tensor | None = None,  # [bs, H, num_kv_splits] float32 scratch
    split_counters: torch.Tensor | None = None,  # int32, zeros, >= bs * Hkv * head blocks: combine in stage 1
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,  # [1] float32, device: an FP8 (e4m3) pool's scales (both or neither)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request over its key list; the window lives entirely in the list. An FP8 pool
    reads as `k8 * k_scale`, `v8 * v_scale` (the scales folded into the logits and the output). With
    bf16 queries the FP8 tiles are converted to fp16, not bf16, and q, the probabilities and the tiles
    meet in fp16 MMAs (fp32 accumulation): e4m3 -> fp16 is one instruction per pair of values, e4m3 ->
    bf16 several, and at decode that conversion, not the bytes, set the time (bs 64 x 8k keys on the 4B
    shape: an FP8 cache's step was 18% slower than bf16's on an H200). fp16 holds every e4m3 value
    exactly and q's bf16 values to more bits; queries past fp16's 65504 would overflow (normed queries
    are orders of magnitude below).

    Request b attends keys `kv_indices[kv_indptr[b]:kv_indptr[b+1]]` with GQA (query head h uses
    kv head h // (H / Hkv)). A request with no keys gets 0 (no NaN, sinks or not); a padded row
    (one key at the dummy slot 0) reads slot 0 and produces a finite value. Key count per split is
    rounded up to `block_n`, so a short list uses fewer splits. No host sync: grid and scratch
    depend only on `bs`, the head counts and `num_kv_splits`. Returns `out`.

    With `split_counters` (all zero; left all zero) the last split program of each request and
    head block to finish combines the splits, instead of a second launch: one launch per layer.
    """
    bs, H, DK = q.shape
    HKV, DV = k_buf.shape[1], v_buf.shape[2]
    assert H % HKV == 0 and k_buf.shape[2] == DK and out.shape == (bs, H, DV)
    assert q.stride(2) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1 and out.stride(2) == 1
    if bs == 0:
        return out
    group = H // HKV
    # Launch settings from the H100 sweep: split programs are short (one or two 32-key blocks),
    # a direct program streams its whole list with wider tiles and a deeper pipeline.
    split, big = num_kv_splits > 1, max(DK, DV) > 256
    block_n = block_n or (32 if split or big else 64)
    num_warps = num_warps or (4 if split or big else 8)
    num_stages = num_stages or (2 if split or big else 3)
    block_h = block_h or min(64, max(16, triton.next_power_of_2(group)))
    head_blocks = triton.cdiv(group, block_h)
    if min_split_len % block_n:
        raise ValueError(f"min_split_len {min_split_len} must be a multiple of block_n {block_n}")
    num_kv_splits = max(1, num_kv_splits)
    direct = num_kv_splits == 1
    if not direct:
        if mid_o is None:
            mid_o = torch.empty(bs, H, num_kv_splits, DV, dtype=torch.float32, device=q.device)
        if mid_lse is None:
            mid_lse = torch.empty(bs, H, num_kv_splits, dtype=torch.float32, device=q.device)
        assert mid_o.shape[2] >= num_kv_splits and mid_o.stride(3) == 1 and mid_lse.stride(2) == 1
    else:
        mid_o = mid_lse = out  # unused
    fused = not direct and split_counters is not None
    if fused:
        assert split_counters.dtype == torch.int32 and split_counters.numel() >= bs * HKV * head_blocks, (
            "split_counters too small", split_counters.numel(), bs * HKV * head_blocks)
    upcast, prec = dot_flags(q.dtype)
    sinks_arg = sinks if sinks is not None else q
    ks, vs, fp8 = kv_scale_args(k_buf, k_scale, v_scale, q)
    kw = {"num_warps": num_warps, "num_stages": num_stages, **pdl_kwargs(q)}
    _decode_stage1[(bs, HKV * head_blocks, num_kv_splits)](
        q, k_buf, v_buf, kv_indptr, kv_indices, out, mid_o, mid_lse, sinks_arg,
        split_counters if fused else kv_indptr, ks, vs, scaling, logit_softcap if logit_softcap else 1.0,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if not direct else 0,
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, DK=DK, DV=DV,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DK=_block_d(DK), BLOCK_DV=_block_d(DV),
        NUM_SPLITS=num_kv_splits, MIN_CHUNK=max(block_n, min_split_len),
        DIRECT=direct, FUSED_REDUCE=fused, HAS_SOFTCAP=bool(logit_softcap), HAS_SINKS=sinks is not None,
        UPCAST=upcast, PREC=prec, KV_FP8=fp8, FP8_AS_F16=fp8 and q.dtype == torch.bfloat16, **kw,
    )
    if not direct and not fused:
        _decode_stage2[(bs, H)](
            kv_indptr, out, mid_o, mid_lse, sinks_arg,
            out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1),
            DV=DV, BLOCK_DV=_block_d(DV), BLOCK_N=block_n,
            NUM_SPLITS=num_kv_splits, MIN_CHUNK=max(block_n, min_split_len), HAS_SINKS=sinks is not None,
            **pdl_kwargs(q),
        )
    return out
