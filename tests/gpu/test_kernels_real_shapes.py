"""Triton kernels natively on CUDA at production attention shapes (Gemma 3 1B/4B/12B, GPT-OSS-20B with
sinks) vs a dense float64 reference: contexts at W-1, W, W+1, 2W+3 and ~4k, bf16 and fp32, SWA lists
translated through a shuffled full_to_swa, evicted slots, slot 0, free index entries and outputs
poisoned. The index builders and store_kv are checked exactly.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))  # the kernel tests' oracle
from kernel_ref import attend_ref, make_pools, window_mask

from swaserve.kernels import (
    build_kv_indices,
    decode_attention,
    extend_attention,
    kv_indices_capacity,
    num_kv_splits_for,
    store_kv,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
SHAPES = {  # H, Hkv, head_dim, window, sinks
    "gemma3-1b": (4, 1, 256, 512, False),
    "gemma3-4b": (8, 4, 256, 1024, False),
    "gemma3-12b": (16, 8, 256, 1024, False),
    "gpt-oss-20b": (64, 8, 64, 128, True),
}
CASES = [(s, torch.bfloat16) for s in SHAPES] + [("gemma3-1b", torch.float32), ("gpt-oss-20b", torch.float32)]
CASE_IDS = [f"{s}-{'bf16' if d == torch.bfloat16 else 'fp32'}" for s, d in CASES]
LONG = 4103  # ~4k context
MAX_CONTEXT = 8192  # what full-layer split counts are sized for (the engine uses its max_context)
# Relative to the reference's scale: with thousands of keys the outputs are small (~1/sqrt(n)), so
# an absolute tolerance alone would let a dropped half of the keys pass. bf16: inputs, probabilities
# (for P.V) and outputs are rounded to bf16; fp32: true-fp32 dots vs float64.
REL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _make(shape: str, dtype: torch.dtype, lens: tuple[int, ...], swa_from: tuple[int, ...] | None, seed: int):
    """Pools holding known K/V per position (shuffled full slots, shuffled full_to_swa; slot 0 and
    positions before `swa_from` NaN in the SWA pool), the sinks, and a generator for the queries."""
    H, Hkv, D, _, sinks = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    pools = make_pools(list(lens), Hkv, D, D, dtype, g, DEV, max_context=max(lens) + 5,
                       swa_from=None if swa_from is None else list(swa_from))
    sink = (torch.randn(H, generator=g) * 2).to(dtype).to(DEV) if sinks else None
    return pools, sink


# Building pools at 4k-9k tokens on the host is the slow part: parametrisations that differ only in
# the split count share them (they are read-only there).
_cached = functools.lru_cache(maxsize=1)(_make)


def _build_lists(pools, kv_lens: list[int], first_q: list[int] | None, window: int | None, swa: bool):
    """build_kv_indices into a poisoned buffer, checked entry by entry against the table on the host."""
    bs = len(kv_lens)
    C = pools.req_to_token.shape[1]
    indptr = torch.full((bs + 1,), -7, dtype=torch.int32, device=DEV)
    indices = torch.full((kv_indices_capacity(bs, C, window),), -7, dtype=torch.int32, device=DEV)
    start = torch.full((bs,), -7, dtype=torch.int32, device=DEV)
    lens_t = torch.tensor(kv_lens, dtype=torch.int32, device=DEV)
    fq = torch.tensor(first_q, dtype=torch.int32, device=DEV) if first_q is not None else None
    build_kv_indices(pools.req_to_token, pools.rows, lens_t, indptr, indices, window=window,
                     full_to_swa=pools.full_to_swa if swa else None, first_query_pos=fq, kv_start=start)
    r2t, f2s, rows = pools.req_to_token.cpu(), pools.full_to_swa.cpu(), pools.rows.cpu()
    want_ptr, want_idx, want_start = [0], [], []
    for b, L in enumerate(kv_lens):
        q0 = (first_q[b] if first_q is not None else L - 1)
        s = 0 if window is None else min(max(q0 - window + 1, 0), L)
        slots = r2t[rows[b], s:L].long()
        want_idx.append(f2s[slots] if swa else slots)
        want_ptr.append(want_ptr[-1] + L - s)
        want_start.append(s)
    total = want_ptr[-1]
    assert indptr.cpu().tolist() == want_ptr, "kv_indptr"
    assert torch.equal(indices[:total].cpu(), torch.cat(want_idx).int()), "kv_indices (wrong slots or space)"
    assert bool((indices[total:] == -7).all()), "build_kv_indices wrote past kv_indptr[bs]"
    assert start.cpu().tolist() == want_start, "kv_start"
    if swa:
        assert bool((indices[:total] > 0).all()), "a window entry translated to the dummy slot"
    indices[total:] = 0  # an over-read now hits slot 0, which holds NaN, instead of faulting
    return indptr, indices, start


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not out.isnan().any(), f"{what}: NaN (unwritten output or a poisoned slot was read)"
    out, ref = out.double(), ref.to(out.device)
    tol = REL[dtype]
    scale = ref.abs().max().item()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < tol / 2, f"{what}: relative error {rel:.2e}"
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("splits", ["auto", "direct"])  # the top decorator varies fastest: pools are reused
@pytest.mark.parametrize("kind", ["swa", "full"])
@pytest.mark.parametrize("shape,dtype", CASES, ids=CASE_IDS)
def test_decode_real_shapes(shape, dtype, kind, splits):
    W = SHAPES[shape][3]
    lens = [W, W + 1, W + 2, 2 * W + 4, LONG]  # queries at W-1, W, W+1, 2W+3, ~4k
    swa = kind == "swa"
    # SWA layers: positions older than the window were evicted (unmapped, NaN in the pool).
    H, Hkv, D, W, _ = SHAPES[shape]
    evicted = tuple(max(0, L - W) for L in lens) if swa else None
    pools, sink = _cached(shape, dtype, tuple(lens), evicted, 11)
    g = torch.Generator().manual_seed(21)
    window = W if swa else None
    indptr, indices, _ = _build_lists(pools, lens, None, window, swa)
    bs = len(lens)
    n_splits = 1
    if splits == "auto":  # what the triton backend picks for this batch (static shapes only)
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        n_splits = num_kv_splits_for(bs, H, Hkv, W if swa else MAX_CONTEXT, sms)
    q = torch.randn(bs, H, D, generator=g).to(dtype).to(DEV)
    out = torch.full((bs, H, D), float("nan"), dtype=dtype, device=DEV)
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if swa else (pools.k_full, pools.v_full)
    decode_attention(q, k_buf, v_buf, indptr, indices, out, D**-0.5, sinks=sink, num_kv_splits=n_splits)
    for b, L in enumerate(lens):
        vis = window_mask(torch.tensor([L - 1]), torch.arange(L), window).to(DEV)
        kt, vt = pools.k_true[b].to(DEV), pools.v_true[b].to(DEV)
        ref = attend_ref(q[b : b + 1], kt, vt, vis, D**-0.5, 0.0, sink)
        _check(out[b : b + 1], ref, dtype, f"{shape} {kind} decode, query at {L - 1}, {n_splits} splits")


@pytest.mark.parametrize("kind", ["swa", "full"])
@pytest.mark.parametrize("shape,dtype", CASES, ids=CASE_IDS)
def test_extend_real_shapes(shape, dtype, kind):
    W = SHAPES[shape][3]
    # (prefix, new): queries 0..W (one-shot prefill crossing W-1, W), W-1..W+1 on a cached prefix,
    # 2W..2W+3, and a ~4k chunked prefill whose prefix list starts far from position 0.
    reqs = [(0, W + 1), (W - 1, 3), (2 * W, 4), (LONG - LONG // 4 - 3, LONG // 4 + 3)]
    swa = kind == "swa"
    lens = [p + e for p, e in reqs]
    swa_from = [max(0, p - W + 1) for p, _ in reqs] if swa else None
    H, _, D, W, _ = SHAPES[shape]
    pools, sink = _make(shape, dtype, tuple(lens), None if swa_from is None else tuple(swa_from), 12)
    g = torch.Generator().manual_seed(22)
    window = W if swa else None
    prefix = [p for p, _ in reqs]
    indptr, indices, start = _build_lists(pools, prefix, prefix, window, swa)
    qo = torch.tensor([0] + [e for _, e in reqs]).cumsum(0).to(torch.int32)
    T = int(qo[-1])
    q = torch.randn(T, H, D, generator=g).to(dtype).to(DEV)
    k_new = torch.cat([pools.k_true[b][p:] for b, (p, _) in enumerate(reqs)]).to(DEV)
    v_new = torch.cat([pools.v_true[b][p:] for b, (p, _) in enumerate(reqs)]).to(DEV)
    out = torch.full((T, H, D), float("nan"), dtype=dtype, device=DEV)
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if swa else (pools.k_full, pools.v_full)
    extend_attention(q, k_new, v_new, out, k_buf, v_buf, qo.to(DEV), indptr, indices,
                     torch.tensor(prefix, dtype=torch.int32, device=DEV), D**-0.5,
                     max_extend_len=max(e for _, e in reqs), window=window, sinks=sink, prefix_start=start)
    for b, (p, e) in enumerate(reqs):
        kt, vt = pools.k_true[b].to(DEV), pools.v_true[b].to(DEV)
        for c in range(0, e, 256):  # query chunks keep the float64 score matrix small
            n = min(256, e - c)
            vis = window_mask(torch.arange(p + c, p + c + n), torch.arange(p + e), window).to(DEV)
            rows = slice(int(qo[b]) + c, int(qo[b]) + c + n)
            ref = attend_ref(q[rows], kt, vt, vis, D**-0.5, 0.0, sink)
            where = f"{shape} {kind} extend, prefix {p}, queries {p + c}..{p + c + n - 1}"
            _check(out[rows], ref, dtype, where)


@pytest.mark.parametrize("shape,dtype", CASES, ids=CASE_IDS)
def test_store_kv_real_shapes(shape, dtype):
    """New tokens' K/V land exactly at their slots — full pool by int64 full slots, SWA pool through
    loc_map=full_to_swa and through pre-translated int32 slots — a -1 slot is skipped, and no other
    byte of either pool changes."""
    _, Hkv, D, _, _ = SHAPES[shape]
    pools, _ = _make(shape, dtype, (70, 300), None, 13)
    g = torch.Generator().manual_seed(23)
    T = 37
    live = pools.req_to_token[pools.rows[1], :300].long()
    locs = live[torch.randperm(300, generator=g)[:T].to(DEV)]  # shuffled, unique full slots
    locs[5] = -1
    k = torch.randn(T, Hkv, D, generator=g).to(dtype).to(DEV)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype).to(DEV)
    keep = locs >= 0
    swa_locs = torch.where(keep, pools.full_to_swa[locs.clamp_min(0)], -1).to(torch.int32)

    def bits(t: torch.Tensor) -> torch.Tensor:  # NaN-exact comparison
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32)

    for name, k_buf, v_buf, args in [  # each case writes into its own untouched copy of the pools
        ("full", pools.k_full.clone(), pools.v_full.clone(), (locs,)),
        ("swa via loc_map", pools.k_swa.clone(), pools.v_swa.clone(), (locs, pools.full_to_swa)),
        ("swa int32 slots", pools.k_swa.clone(), pools.v_swa.clone(), (swa_locs,)),
    ]:
        slots = (locs if name == "full" else swa_locs.long())[keep]
        want_k, want_v = k_buf.clone(), v_buf.clone()
        want_k[slots], want_v[slots] = k[keep], v[keep]
        store_kv(k_buf, v_buf, args[0], k, v, loc_map=args[1] if len(args) > 1 else None)
        assert torch.equal(bits(k_buf), bits(want_k)), f"{shape} store_kv {name}: K pool differs"
        assert torch.equal(bits(v_buf), bits(want_v)), f"{shape} store_kv {name}: V pool differs"
