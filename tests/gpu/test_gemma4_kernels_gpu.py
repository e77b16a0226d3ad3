"""Gemma 4 26B-A4B attention on CUDA at its real shapes vs a dense float64 reference: sliding layers
(16 q / 8 kv heads, d256, window 1024) and full layers (16 q / 2 kv heads, d512), bf16, scaling 1.0,
no soft-cap, contexts ~1k and 8k with queries at W-1, W, W+1, 2W+3; decode with the backend's split
count, one split and the one-launch combine; extend one-shot and chunked. Then Gemma 4's fused
K/V store forms (V norm, K = V, q only) at real shapes against the layer's unfused path.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))  # the kernel tests' oracle
from kernel_ref import attend_ref, gemma4_attention, make_pools, run_both_paths, window_mask

from swaserve.kernels import (
    build_kv_indices,
    decode_attention,
    extend_attention,
    kv_indices_capacity,
    num_kv_splits_for,
    split_counter_count,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
W = 1024
SHAPES = {"sliding": (16, 8, 256, W), "full": (16, 2, 512, None)}  # H, Hkv, head_dim, window
MAX_CONTEXT = 8192 + 64  # what full-layer split counts are sized for
LONG = 8192
# Queries at positions W-1, W, W+1, 2W+3 and 8k-1. q at RMS 2/sqrt(D) against unit K: logits with a
# spread of ~2 at scaling 1.0, as normed q/k give, so the softmax is neither flat nor one-hot.
DECODE_LENS = (W, W + 1, W + 2, 2 * W + 4, LONG)
# (prefix, new): a one-shot ~1k prefill crossing W-1 and W, W-1..W+1 on a cached prefix, 2W..2W+3,
# and the last 1.5k of an 8k chunked prefill (its prefix list starts far from position 0).
EXTEND_REQS = ((0, W + 1), (W - 1, 3), (2 * W, 4), (LONG - 1536, 1536))
REL = 2e-2  # bf16 inputs, probabilities (for P.V) and outputs


@functools.lru_cache(maxsize=1)
def _pools(kind: str, lens: tuple[int, ...], swa_from: tuple[int, ...] | None, seed: int):
    """Known bf16 K/V per position in shuffled full slots and a shuffled SWA pool (evicted positions
    and slot 0 NaN). Cached: the decode parametrisations differ only in how splits are combined."""
    _, hkv, d, _ = SHAPES[kind]
    g = torch.Generator().manual_seed(seed)
    return make_pools(list(lens), hkv, d, d, torch.bfloat16, g, DEV, max_context=max(lens) + 5,
                      swa_from=None if swa_from is None else list(swa_from))


def _lists(pools, kv_lens: list[int], first_q: list[int] | None, window: int | None):
    bs = len(kv_lens)
    indptr = torch.empty(bs + 1, dtype=torch.int32, device=DEV)
    indices = torch.zeros(kv_indices_capacity(bs, pools.req_to_token.shape[1], window), dtype=torch.int32,
                          device=DEV)
    start = torch.empty(bs, dtype=torch.int32, device=DEV)
    fq = torch.tensor(first_q, dtype=torch.int32, device=DEV) if first_q is not None else None
    build_kv_indices(pools.req_to_token, pools.rows, torch.tensor(kv_lens, dtype=torch.int32, device=DEV), indptr,
                     indices, window=window, full_to_swa=pools.full_to_swa if window else None,
                     first_query_pos=fq, kv_start=start)
    return indptr, indices, start


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Relative to the reference's scale: with thousands of keys the outputs are small, so an absolute
    tolerance alone would let a dropped half of the keys pass."""
    assert not out.isnan().any(), f"{what}: NaN (unwritten output or a poisoned slot was read)"
    out = out.double()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < REL / 2, f"{what}: relative error {rel:.2e}"
    torch.testing.assert_close(out, ref, rtol=REL, atol=REL * ref.abs().max().item(), msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("combine", ["auto", "direct", "one-launch"])  # fastest-varying: pools are reused
@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_decode_gemma4_26b(kind, combine):
    H, Hkv, D, window = SHAPES[kind]
    lens = list(DECODE_LENS)
    evicted = tuple(max(0, L - W) for L in lens) if window else None
    pools = _pools(kind, DECODE_LENS, evicted, 31)
    indptr, indices, _ = _lists(pools, lens, None, window)
    bs = len(lens)
    splits, counters = 1, None
    if combine != "direct":  # what the triton backend picks for this batch (static shapes only)
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        splits = num_kv_splits_for(bs, H, Hkv, window or MAX_CONTEXT, sms)
        assert splits > 1, "a 5-request batch at these head counts is split"
    if combine == "one-launch":
        counters = torch.zeros(split_counter_count(bs, H, Hkv), dtype=torch.int32, device=DEV)
    g = torch.Generator().manual_seed(41)
    q = (torch.randn(bs, H, D, generator=g) * 2 * D**-0.5).to(torch.bfloat16).to(DEV)
    out = torch.full((bs, H, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if window else (pools.k_full, pools.v_full)
    decode_attention(q, k_buf, v_buf, indptr, indices, out, 1.0, num_kv_splits=splits, split_counters=counters)
    if counters is not None:
        assert not counters.any(), "every combining program resets its counter"
    for b, L in enumerate(lens):
        vis = window_mask(torch.tensor([L - 1]), torch.arange(L), window).to(DEV)
        ref = attend_ref(q[b : b + 1], pools.k_true[b].to(DEV), pools.v_true[b].to(DEV), vis, 1.0)
        _check(out[b : b + 1], ref, f"{kind} decode, query at {L - 1}, {splits} splits ({combine})")


@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_extend_gemma4_26b(kind):
    H, Hkv, D, window = SHAPES[kind]
    lens = tuple(p + e for p, e in EXTEND_REQS)
    swa_from = tuple(max(0, p - W + 1) for p, _ in EXTEND_REQS) if window else None
    pools = _pools(kind, lens, swa_from, 32)
    prefix = [p for p, _ in EXTEND_REQS]
    indptr, indices, start = _lists(pools, prefix, prefix, window)
    qo = torch.tensor([0] + [e for _, e in EXTEND_REQS]).cumsum(0).to(torch.int32)
    T = int(qo[-1])
    g = torch.Generator().manual_seed(42)
    q = (torch.randn(T, H, D, generator=g) * 2 * D**-0.5).to(torch.bfloat16).to(DEV)
    k_new = torch.cat([pools.k_true[b][p:] for b, (p, _) in enumerate(EXTEND_REQS)]).to(DEV)
    v_new = torch.cat([pools.v_true[b][p:] for b, (p, _) in enumerate(EXTEND_REQS)]).to(DEV)
    out = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if window else (pools.k_full, pools.v_full)
    extend_attention(q, k_new, v_new, out, k_buf, v_buf, qo.to(DEV), indptr, indices,
                     torch.tensor(prefix, dtype=torch.int32, device=DEV), 1.0,
                     max_extend_len=max(e for _, e in EXTEND_REQS), window=window, prefix_start=start)
    for b, (p, e) in enumerate(EXTEND_REQS):
        kt, vt = pools.k_true[b].to(DEV), pools.v_true[b].to(DEV)
        for c in range(0, e, 256):  # query chunks keep the float64 score matrix small
            n = min(256, e - c)
            vis = window_mask(torch.arange(p + c, p + c + n), torch.arange(p + e), window).to(DEV)
            rows = slice(int(qo[b]) + c, int(qo[b]) + c + n)
            ref = attend_ref(q[rows], kt, vt, vis, 1.0)
            _check(out[rows], ref, f"{kind} extend, prefix {p}, queries {p + c}..{p + c + n - 1}")


@pytest.mark.parametrize("form,shape", [("v_norm", "sliding"), ("k_eq_v", "full"), ("v_norm", "full"),
                                        ("kv_shared", "sliding"), ("kv_shared", "full")])
def test_fused_store_forms_gemma4_26b(form, shape):
    """SelfAttention's fused norm + rotary + store (one launch) against its unfused path (RMSNorm and
    rotary kernels, then a plain store) at the real head counts: q for attention, the pools, and the
    k/v the backend is handed (None where it must read them back from the pool)."""
    H, Hkv, D, _ = SHAPES[shape]
    g = torch.Generator().manual_seed(43)
    T, slots, hidden = 257, 4096, 1024  # the hidden size only feeds the projection
    attn = gemma4_attention(form, H, Hkv, D, torch.bfloat16, DEV, g, hidden=hidden, v_eps=1e-6)
    x = (torch.randn(T, hidden, generator=g) * 3).to(torch.bfloat16).to(DEV)
    positions = torch.randint(0, 8192, (T,), generator=g).to(DEV)
    locs = (torch.randperm(slots - 1, generator=g)[:T] + 1).to(DEV)
    locs[7] = -1  # skipped

    def pool():
        return (torch.full((slots, Hkv, D), float("nan"), dtype=torch.bfloat16, device=DEV),
                torch.full((slots, Hkv, D), -7.0, dtype=torch.bfloat16, device=DEV))

    res = run_both_paths(attn, x, positions, locs, pool)
    (ref, *ref_pools), (got, *got_pools) = res[False], res[True]
    assert got["kv_stored"]
    pairs = [("q", got["q"], ref["q"])]
    if form == "kv_shared":
        assert got["k"] is None and got["v"] is None
        assert got_pools[0].isnan().all() and (got_pools[1] == -7.0).all(), "a KV-shared layer stores nothing"
    else:
        assert (got["v"] is None) == (form == "k_eq_v"), "k_eq_v's V exists only in the pool"
        pairs += [(n, got[n], ref[n]) for n in ("k", "v") if got[n] is not None]
        keep = (locs >= 0).nonzero().squeeze(1)
        rows = locs[keep].long()
        pairs += [("k pool", got_pools[0][rows], ref_pools[0][rows]),
                  ("v pool", got_pools[1][rows], ref_pools[1][rows])]
        unwritten = torch.ones(slots, dtype=torch.bool, device=DEV)
        unwritten[rows] = False
        assert got_pools[0][unwritten].isnan().all() and (got_pools[1][unwritten] == -7.0).all(), "stray write"
    for name, a, b in pairs:
        # Both paths round the norm to bf16 before the rotation; they may differ by an ulp there.
        a, b = a.float(), b.float()
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 4e-3, f"{form} {shape} {name}: relative error {rel:.2e}"
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1.6e-2, msg=lambda m, n=name: f"{form} {shape} {n}: {m}")
