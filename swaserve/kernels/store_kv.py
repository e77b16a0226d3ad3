"""Scatter the K/V rows of new tokens into one layer's pool buffers (`store_kv`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import interpret_mode
from swaserve.kernels.kv_quant import _load_scale, _to_pool, kv_scale_args


@triton.jit
def _store_kv_kernel(
    k_buf, v_buf, locs, loc_map, k, v, k_scale, v_scale,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HKV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr, EMULATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    loc = tl.load(locs + t).to(tl.int64)
    if HAS_MAP:
        # A -1 sentinel must stay -1 (and must not index the table from its end).
        loc = tl.load(loc_map + loc, mask=loc >= 0, other=-1).to(tl.int64)
    # Negative locations are skipped, never wrapped: a -1 used as a Python-style index would
    # silently overwrite the pool's last slot (vllm#43810).
    # (written as a limit, not `mask & (loc >= 0)`: scalar & vector masks break the 3.9 interpreter)
    n_k = tl.where(loc >= 0, HKV * DK, 0)
    n_v = tl.where(loc >= 0, HKV * DV, 0)
    offs = c * BLOCK + tl.arange(0, BLOCK)

    h = offs // DK
    d = offs % DK
    mk = offs < n_k
    x = tl.load(k + t * stride_kt + h * stride_kh + d, mask=mk)
    # int64 slot arithmetic: slot * stride overflows int32 on large pools (sglang#9344).
    tl.store(k_buf + loc * stride_kbt + h * stride_kbh + d,
             _to_pool(x, k_buf, _load_scale(k_scale, FP8), FP8, EMULATE), mask=mk)

    h = offs // DV
    d = offs % DV
    mv = offs < n_v
    y = tl.load(v + t * stride_vt + h * stride_vh + d, mask=mv)
    tl.store(v_buf + loc * stride_vbt + h * stride_vbh + d,
             _to_pool(y, v_buf, _load_scale(v_scale, FP8), FP8, EMULATE), mask=mv)


def store_kv(
    k_buf: torch.Tensor,  # [size+1, kv_heads, k_head_dim], pool dtype, device
    v_buf: torch.Tensor,  # [size+1, kv_heads, v_head_dim], pool dtype, device
    locs: torch.Tensor,  # [T] int32/int64, device: slots of this pool (or keys of loc_map)
    k: torch.Tensor,  # [T, kv_heads, k_head_dim], any float dtype (cast to the pool's)
    v: torch.Tensor,  # [T, kv_heads, v_head_dim]
    loc_map: torch.Tensor | None = None,  # e.g. full_to_swa [full_size+2] int32: slot = loc_map[locs]
    block: int = 1024,
    k_scale: torch.Tensor | None = None,  # [1] float32, device: an FP8 pool's scales (both or neither)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write `k[t]`, `v[t]` at slot `locs[t]` (or `loc_map[locs[t]]`); negative slots are skipped.
    An FP8 (e4m3) pool stores `k / k_scale`, `v / v_scale`, clamped to +-448 (`kernels.kv_quant`).

    With `loc_map=full_to_swa` an SWA layer can be written straight from full-pool `out_cache_loc`,
    translated on the fly from the live table (nothing memoised, so graph replays stay correct).
    Slot 0 is a legal target (padded graph rows write there). No host sync; graph-capturable.
    """
    T = locs.numel()
    if T == 0:
        return
    hkv, dk = k_buf.shape[1], k_buf.shape[2]
    dv = v_buf.shape[2]
    assert k.shape == (T, hkv, dk) and v.shape == (T, hkv, dv), (k.shape, v.shape, (T, hkv, dk, dv))
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    ks, vs, fp8 = kv_scale_args(k_buf, k_scale, v_scale, locs)
    block = min(block, triton.next_power_of_2(hkv * max(dk, dv)))
    grid = (T, triton.cdiv(hkv * max(dk, dv), block))
    _store_kv_kernel[grid](
        k_buf, v_buf, locs, loc_map if loc_map is not None else locs, k, v, ks, vs,
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HKV=hkv, DK=dk, DV=dv, HAS_MAP=loc_map is not None, BLOCK=block, FP8=fp8, EMULATE=fp8 and interpret_mode(),
    )
