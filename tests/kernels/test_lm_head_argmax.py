"""lm_head_argmax (greedy tokens without logits) against the argmax of float64 logits."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.lm_head_argmax import SMALL_M, lm_head_argmax

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]
# Small tiles keep the interpreter fast and put several vocab tiles (and a ragged last one) in play.
SMALL = {"block_n": 32, "block_k": 32, "num_stages": 2}


def _ref_logits(x: torch.Tensor, w: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = x.double() @ w.double().T
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _assert_argmax(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, softcap: float | None, seed: int) -> None:
    """`got` is the reference argmax, or (rounding differs from float64) a token whose reference
    logit is within a rounding tolerance of the best one."""
    ref = _ref_logits(x, w, softcap)
    want = ref.argmax(-1)
    assert got.shape == want.shape and got.dtype == torch.int64
    got_c, want_c = got.cpu(), want.cpu()
    best = ref.gather(1, want[:, None]).squeeze(1).cpu()
    picked = ref.gather(1, got.to(ref.device)[:, None]).squeeze(1).cpu()
    tol = 1e-3 if x.dtype == torch.float32 else 2e-2
    near = (best - picked).abs() <= tol * (1 + best.abs())
    bad = (got_c != want_c) & ~near
    assert not bad.any(), f"seed={seed}: rows {bad.nonzero().flatten().tolist()} got {got_c[bad].tolist()}, " \
                          f"want {want_c[bad].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,softcap", [(1, 100, 64, None), (5, 300, 96, None), (7, 257, 200, 30.0),
                                           (SMALL_M + 3, 130, 64, None), (0, 64, 32, None)])
def test_matches_reference_argmax(device, seed, dtype, m, n, k, softcap):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g).to(device, dtype)
    if softcap is not None:
        x = x * 4  # logits beyond the cap, where tanh bends
    got = lm_head_argmax(x, w, softcap, **SMALL)
    _assert_argmax(got, x, w, softcap, seed)


@pytest.mark.parametrize("m", [3, SMALL_M + 2])  # both launch settings
def test_default_launch_settings(device, seed, m):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 64, generator=g).to(device)
    w = torch.randn(600, 64, generator=g).to(device)
    _assert_argmax(lm_head_argmax(x, w), x, w, None, seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_lowest_index(device, seed, dtype):
    """Equal best logits (identical weight rows) pick the lowest index, as torch.argmax does: within
    a tile and across tiles."""
    g = torch.Generator().manual_seed(seed)
    n, k = 2200, 32  # 69 tiles of 32, the last one ragged
    # Small integers: every dot product is exact in any order, so the tied logits are equal bits.
    x = torch.randint(-3, 4, (4, k), generator=g).to(dtype)
    w = torch.randint(-1, 2, (n, k), generator=g).to(dtype)
    pairs = [(5, 9), (40, 70), (3, 2150), (1000, 1100)]  # same tile, neighbour tiles, far tiles
    for row, (lo, hi) in enumerate(pairs):
        w[lo] = w[hi] = x[row] * 2  # the clear best of this row, twice
    x, w = x.to(device), w.to(device)
    got = lm_head_argmax(x, w, **SMALL).cpu()
    assert got.tolist() == [lo for lo, _ in pairs], f"seed={seed}: {got.tolist()}"


def test_ties_across_combine_chunks(device):
    """Tiles over several steps of the combine kernel's loop (4 tiles a step here): a later step's
    strictly better value wins, an equal one does not."""
    x = torch.ones(1, 16, device=device)
    w = torch.zeros(10 * 16, 16, device=device)  # 10 tiles of 16: steps of tiles 0-3, 4-7, 8-9
    w[1 * 16 + 1] = w[6 * 16 + 2] = 1.0  # tied, in steps 0 and 1
    w[9 * 16 + 7] = 2.0  # step 2
    kw = {"block_n": 16, "block_k": 16, "num_stages": 1, "combine_block": 4}
    assert lm_head_argmax(x, w, **kw).tolist() == [9 * 16 + 7]
    w[9 * 16 + 7] = 0.0
    assert lm_head_argmax(x, w, **kw).tolist() == [1 * 16 + 1]


def test_rows_do_not_depend_on_batch(device, seed):
    """A row's token is the same alone and among other rows (same side of SMALL_M)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 64, generator=g).to(device)
    w = torch.randn(500, 64, generator=g).to(device)
    together = lm_head_argmax(x, w, **SMALL).cpu()
    alone = torch.cat([lm_head_argmax(x[i : i + 1], w, **SMALL).cpu() for i in range(9)])
    assert torch.equal(together, alone)


def test_rejects_mismatched_hidden_size(device):
    with pytest.raises(ValueError, match="hidden size"):
        lm_head_argmax(torch.zeros(2, 8, device=device), torch.zeros(10, 16, device=device))
