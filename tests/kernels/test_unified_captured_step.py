"""`unified_attention` as a captured extend step runs it: a decode launch over every request row (it takes
the rows with one query) and an extend launch over a device-built tile list (`extend_tiles`), both on a
grid fixed by the static shapes, with padded request rows (no queries) and padded tokens after the live
ones. Every live token gets the bits the eager mixed step gives it; padded rows and tokens are not
written."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; kernel tests need it (CPU: TRITON_INTERPRET=1)")

from kernel_ref import make_pools

from swaserve.kernels.index_builders import window_slots
from swaserve.kernels.unified_attention import extend_tile_queries, unified_attention
from swaserve.kernels.unified_work import NO_TILE, extend_tile_capacity, extend_tiles


def _tiles_by_hand(ext: list[int], toks: int) -> list[tuple[int, int]]:
    return [(b, t0) for b, n in enumerate(ext) if n > 1 for t0 in range(0, n, toks)]


def test_extend_tiles_list_every_tile_once_and_fit_their_capacity(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(200):
        toks = int(torch.randint(1, 5, (1,), generator=g)) * 8
        R = int(torch.randint(1, 12, (1,), generator=g))
        bs = int(torch.randint(0, R + 1, (1,), generator=g))
        ext = [int(n) for n in torch.randint(1, 3 * toks, (bs,), generator=g)] + [0] * (R - bs)
        ext = [1 if int(torch.randint(0, 3, (1,), generator=g)) == 0 else n for n in ext]  # decode rows
        qo = torch.tensor([0] + ext).cumsum(0).int()
        cap = extend_tile_capacity(max(sum(ext), 1), R, toks)
        work = extend_tiles(qo, toks, cap)
        want = _tiles_by_hand(ext, toks)
        assert len(want) <= cap
        got = list(zip(work[0].tolist(), work[1].tolist()))
        assert got[: len(want)] == want
        assert all(t0 == NO_TILE for _, t0 in got[len(want):])


@pytest.mark.parametrize("window", [8, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_step_launches_give_the_eager_bits(window, dtype, device, seed):
    """Decode rows first (as the scheduler orders a mixed step), then prefill chunks; request rows padded
    to R and tokens to N. The eager step is one extend over the live batch (the bits every launch of the
    unified kernel gives a query, decode or extend)."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = 4, 2, 32
    reqs = [(7, 1), (30, 1), (0, 1), (5, 21), (60, 20), (3, 9), (0, 2)]  # (prefix, new)
    R, N = 10, 64
    swa_from = [max(0, p - window + 1) for p, _ in reqs] if window else None
    pools = make_pools([p + n for p, n in reqs], Hkv, D, D, dtype, g, device, swa_from=swa_from)
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if window else (pools.k_full, pools.v_full)
    f2s = pools.full_to_swa if window else None
    T = sum(n for _, n in reqs)
    q = torch.zeros(N, H, D, dtype=dtype, device=device)
    q[:T] = torch.randn(T, H, D, generator=g).to(dtype).to(device)
    qo_live = torch.tensor([0] + [n for _, n in reqs], device=device).cumsum(0).int()
    seq_live = torch.tensor([p + n for p, n in reqs], dtype=torch.int32, device=device)
    rows_live = pools.rows[: len(reqs)]
    eager = torch.full((T, H, D), float("nan"), dtype=dtype, device=device)
    unified_attention(q[:T], eager, k_buf, v_buf, pools.req_to_token, rows_live, seq_live, qo_live, 0.125,
                      max_extend_len=21, window=window, full_to_swa=f2s)
    # The static request buffers: padded rows read table row 0, one key, and have no queries.
    qo = torch.full((R + 1,), T, dtype=torch.int32, device=device)
    qo[: len(reqs) + 1] = qo_live
    seq = torch.ones(R, dtype=torch.int32, device=device)
    seq[: len(reqs)] = seq_live
    rows = torch.zeros(R, dtype=pools.rows.dtype, device=device)
    rows[: len(reqs)] = rows_live
    # Every tile height the launch rules pick (`extend_tile_rows`), each with its own tile list, and a sliding
    # layer's decode launch through all R rows' window slots (`window_slots`, as a captured step reads them)
    # or through the table: the same bits.
    slots = window_slots(pools.req_to_token, rows, seq, f2s, window) if window else None
    for tile_rows, programs, use_slots in ((64, "block", False), (32, "chunk", True), (16, "request", True),
                                           (64, "chunk", False)):
        toks = extend_tile_queries(H // Hkv, tile_rows)
        work = extend_tiles(qo, toks, extend_tile_capacity(N, R, toks))
        out = torch.full((N, H, D), float("nan"), dtype=dtype, device=device)
        unified_attention(q, out, k_buf, v_buf, pools.req_to_token, rows, seq, qo, 0.125, max_extend_len=1,
                          window=window, full_to_swa=f2s, programs=programs, slots=slots if use_slots else None)
        assert torch.isnan(out[3:]).all(), "the decode launch writes the decode rows only"
        unified_attention(q, out, k_buf, v_buf, pools.req_to_token, rows, seq, qo, 0.125, max_extend_len=N,
                          window=window, full_to_swa=f2s, work=work, tile_rows=tile_rows)
        assert torch.equal(out[:T], eager), (tile_rows, programs)
        assert torch.isnan(out[T:]).all(), "padded tokens are not written"
