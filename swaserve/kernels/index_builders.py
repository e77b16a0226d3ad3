"""Device-side builders of the key lists attention kernels read: CSR full-context lists for full
layers, window lists translated into SWA-pool space for SWA layers, and deterministic mode's
per-request window slot table (`window_slots`). No host sync, fixed grids."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import jit_per_batch


@triton.jit
def _span(kv_lens, first_q, offs, mask, window, HAS_WINDOW: tl.constexpr, HAS_FIRST_Q: tl.constexpr):
    """(start, count) of each request's list: positions start .. kv_len-1."""
    kv_len = tl.load(kv_lens + offs, mask=mask, other=0).to(tl.int64)
    start = tl.zeros_like(kv_len)
    if HAS_WINDOW:
        if HAS_FIRST_Q:
            q0 = tl.load(first_q + offs, mask=mask, other=0).to(tl.int64)
        else:
            q0 = kv_len - 1  # decode: the newest key is the query itself
        # The earliest query at q0 sees q0-W+1 .. q0; later queries see a subset of that.
        start = tl.minimum(tl.maximum(q0 - window + 1, 0), kv_len)
    return start, kv_len - start


@jit_per_batch("bs")
def _build_kv_indices_kernel(
    req_to_token, stride_r2t, req_pool_indices, kv_lens, first_q, full_to_swa,
    kv_indptr, kv_indices, kv_start, bs, window,
    HAS_WINDOW: tl.constexpr, HAS_FIRST_Q: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_START: tl.constexpr, BLOCK_BS: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    nc = tl.num_programs(1)
    # Each program re-derives its own CSR offset (sum of earlier requests' counts) instead of
    # waiting for a separate cumsum launch; bs is small, so the O(bs) read is cheap.
    offset = tl.zeros([], dtype=tl.int64)
    for i0 in range(0, b, BLOCK_BS):
        offs = i0 + tl.arange(0, BLOCK_BS)
        m = offs < b
        _, n_i = _span(kv_lens, first_q, offs, m, window, HAS_WINDOW, HAS_FIRST_Q)
        offset += tl.sum(tl.where(m, n_i, 0), axis=0)
    start, n = _span(kv_lens, first_q, b, True, window, HAS_WINDOW, HAS_FIRST_Q)
    if c == 0:
        tl.store(kv_indptr + b + 1, (offset + n).to(kv_indptr.dtype.element_ty))
        if b == 0:
            tl.store(kv_indptr, tl.zeros([], dtype=kv_indptr.dtype.element_ty))
        if HAS_START:
            tl.store(kv_start + b, start.to(kv_start.dtype.element_ty))
    row = tl.load(req_pool_indices + b).to(tl.int64)
    src = req_to_token + row * stride_r2t + start
    dst = kv_indices + offset
    for j0 in range(c * BLOCK, n, nc * BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        m = offs < n
        slot = tl.load(src + offs, mask=m, other=0)
        if HAS_MAP:
            slot = tl.load(full_to_swa + slot.to(tl.int64), mask=m, other=0)
        tl.store(dst + offs, slot.to(kv_indices.dtype.element_ty), mask=m)


def build_kv_indices(
    req_to_token: torch.Tensor,  # [max_reqs+1, max_context] int32, device: full-pool slots
    req_pool_indices: torch.Tensor,  # [bs] int32/int64, device: rows (0 = padded row)
    kv_lens: torch.Tensor,  # [bs] int, device: keys at positions 0 .. kv_len-1 exist
    kv_indptr: torch.Tensor,  # [bs+1] int32/int64, device, written: exclusive cumsum of counts
    kv_indices: torch.Tensor,  # [capacity] int32/int64, device, written: flat slot list
    window: int | None = None,  # W keys incl. the query itself; None = full context
    full_to_swa: torch.Tensor | None = None,  # [full_size+2] int32, device: translate to SWA space
    first_query_pos: torch.Tensor | None = None,  # [bs] int, device; default kv_lens - 1 (decode)
    kv_start: torch.Tensor | None = None,  # [bs] int32/int64, device, written: first listed position
    num_programs_per_req: int = 1,
    block: int = 256,
    block_bs: int = 128,  # fixed, not sized to bs: a per-batch constexpr would mean a compile per size
) -> None:
    """Write, per request b, the slots of positions `start_b .. kv_len_b - 1` of its table row.

    `start_b = 0` without a window, else `max(0, first_query_pos_b - W + 1)`: the earliest key its
    earliest query can see. Decode: `kv_lens = seq_lens` (incl. the new token), default first query.
    Extend prefix: `kv_lens = first_query_pos = prefix_lens`, and `kv_start` gives the extend kernel
    the prefix list's first position. With `full_to_swa` every slot is translated into SWA space
    (unmapped/padded -> 0, the dummy slot).

    Graph-capture friendly: lengths are read on the device, the grid is `(bs, num_programs_per_req)`
    and nothing is returned to the host, so `kv_indices` must be sized for the worst case
    (`kv_indices_capacity`); entries past `kv_indptr[bs]` are left untouched.
    """
    bs = req_pool_indices.numel()
    assert kv_lens.numel() == bs and kv_indptr.numel() >= bs + 1
    assert req_to_token.stride(1) == 1
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if bs == 0:
        kv_indptr[:1].zero_()
        return
    if full_to_swa is not None:
        assert full_to_swa.dtype in (torch.int32, torch.int64)
    dummy = kv_lens
    _build_kv_indices_kernel[(bs, num_programs_per_req)](
        req_to_token, req_to_token.stride(0), req_pool_indices, kv_lens,
        first_query_pos if first_query_pos is not None else dummy,
        full_to_swa if full_to_swa is not None else dummy,
        kv_indptr, kv_indices, kv_start if kv_start is not None else dummy,
        bs, window if window is not None else 0,
        HAS_WINDOW=window is not None, HAS_FIRST_Q=first_query_pos is not None,
        HAS_MAP=full_to_swa is not None, HAS_START=kv_start is not None,
        BLOCK_BS=block_bs, BLOCK=block,
    )


def kv_indices_capacity(max_bs: int, max_context: int, window: int | None = None) -> int:
    """Worst-case length of a `kv_indices` buffer for `max_bs` requests (fixed graph buffers).

    A window list holds at most W keys (decode: W incl. the new token; extend prefix: W - 1).
    """
    per_req = max_context if window is None else min(window, max_context)
    return max_bs * per_req


@triton.jit
def _window_slots_kernel(req_to_token, stride_r2t, req_pool_indices, seq_lens, full_to_swa, out, window,
                         BLOCK: tl.constexpr):
    b = tl.program_id(0)
    q_pos = tl.load(seq_lens + b).to(tl.int64) - 1
    lo = tl.maximum(q_pos - window + 1, 0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.minimum(lo + j, q_pos)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    full = tl.load(req_to_token + row * stride_r2t + pos)
    slot = tl.load(full_to_swa + full.to(tl.int64))
    tl.store(out + b * window + j, slot.to(tl.int32), mask=j < window)


def window_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 full_to_swa: torch.Tensor, window: int) -> torch.Tensor:
    """[bs, window] int32: the SWA slots of each decoding request's window, positions lo.. (lo =
    max(seq_len - window, 0); entries past the query repeat its slot and are never read), for
    `unified_attention(slots=...)`: sliding layers then read one table instead of two gathers per key.
    One launch, no host sync (capturable); once per step for all sliding layers."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    bs = req_pool_indices.numel()
    assert seq_lens.numel() == bs and req_to_token.stride(1) == 1
    out = torch.empty(bs, window, dtype=torch.int32, device=seq_lens.device)
    if bs:
        block = min(triton.next_power_of_2(window), 1024)
        _window_slots_kernel[(bs, triton.cdiv(window, block))](
            req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens, full_to_swa, out, window,
            BLOCK=block)
    return out
