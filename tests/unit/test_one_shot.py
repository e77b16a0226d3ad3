"""The one-shot all-reduce's routing (distributed/one_shot.py): which messages it takes, that
`all_reduce` hands them to it ahead of NCCL and the ordered gather path, and that it is never set up
where its kernel cannot run. The kernel itself needs two GPUs: tests/gpu/test_one_shot_gpu.py."""

from __future__ import annotations

import torch

from swaserve.distributed import state
from swaserve.distributed.one_shot import TWO_SHOT_MIN_BYTES, OneShotAllReduce, build_one_shot


def _unbuilt(dtype: torch.dtype, capacity: int, ranks: int = 2) -> OneShotAllReduce:
    one = OneShotAllReduce.__new__(OneShotAllReduce)  # routing only: no buffer, no group
    one.dtype, one.capacity, one.ranks = dtype, capacity, ranks
    one._two_shot = object()  # present, as in torch 2.7 on
    return one


def test_two_shot_takes_large_messages_on_four_ranks_or_more():
    big = torch.zeros(TWO_SHOT_MIN_BYTES // 2, dtype=torch.bfloat16)
    small = torch.zeros(TWO_SHOT_MIN_BYTES // 2 - 8, dtype=torch.bfloat16)
    assert _unbuilt(torch.bfloat16, 1 << 20, ranks=4).two_shot(big)
    assert not _unbuilt(torch.bfloat16, 1 << 20, ranks=4).two_shot(small)
    assert not _unbuilt(torch.bfloat16, 1 << 20, ranks=2).two_shot(big)  # two ranks: one-shot throughout
    old = _unbuilt(torch.bfloat16, 1 << 20, ranks=8)
    old._two_shot = None  # a torch without the kernel
    assert not old.two_shot(big)


def test_fits_only_contiguous_messages_of_its_dtype_within_the_buffer():
    one = _unbuilt(torch.bfloat16, 1024)
    assert one.fits(torch.zeros(4, 256, dtype=torch.bfloat16))
    assert not one.fits(torch.zeros(4, 257, dtype=torch.bfloat16))  # over the buffer
    assert not one.fits(torch.zeros(4, 256, dtype=torch.float32))  # another dtype
    assert not one.fits(torch.zeros(256, 4, dtype=torch.bfloat16).t())  # not contiguous
    assert not one.fits(torch.zeros(3, dtype=torch.bfloat16))  # 6 bytes: not whole 4-byte words
    assert not one.fits(torch.zeros(0, dtype=torch.bfloat16))
    rows = torch.zeros(3, 260, dtype=torch.bfloat16)
    assert one.fits(rows[2:])  # starts 1040 bytes in: 16-byte aligned
    assert not one.fits(rows.view(-1)[2:10])  # starts 4 bytes in
    one.close()  # before the group goes: everything to NCCL from then on
    assert one.buffer is None and not one.fits(torch.zeros(4, 256, dtype=torch.bfloat16))


class _Recorder:
    def __init__(self, takes: bool):
        self.takes, self.calls = takes, 0

    def fits(self, x: torch.Tensor) -> bool:
        return self.takes

    def __call__(self, x: torch.Tensor, ordered: bool = False) -> torch.Tensor:
        self.calls += 1
        self.ordered = ordered
        return x.mul_(2)  # a stand-in sum over two ranks holding the same partial


def test_all_reduce_sends_what_fits_one_shot_even_in_deterministic_mode(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a message the one-shot path takes went to torch.distributed")

    monkeypatch.setattr(state.dist, "all_reduce", no_collective)
    monkeypatch.setattr(state, "_all_gather", no_collective)
    for ordered in (False, True):
        rec = _Recorder(takes=True)
        with_group = state.TPGroup(rank=0, size=2, ordered=ordered, one_shot=rec)
        monkeypatch.setattr(state, "_TP", with_group)
        x = torch.ones(8)
        assert state.all_reduce(x) is x and rec.calls == 1 and torch.equal(x, torch.full((8,), 2.0))
        assert rec.ordered == ordered  # deterministic mode keeps the kernel to one-shot


def test_all_reduce_leaves_what_does_not_fit_to_nccl(monkeypatch):
    sent = []
    monkeypatch.setattr(state.dist, "all_reduce", lambda x, group=None: sent.append(x))
    rec = _Recorder(takes=False)
    monkeypatch.setattr(state, "_TP", state.TPGroup(rank=0, size=2, one_shot=rec))
    x = torch.ones(8)
    state.all_reduce(x)
    assert rec.calls == 0 and sent == [x]


def test_not_built_where_the_kernel_cannot_run():
    cpu = torch.device("cpu")
    assert build_one_shot(None, 2, cpu, torch.bfloat16) is None  # not CUDA
    assert build_one_shot(None, 3, torch.device("cuda", 0), torch.bfloat16) is None  # no kernel for 3 ranks
    assert build_one_shot(None, 2, torch.device("cuda", 0), torch.float16) is None  # a dtype it does not serve
