"""lm_head_argmax (greedy tokens and temperature samples without logits) against the argmax of
float64 logits (plus the NumPy reference of its Gumbel noise), and the samples' distribution."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.lm_head_argmax import SMALL_M, gumbel_noise_ref, lm_head_argmax

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]
# Small tiles keep the interpreter fast and put several vocab tiles (and a ragged last one) in play.
SMALL = {"block_n": 32, "block_k": 32, "num_stages": 2}


def _ref_logits(x: torch.Tensor, w: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = x.double() @ w.double().T
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _assert_argmax(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, softcap: float | None, seed: int,
                   ref: torch.Tensor | None = None) -> None:
    """`got` is the reference argmax, or (rounding differs from float64) a token whose reference
    score (default: the logits) is within a rounding tolerance of the best one."""
    ref = _ref_logits(x, w, softcap) if ref is None else ref
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


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_values_are_the_best_logits(device, seed, softcap):
    """`values=` (the tensor-parallel greedy head compares ranks' best logits): each row's best
    (soft-capped) logit, the one at the returned token, as the kernel computed it."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(SMALL_M + 3, 64, generator=g) * 4).to(device)
    w = torch.randn(150, 64, generator=g).to(device)
    best = torch.empty(x.shape[0], dtype=torch.float32, device=device)
    got = lm_head_argmax(x, w, softcap, values=best, **SMALL)
    ref = _ref_logits(x, w, softcap)
    _assert_argmax(got, x, w, softcap, seed, ref)
    at_token = ref.gather(1, got[:, None]).squeeze(1).float()
    torch.testing.assert_close(best, at_token, rtol=1e-4, atol=1e-4)
    assert torch.equal(lm_head_argmax(x, w, softcap, **SMALL), got)  # asking for values changes nothing


def _random_masks(g: torch.Generator, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[m, ceil(n/32)]` int32 bitmasks (about a third of the tokens allowed, sign bits included; one row
    allowing a single token) and the same as `[m, n]` bool."""
    allowed = torch.rand(m, n, generator=g) < 0.3
    if m > 1:
        allowed[1] = False
        allowed[1, n - 1] = True  # a single allowed token, in the ragged last tile
    words = torch.zeros(m, (n + 31) // 32 * 32, dtype=torch.int64)
    words[:, :n] = allowed.long()
    words = (words.view(m, -1, 32) << torch.arange(32)).sum(-1)  # bit b of each word, as uint32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32), allowed


@pytest.mark.parametrize("indexed", [False, True], ids=["every_row", "some_rows"])
@pytest.mark.parametrize("noise", [False, True], ids=["greedy", "sampled"])
def test_masked_rows_take_the_best_allowed_token(device, seed, indexed, noise):
    """Structured outputs: a row with a mask gets the argmax of its logits with every disallowed token at
    -inf (greedy), or of its noisy scores likewise (sampled); rows without one (`allowed_index` -1) are
    untouched."""
    g = torch.Generator().manual_seed(seed)
    m, n, k = 9, 200, 64
    x = torch.randn(m, k, generator=g).to(device)
    w = torch.randn(n, k, generator=g).to(device)
    ref = _ref_logits(x, w, None)
    kw = {}
    if noise:
        inv_t = torch.full((m,), 1.5)
        inv_t[0] = 0.0  # a greedy row among sampled ones
        seeds = torch.randint(0, 2**62, (m,), generator=g)
        ref = torch.where(inv_t[:, None].double().to(ref.device) > 0, ref * inv_t[:, None].double().to(ref.device)
                          + torch.from_numpy(gumbel_noise_ref(seeds.numpy(), np.arange(n))).double().to(ref.device), ref)
        kw = {"inv_temperature": inv_t.to(device), "seeds": seeds.to(device)}
    if indexed:
        rows = [1, 4, 6]
        words, allowed = _random_masks(g, len(rows), n)
        index = torch.full((m,), -1, dtype=torch.int32)
        index[rows] = torch.arange(len(rows), dtype=torch.int32)
        full = torch.ones(m, n, dtype=torch.bool)
        full[rows] = allowed
        got = lm_head_argmax(x, w, None, allowed=words.to(device), allowed_index=index.to(device), **kw, **SMALL)
    else:
        words, full = _random_masks(g, m, n)
        got = lm_head_argmax(x, w, None, allowed=words.to(device), **kw, **SMALL)
    masked = ref.masked_fill(~full.to(ref.device), float("-inf"))
    assert full.gather(1, got.cpu()[:, None]).all(), "a disallowed token"
    _assert_argmax(got, x, w, None, seed, masked)
    if not indexed:
        assert got[1].item() == n - 1  # the only token its mask allows


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


def _sampling_scores(x, w, softcap, inv_t: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    logits = _ref_logits(x, w, softcap).cpu()
    noise = torch.from_numpy(gumbel_noise_ref(seeds.cpu().numpy(), np.arange(w.shape[0]))).double()
    t = inv_t.cpu().double()[:, None]
    return torch.where(t > 0, logits * t + noise, logits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,softcap", [(6, None), (SMALL_M + 5, 30.0)])
def test_sampling_matches_reference_noise(device, seed, dtype, m, softcap):
    """Rows with a positive inverse temperature take argmax(logits / T + Gumbel(seed, token)); rows
    with 0 stay greedy in the same launch."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, 64, generator=g) * 0.2).to(device, dtype)  # flat enough that the noise decides
    w = torch.randn(300, 64, generator=g).to(device, dtype)
    inv_t = 0.5 + torch.rand(m, generator=g) * 2
    inv_t[::3] = 0.0  # greedy rows
    seeds = torch.randint(0, 1 << 62, (m,), generator=g)
    seeds[1] = (1 << 63) - 1  # the largest seed
    got = lm_head_argmax(x, w, softcap, inv_t.to(device), seeds.to(device), **SMALL)
    _assert_argmax(got, x, w, softcap, seed, ref=_sampling_scores(x, w, softcap, inv_t, seeds))
    # (That the noise is there at all: test_a_rows_draw_depends_only_on_its_seed's flat rows.)


def test_sampling_follows_softmax(device):
    """3,000 draws (one per row, distinct seeds) from 6 tokens at T = 0.7 land on each token with
    its softmax probability, within 4.5 standard deviations (fixed seeds: passes or fails for good)."""
    n_rows, k = 3000, 16  # the combine kernel runs one interpreter program per row
    logits = torch.tensor([1.0, 0.2, -0.5, 0.9, -2.0, 0.0])
    x = torch.zeros(n_rows, k)
    x[:, 0] = 1.0
    w = torch.zeros(6, k)
    w[:, 0] = logits
    inv_t = torch.full((n_rows,), 1 / 0.7)
    seeds = torch.arange(n_rows, dtype=torch.int64) * 7919 + 12345
    big_rows = {"block_m": 1024, "block_n": 16, "block_k": 16, "num_stages": 1}  # few programs (interpreter)
    got = lm_head_argmax(x.to(device), w.to(device), None, inv_t.to(device), seeds.to(device), **big_rows).cpu()
    freq = torch.bincount(got, minlength=6).double() / n_rows
    p = torch.softmax(logits.double() / 0.7, 0)
    sd = (p * (1 - p) / n_rows).sqrt()
    assert ((freq - p).abs() <= 4.5 * sd).all(), f"frequencies {freq.tolist()} vs {p.tolist()}"


def test_a_rows_draw_depends_only_on_its_seed(device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 32, generator=g).to(device)
    w = torch.randn(400, 32, generator=g).to(device)
    inv_t = torch.ones(5, device=device)
    seeds = torch.randint(0, 1 << 62, (5,), generator=g).to(device)
    together = lm_head_argmax(x, w, None, inv_t, seeds, **SMALL).cpu()
    alone = torch.cat([lm_head_argmax(x[i : i + 1], w, None, inv_t[i : i + 1], seeds[i : i + 1], **SMALL).cpu()
                       for i in range(5)])
    assert torch.equal(together, alone)
    flat = torch.zeros(64, 32, device=device)  # uniform logits: the token is the seed's choice
    draws = lm_head_argmax(flat, w, None, torch.ones(64, device=device),
                           torch.arange(64, dtype=torch.int64, device=device), **SMALL)
    assert len(set(draws.tolist())) > 40, "seeds do not spread the draws"


def test_sampling_needs_both_temperature_and_seeds(device):
    x, w = torch.zeros(2, 8, device=device), torch.zeros(10, 8, device=device)
    with pytest.raises(ValueError, match="together"):
        lm_head_argmax(x, w, inv_temperature=torch.ones(2, device=device))
