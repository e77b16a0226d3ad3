"""top_p_threshold (sort-free nucleus threshold) against the sort-and-cumsum definition in float64."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.top_p import top_p_threshold


def _ref_threshold(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The Sampler's definition: sort descending, keep an entry iff the mass strictly before it is
    < top_p; the threshold is the last kept value (-inf where top_p >= 1)."""
    x = logits.double().cpu()
    vals = x.sort(dim=-1, descending=True).values
    probs = torch.softmax(vals, dim=-1)
    mass_above = probs.cumsum(-1) - probs
    keep = (mass_above < top_p.double().cpu()[:, None]).sum(-1)
    thr = vals.gather(1, (keep - 1).clamp(min=0)[:, None])
    return torch.where(top_p.cpu()[:, None] >= 1.0, torch.tensor(float("-inf"), dtype=torch.float64), thr)


def _mass(logits: torch.Tensor, thr: torch.Tensor, strict: bool) -> torch.Tensor:
    x = logits.double().cpu()
    p = torch.softmax(x, -1)
    sel = x > thr.double().cpu() if strict else x >= thr.double().cpu()
    return (p * sel).sum(-1)


def _check(logits: torch.Tensor, top_p: torch.Tensor, got: torch.Tensor, seed: int) -> None:
    want = _ref_threshold(logits, top_p)
    got = got.double().cpu()
    same = (got == want).squeeze(1)
    # Where the cut lands within float32 rounding of top_p, either side of it is right.
    p = top_p.double().cpu()
    gaps = torch.stack([(_mass(logits, t, strict) - p).abs() for t in (got, want) for strict in (True, False)])
    near = gaps.min(0).values < 1e-5
    bad = ~(same | near)
    assert not bad.any(), (f"seed={seed}: rows {bad.nonzero().flatten().tolist()}: got {got[bad].flatten().tolist()} "
                           f"want {want[bad].flatten().tolist()}")


@pytest.mark.parametrize("n,scale", [(3000, 1.0), (3000, 8.0), (700, 0.05), (100, 3.0)])
def test_matches_sorted_cumsum(device, seed, n, scale):
    g = torch.Generator().manual_seed(seed)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.999, 1.0] * 2)
    logits = torch.randn(len(top_p), n, generator=g) * scale
    got = top_p_threshold(logits.to(device), top_p.to(device), chunk=512)
    _check(logits, top_p, got, seed)


def test_ties_at_the_edge_are_kept(device):
    """Integer logits with many equal values: the threshold is a value, so every token tied with
    the last kept one stays (as the sort path keeps them)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-4, 3, (6, 1500), generator=g).float()
    top_p = torch.tensor([0.2, 0.4, 0.6, 0.7, 0.9, 0.99])
    got = top_p_threshold(logits.to(device), top_p.to(device), chunk=512)
    _check(logits, top_p, got, 3)
    assert (got.cpu().squeeze(1) == got.cpu().squeeze(1).round()).all()  # an actual logit value


def test_peaked_row_keeps_only_the_top(device):
    logits = torch.zeros(2, 500)
    logits[:, 17] = 30.0  # holds all but ~1e-11 of the mass
    got = top_p_threshold(logits.to(device), torch.tensor([0.9, 1.0], device=device), chunk=128).cpu()
    assert got[0].item() == 30.0 and got[1].item() == float("-inf")
