"""CUDA graphs made in a multi-rank group are reset before the group's communicator is destroyed: NCCL
(2.26 on) polls forever in `destroy_process_group` while a graph that captured one of its collectives
lives (both ranks of a closing TP=2 engine hung there on 4x H100). Fake graphs stand in for CUDA here."""

from __future__ import annotations

import gc

import pytest
import torch

from swaserve.distributed import state
from swaserve.distributed.state import TPGroup, new_cuda_graph, release_graphs, set_tp_group


class FakeGraph:
    resets = 0

    def reset(self) -> None:
        FakeGraph.resets += 1


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    FakeGraph.resets = 0
    before = state.tp_group()
    yield
    set_tp_group(before)


def test_graphs_made_in_a_group_of_several_are_reset_once(fake_graphs):
    set_tp_group(TPGroup(rank=0, size=2))
    kept = [new_cuda_graph() for _ in range(3)]
    dropped = new_cuda_graph()
    del dropped
    gc.collect()  # a graph the engine dropped is not kept alive by the tracking
    assert len(state.tp_group().graphs) == 3
    assert release_graphs() == 3 and FakeGraph.resets == 3
    assert release_graphs() == 0 and FakeGraph.resets == 3  # once: the set is emptied
    assert kept  # (held until here)


def test_a_group_of_one_tracks_nothing(fake_graphs):
    set_tp_group(TPGroup())
    graph = new_cuda_graph()
    assert isinstance(graph, FakeGraph) and not state.tp_group().graphs
    assert release_graphs() == 0 and FakeGraph.resets == 0
