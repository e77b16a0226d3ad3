"""Fused MoE (sorted grouped GEMMs) vs the per-expert reference, the pair alignment's invariants (its
one-program kernel and its torch-ops path agree) and the fixed-order combine: random routings, experts
with no tokens, every token on one expert, padded (invalid) rows, poisoned buffers; fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import moe_align
from swaserve.kernels.fused_moe import combine, fused_moe
from swaserve.kernels.moe_align import align_pairs, num_blocks
from swaserve.layers.fused_moe import moe_experts_reference


def _problem(n, E, k, H, I, dtype, device, seed, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g).to(dtype)
    w1 = (0.2 * torch.randn(E, 2 * I, H, generator=g)).to(dtype)
    w2 = (0.2 * torch.randn(E, H, I, generator=g)).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
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
    ref = moe_experts_reference(x, w1, w2, w.double(), ids, "silu")
    torch.testing.assert_close(ref, dense, rtol=1e-5, atol=1e-5)


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


def _check_alignment(ids, valid, E, block_m, pairs, experts):
    n, k = ids.shape
    N = n * k
    assert pairs.dtype == experts.dtype == torch.int32
    assert experts.numel() == num_blocks(N, E, block_m) and pairs.numel() == experts.numel() * block_m
    want = {t * k + j for t in range(n) for j in range(k) if valid is None or valid[t]}
    got = [int(p) for p in pairs if p != N]
    assert sorted(got) == sorted(want), "every valid pair exactly once, no invalid pair, no stray value"
    flat = ids.reshape(-1)
    used = experts >= 0
    assert not (used[1:] & ~used[:-1]).any(), "used blocks first"
    assert (experts[used].diff() >= 0).all(), "experts in ascending order"
    assert (experts < E).all()
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


def _routings(seed):
    """(name, ids, valid, E): random with crowded experts, every pair on one expert (a run longer than
    a block), one pair per expert (the most padding), and padded rows."""
    g = torch.Generator().manual_seed(seed)
    n, k, E = 23, 3, 7
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    ids[:5] = torch.tensor([4, 0, 1])
    yield "random", ids, torch.rand(n, generator=g) > 0.2, E
    yield "random_all_valid", ids, None, E
    yield "one_expert", torch.full((37, 1), 5), None, 8
    yield "one_pair_each", torch.randperm(12, generator=g)[:, None], None, 12
    yield "no_valid_row", ids[:4], torch.zeros(4, dtype=torch.bool), E


@pytest.mark.parametrize("block_m", [16, 32])
def test_alignment_invariants_both_paths(block_m, seed, device, monkeypatch):
    # Poisoned int buffers: every slot of the kernel's outputs must be written.
    real_empty = torch.empty

    def poison_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        return t.fill_(-77) if not t.is_floating_point() else t.fill_(float("nan"))

    for name, ids, valid, E in _routings(seed):
        ids_d, valid_d = ids.to(device), None if valid is None else valid.to(device)
        monkeypatch.setattr(torch, "empty", poison_empty)
        kernel = align_pairs(ids_d, E, block_m, valid_d, use_kernel=True)
        monkeypatch.setattr(torch, "empty", real_empty)
        ops = align_pairs(ids_d, E, block_m, valid_d, use_kernel=False)
        for pairs, experts in (kernel, ops):
            _check_alignment(ids, valid, E, block_m, pairs.cpu(), experts.cpu())
        assert torch.equal(kernel[0], ops[0]) and torch.equal(kernel[1], ops[1]), name


def test_sort_by_torch_ops_matches_reference(device, seed, monkeypatch):
    # Above ALIGN_KERNEL_MAX_PAIRS the pairs are sorted by torch ops (prefill); same result.
    monkeypatch.setattr(moe_align, "ALIGN_KERNEL_MAX_PAIRS", 0)
    x, w1, w2, w, ids = _problem(17, 6, 3, 32, 16, torch.float32, device, seed)
    valid = torch.arange(17, device=device) % 4 != 1
    out = fused_moe(x, w1, w2, w, ids, "gelu_tanh", row_valid=valid)
    ref = moe_experts_reference(x.cpu(), w1.cpu(), w2.cpu(), w.cpu(), ids.cpu(), "gelu_tanh", valid.cpu())
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_combine_sums_slots_in_order_whatever_the_batch(device, seed):
    g = torch.Generator().manual_seed(seed)
    n, k, H = 11, 4, 40
    y = (torch.randn(n * k, H, generator=g) * torch.logspace(-3, 3, H)).to(device)  # cancellation-prone
    w = torch.rand(n, k, generator=g).to(device)
    # Row 0, column 0: 1e8 + 1 - 1e8 + 1 is 1 summed in slot order in float32, 0 in reverse order.
    y.view(n, k, H)[0, :, 0] = torch.tensor([1e8, 1.0, -1e8, 1.0])
    w[0] = 1.0
    out = combine(y, w, None, torch.float32)
    assert out[0, 0] == 1.0, "slots not summed in order 0..k-1"
    # Against float64 within float32's summation bound: a GPU build may contract w * y + acc into an
    # FMA, which rounds differently from the separate multiply and add (and the interpreter).
    terms = (w.cpu().double()[:, :, None] * y.view(n, k, H).cpu().double())  # [n, k, H]
    bound = 2 * k * 2.0**-24 * terms.abs().sum(1)
    assert ((out.cpu().double() - terms.sum(1)).abs() <= bound).all()
    # A row's sum depends on nothing but its own k slots: a sub-batch gives the same bits.
    sub = combine(y[3 * k : 7 * k], w[3:7], None, torch.float32)
    assert torch.equal(sub, out[3:7])
    valid = torch.arange(n, device=device) % 3 != 0
    y_poisoned = y.clone().view(n, k, H)
    y_poisoned[~valid] = float("nan")  # rows the GEMMs never write for padded tokens
    masked = combine(y_poisoned.view(n * k, H), w, valid, torch.float32)
    assert (masked[~valid] == 0).all() and torch.equal(masked[valid], out[valid])
    low = combine(y_poisoned.view(n * k, H), w, valid, torch.bfloat16)  # the cast at the end only
    assert low.dtype == torch.bfloat16 and (low[~valid] == 0).all()
    torch.testing.assert_close(low[valid], out[valid].bfloat16(), rtol=8e-3, atol=0)


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


RUNS = ((0, 3), (3, 2), (5, 2))  # expert parallelism: 7 experts over 3 ranks, unevenly (3, 2, 2)


@pytest.mark.parametrize("sort", ["kernel", "torch_ops"])
def test_expert_parallel_runs_sum_to_the_whole(sort, device, seed, monkeypatch):
    """Each rank's weights hold a run of the experts and get the global ids: its output is the sum over
    the slots routed to its run only (equal to the reference's), pairs routed elsewhere sort into no block
    and their never-written rows (NaN here) are never read; the runs' outputs sum to the whole layer's."""
    if sort == "torch_ops":
        monkeypatch.setattr(moe_align, "ALIGN_KERNEL_MAX_PAIRS", 0)
    x, w1, w2, w, ids = _problem(13, 7, 3, 32, 16, torch.float32, device, seed)
    valid = torch.arange(13, device=device) % 5 != 2
    whole = fused_moe(x, w1, w2, w, ids, "gelu_tanh", row_valid=valid)
    real_empty = torch.empty

    def nan_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    parts = []
    for start, count in RUNS:
        run = slice(start, start + count)
        part = fused_moe(x, w1[run], w2[run], w, ids, "gelu_tanh", row_valid=valid, expert_start=start)
        ref = moe_experts_reference(x.cpu(), w1[run].cpu(), w2[run].cpu(), w.cpu(), ids.cpu(), "gelu_tanh",
                                    valid.cpu(), expert_start=start)
        torch.testing.assert_close(part.cpu(), ref, rtol=1e-4, atol=1e-4)
        none_here = ~((ids >= start) & (ids < start + count)).any(1)
        assert (part[none_here] == 0).all(), "a token routed to no expert of this run got an output"
        parts.append(part)
    assert (parts[0][~valid] == 0).all()
    torch.testing.assert_close(parts[0] + parts[1] + parts[2], whole, rtol=1e-5, atol=1e-5)


def test_expert_parallel_alignment_keeps_only_the_run(device, seed):
    for name, ids, valid, E in _routings(seed):
        start, count = 2, 3
        local = ids - start
        held = (local >= 0) & (local < count)
        ids_d, valid_d = ids.to(device), None if valid is None else valid.to(device)
        kernel = align_pairs(ids_d, count, 16, valid_d, use_kernel=True, expert_start=start)
        ops = align_pairs(ids_d, count, 16, valid_d, use_kernel=False, expert_start=start)
        # The same as aligning the local ids with every other pair's row marked invalid.
        n, k = ids.shape
        pairs, experts = kernel[0].cpu(), kernel[1].cpu()
        want = {t * k + j for t in range(n) for j in range(k) if held[t, j] and (valid is None or valid[t])}
        assert sorted(int(p) for p in pairs if p != n * k) == sorted(want), name
        assert (experts < count).all()
        for b, e in enumerate(experts.tolist()):
            real = pairs[b * 16 : (b + 1) * 16]
            real = real[real < n * k].long()
            assert e >= 0 or real.numel() == 0
            assert (local.reshape(-1)[real] == e).all(), f"{name}: block {b} mixes experts"
        assert torch.equal(kernel[0], ops[0]) and torch.equal(kernel[1], ops[1]), name
