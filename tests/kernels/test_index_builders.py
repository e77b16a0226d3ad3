"""build_kv_indices: CSR key lists (full and windowed, translated into SWA space), and window_slots
(deterministic decode's per-request window table), vs Python loops."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "triton", reason="triton is not installed; kernel tests need it (CPU: TRITON_INTERPRET=1)"
)

from swaserve.kernels.index_builders import build_kv_indices, kv_indices_capacity, window_slots


def _expected(r2t, rows, kv_lens, window, f2s, first_q):
    indptr, indices, starts = [0], [], []
    for b, (row, L) in enumerate(zip(rows.tolist(), kv_lens.tolist())):
        q0 = L - 1 if first_q is None else int(first_q[b])
        start = 0 if window is None else min(max(0, q0 - window + 1), L)
        slots = r2t[row, start:L].long()
        if f2s is not None:
            slots = f2s[slots].long()
        indices += slots.tolist()
        indptr.append(indptr[-1] + L - start)
        starts.append(start)
    return indptr, indices, starts


@pytest.mark.parametrize(
    "window,translate,extend,idx_dtype,progs",
    [
        (None, False, False, torch.int64, 1),
        (8, True, False, torch.int32, 1),  # decode window, SWA space
        (8, True, True, torch.int32, 2),  # extend prefix window (first query at prefix_len)
        (1, False, False, torch.int64, 3),  # W = 1: only the query itself
        (50, False, True, torch.int32, 2),  # window wider than every request
    ],
)
def test_build_kv_indices(window, translate, extend, idx_dtype, progs, device, seed):
    g = torch.Generator().manual_seed(seed)
    R, C, F = 6, 40, 300
    # Lengths around the window boundary, an empty request and a padded row (row 0, len 1).
    kv_lens = torch.tensor([7, 8, 9, 19, 0, 1, 33], dtype=torch.int32)
    rows = torch.tensor([3, 1, 6, 2, 5, 0, 4])
    r2t = torch.zeros(R + 1, C, dtype=torch.int32)
    r2t[1:] = (torch.randperm(F, generator=g)[: R * C].view(R, C) + 1).int()
    f2s = torch.zeros(F + 2, dtype=torch.int32)
    f2s[1:-1] = (torch.randperm(F, generator=g) + 1).int()  # non-monotonic translation
    f2s[-1] = -1
    f2s_arg = f2s if translate else None
    first_q = kv_lens.clone() if extend else None  # extend: prefix_len = first query position
    ind_indptr, ind, starts = _expected(r2t, rows, kv_lens, window, f2s_arg, first_q)

    bs = rows.numel()
    cap = kv_indices_capacity(bs, C, window)
    assert cap >= ind_indptr[-1]
    kv_indptr = torch.full((bs + 1,), -5, dtype=idx_dtype, device=device)
    kv_indices = torch.full((cap,), -7, dtype=idx_dtype, device=device)
    kv_start = torch.full((bs,), -9, dtype=torch.int32, device=device)
    d = lambda t: None if t is None else t.to(device)
    build_kv_indices(
        d(r2t),
        d(rows),
        d(kv_lens),
        kv_indptr,
        kv_indices,
        window=window,
        full_to_swa=d(f2s_arg),
        first_query_pos=d(first_q),
        kv_start=kv_start,
        num_programs_per_req=progs,
        block=4,
        block_bs=2,
    )
    n = ind_indptr[-1]
    assert kv_indptr.cpu().tolist() == ind_indptr, f"seed={seed}"
    assert kv_indices.cpu()[:n].tolist() == ind, f"seed={seed}"
    assert (kv_indices.cpu()[n:] == -7).all(), "wrote past kv_indptr[bs]"
    assert kv_start.cpu().tolist() == starts
    # The padded row lists the dummy slot only (0 in both spaces).
    pad = rows.tolist().index(0)
    assert kv_indices.cpu()[ind_indptr[pad] : ind_indptr[pad + 1]].tolist() == [0]


def test_build_kv_indices_empty_batch(device):
    kv_indptr = torch.full((1,), 3, dtype=torch.int32, device=device)
    build_kv_indices(
        torch.zeros(2, 4, dtype=torch.int32, device=device),
        torch.zeros(0, dtype=torch.int64, device=device),
        torch.zeros(0, dtype=torch.int32, device=device),
        kv_indptr,
        torch.zeros(4, dtype=torch.int32, device=device),
    )
    assert kv_indptr.tolist() == [0]


@pytest.mark.parametrize("window", [1, 8, 50, 1500])  # 1500: more than one program per request
def test_window_slots(window, device, seed):
    """Row b holds the SWA slots of positions lo .. q (lo = max(q - W + 1, 0)), then q's slot
    repeated up to W entries; a padded row (row 0, seq_len 1) reads the dummy slot."""
    g = torch.Generator().manual_seed(seed)
    R, C, F = 5, 2000, 12000
    seq = torch.tensor([7, 8, 9, 1, 1999, 60], dtype=torch.int32)
    rows = torch.tensor([3, 1, 5, 0, 2, 4])
    r2t = torch.zeros(R + 1, C, dtype=torch.int32)
    r2t[1:] = (torch.randperm(F, generator=g)[: R * C].view(R, C) + 1).int()
    f2s = torch.zeros(F + 2, dtype=torch.int32)
    f2s[1:-1] = (torch.randperm(F, generator=g) + 1).int()
    out = window_slots(r2t.to(device), rows.to(device), seq.to(device), f2s.to(device), window).cpu()
    assert out.shape == (len(rows), window) and out.dtype == torch.int32
    for b, (row, n) in enumerate(zip(rows.tolist(), seq.tolist())):
        q = n - 1
        lo = max(q - window + 1, 0)
        pos = [min(lo + j, q) for j in range(window)]
        assert out[b].tolist() == f2s[r2t[row, pos].long()].tolist(), (b, window)
    assert out[rows.tolist().index(0)].eq(0).all()
    with pytest.raises(ValueError, match="window"):
        window_slots(r2t, rows, seq, f2s, 0)
