"""Fused MoE (sorted grouped GEMMs) vs the per-expert reference, and the pair alignment's invariants:
random routings, experts with no tokens, every token on one expert, padded (invalid) rows, poisoned
buffers; fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels.fused_moe import align_pairs, fused_moe
from swaserve.layers.fused_moe import moe_experts_reference


def _problem(n, E, k, H, I, dtype, device, seed, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g).to(dtype)
    w1 = (0.2 * torch.randn(E, 2 * I, H, generator=g)).to(dtype)
    w2 = (0.2 * torch.randn(E, H, I, generator=g)).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]) if n else torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(n, k, generator=g)
    return [t.to(device) for t in (x, w1, w2, w.float(), ids)]


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_matches_reference(n, dtype, act, device, seed):
    x, w1, w2, w, ids = _problem(n, 6, 2, 48, 24, dtype, device, seed)
    out = fused_moe(x, w1, w2, w, ids, act)
    ref = moe_experts_reference(x.cpu(), w1.cpu(), w2.cpu(), w.cpu(), ids.cpu(), act)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    else:  # a bf16 ulp of the intermediate flips with the accumulation order: compare against the scale
        err = (out.cpu().float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err < 4e-2, err


def test_reference_is_the_dense_formula(seed):
    x, w1, w2, w, ids = _problem(5, 4, 3, 32, 16, torch.float64, "cpu", seed)
    dense = torch.zeros(5, 32, dtype=torch.float64)
    for t in range(5):
        for j in range(3):
            e = int(ids[t, j])
            gate, up = (w1[e] @ x[t]).chunk(2)
            dense[t] += w[t, j].double() * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    # The reference weights and sums in float32, as the kernel does.
    torch.testing.assert_close(moe_experts_reference(x, w1, w2, w.double(), ids, "silu"), dense, rtol=1e-5, atol=1e-5)


def test_one_expert_takes_everything_and_the_rest_nothing(device, seed):
    n, E, k = 40, 8, 2  # 40 pairs on expert 5 (slot 0) and 40 on expert 2: several blocks each
    ids = torch.tensor([[5, 2]] * n)
    x, w1, w2, w, ids = _problem(n, E, k, 32, 16, torch.float32, device, seed, ids=ids)
    out = fused_moe(x, w1, w2, w, ids, "gelu_tanh", block_m=16)
    ref = moe_experts_reference(x.cpu(), w1.cpu(), w2.cpu(), w.cpu(), ids.cpu(), "gelu_tanh")
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_invalid_rows_are_zero_and_leave_valid_rows_unchanged(device, seed):
    x, w1, w2, w, ids = _problem(9, 6, 2, 32, 16, torch.float32, device, seed)
    valid = torch.tensor([True, False, True, True, False, True, True, True, False], device=device)
    full = fused_moe(x, w1, w2, w, ids, "gelu_tanh")
    masked = fused_moe(x, w1, w2, w, ids, "gelu_tanh", row_valid=valid)
    assert (masked[~valid] == 0).all()
    assert torch.equal(masked[valid], full[valid]), "padded rows changed real rows"
    ref = moe_experts_reference(x.cpu(), w1.cpu(), w2.cpu(), w.cpu(), ids.cpu(), "gelu_tanh", valid.cpu())
    torch.testing.assert_close(masked.cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_m", [16, 32])
def test_alignment_invariants(block_m, seed):
    g = torch.Generator().manual_seed(seed)
    n, k, E = 23, 3, 7
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    ids[:5] = torch.tensor([4, 0, 1])  # a crowded expert or two
    valid = torch.rand(n, generator=g) > 0.2
    pairs, experts = align_pairs(ids, E, block_m, valid)
    N = n * k
    assert pairs.numel() == experts.numel() * block_m and experts.numel() * block_m >= N + E * (block_m - 1)
    want = {t * k + j for t in range(n) for j in range(k) if valid[t]}
    got = [int(p) for p in pairs if p < N]
    assert sorted(got) == sorted(want), "every valid pair exactly once, no invalid pair"
    flat = ids.reshape(-1)
    for b, e in enumerate(experts.tolist()):
        block = pairs[b * block_m : (b + 1) * block_m]
        real = block[block < N].long()
        if e < 0:
            assert real.numel() == 0, "an unused block holds pairs"
            continue
        assert real.numel() > 0 and (flat[real] == e).all(), f"block {b} mixes experts"
        assert torch.equal(real, real.sort().values), "pairs in token order within an expert"
        pad = block >= N
        assert not pad.any() or pad.nonzero().min() >= real.numel(), "sentinels only after the pairs"


def test_poisoned_intermediates_do_not_leak(device, seed, monkeypatch):
    # The pair buffers start as NaN: rows the kernels do not write must never be read.
    real_empty = torch.empty

    def nan_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    x, w1, w2, w, ids = _problem(5, 8, 2, 32, 16, torch.float32, device, seed)
    valid = torch.tensor([True, True, False, True, True], device=device)
    out = fused_moe(x, w1, w2, w, ids, "silu", row_valid=valid)
    assert torch.isfinite(out).all()
