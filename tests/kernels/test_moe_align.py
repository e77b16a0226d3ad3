"""Property test of the pair sort (`align_pairs`): over random routings the one-program kernel's
outputs equal the torch-ops path's bit for bit (sorted pairs with their padding sentinels, block
experts with -1 for unused blocks), into buffers poisoned beforehand. Routings: 1 to
ALIGN_KERNEL_MAX_PAIRS pairs, uniform ids (duplicates in a row included), distinct top-k ids, every
pair on one expert, a few crowded experts (runs of several blocks, most experts empty); rows
invalid at random or all; expert parallelism's slices (`expert_start`); expert counts that are no
power of two; block_m 16, 32 and 64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from swaserve.kernels.moe_align import ALIGN_KERNEL_MAX_PAIRS, align_pairs

ROUTINGS = ("uniform", "distinct", "one_expert", "crowded")


def _ids(routing: str, n: int, k: int, experts: int, g: torch.Generator) -> torch.Tensor:
    if routing == "distinct" and k <= experts:
        return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    if routing == "one_expert":
        return torch.full((n, k), int(torch.randint(experts, (1,), generator=g)))
    if routing == "crowded":
        few = torch.randperm(experts, generator=g)[:3]
        return few[torch.randint(few.numel(), (n, k), generator=g)]
    return torch.randint(experts, (n, k), generator=g)


def _kernel_on_poison(monkeypatch, *args, **kwargs):
    """The kernel path into int buffers that start as -77: every slot it returns must be written."""
    real_empty = torch.empty
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *shape, **kw: real_empty(*shape, **kw).fill_(-77))
        return align_pairs(*args, use_kernel=True, **kwargs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    k=st.sampled_from([1, 2, 4, 8]),
    pairs=st.integers(1, ALIGN_KERNEL_MAX_PAIRS),
    experts=st.sampled_from([1, 3, 8, 32, 100, 128, 256]),
    routing=st.sampled_from(ROUTINGS),
    valid=st.sampled_from(["all", "random", "none"]),
    split=st.booleans(),
    block_m=st.sampled_from([16, 32, 64]),
    seed=st.integers(0, 2**31 - 1),
)
@example(k=8, pairs=2048, experts=128, routing="one_expert", valid="all", split=False, block_m=16, seed=0)
@example(k=8, pairs=2048, experts=256, routing="distinct", valid="random", split=True, block_m=64, seed=1)
@example(k=8, pairs=1024, experts=100, routing="distinct", valid="random", split=False, block_m=32, seed=2)
@example(k=1, pairs=1, experts=3, routing="uniform", valid="all", split=False, block_m=16, seed=3)
@example(k=4, pairs=256, experts=32, routing="crowded", valid="none", split=True, block_m=16, seed=4)
@example(k=2, pairs=257, experts=8, routing="uniform", valid="random", split=False, block_m=64, seed=5)
def test_kernel_equals_torch_ops(k, pairs, experts, routing, valid, split, block_m, seed, device, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    n = max(1, pairs // k)
    ids = _ids(routing, n, k, experts, g)
    row_valid = {"all": None, "random": torch.rand(n, generator=g) > 0.3,
                 "none": torch.zeros(n, dtype=torch.bool)}[valid]
    start, count = 0, experts
    if split:  # this rank holds experts start .. start + count - 1 of the routing's `experts`
        start = int(torch.randint(experts, (1,), generator=g))
        count = int(torch.randint(1, experts - start + 1, (1,), generator=g))
    ids_d = ids.to(device)
    valid_d = None if row_valid is None else row_valid.to(device)
    kernel = _kernel_on_poison(monkeypatch, ids_d, count, block_m, valid_d, expert_start=start)
    ops = align_pairs(ids_d, count, block_m, valid_d, use_kernel=False, expert_start=start)
    assert torch.equal(kernel[0], ops[0]), "sorted_pairs differ"
    assert torch.equal(kernel[1], ops[1]), "block_expert differ"


@pytest.mark.parametrize("block_m", [16, 64])
def test_kernel_equals_torch_ops_with_int32_ids(block_m, device, monkeypatch):
    """The router's ids may come as int32 (and non-contiguous): the same blocks as int64 ids."""
    g = torch.Generator().manual_seed(block_m)
    ids = torch.randint(128, (96, 16), generator=g)[:, ::2]  # [96, 8], strided
    ids_d = ids.to(device)
    kernel = _kernel_on_poison(monkeypatch, ids_d.to(torch.int32), 128, block_m)
    ops = align_pairs(ids_d, 128, block_m, use_kernel=False)
    assert torch.equal(kernel[0], ops[0]) and torch.equal(kernel[1], ops[1])
