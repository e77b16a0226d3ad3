"""Greedy decoding under tensor parallelism without gathering logits (`state.vocab_parallel_argmax`,
`LMHead._vocab_parallel_greedy`): each rank's best (logit, token) per row, one gather, the highest
logit and the lowest token id on ties, and the last block's zero padding never competing. Two ranks
are simulated in one process: the gather is replaced by one that puts the other rank's pairs beside
ours (the real collective runs in tests/models/test_tensor_parallel.py, TP=2 == TP=1 greedy)."""

from __future__ import annotations

import pytest
import torch

from swaserve.distributed import state
from swaserve.layers.embedding import LMHead


def _two_ranks(monkeypatch, rank: int, other_pairs: torch.Tensor) -> None:
    """This process is `rank` of 2; the other rank's gathered message is `other_pairs` `[n, 2]` int32."""
    monkeypatch.setattr(state, "_TP", state.TPGroup(rank=rank, size=2))

    def gather(out: torch.Tensor, x: torch.Tensor, group=None) -> None:
        parts = [x, other_pairs] if rank == 0 else [other_pairs, x]
        out.copy_(torch.cat(parts))

    monkeypatch.setattr(state, "_all_gather", gather)


def _pairs(best: list[float], index: list[int]) -> torch.Tensor:
    return torch.stack([torch.tensor(best, dtype=torch.float32).view(torch.int32),
                        torch.tensor(index, dtype=torch.int32)], dim=1)


@pytest.mark.parametrize("rank", [0, 1])
def test_highest_logit_wins_and_ties_go_to_the_lower_token_id(monkeypatch, rank):
    # rows: we win, they win, a tie (the lower rank's token id wins: rank 0's block comes first)
    ours_best, ours_index = [5.0, -1.0, 2.0], [3, 1, 0]
    theirs_best, theirs_index = [4.0, 0.5, 2.0], [9, 8, 7]
    if rank == 1:  # our block is the second: our ids are the higher ones
        ours_index = [i + 10 for i in ours_index]
        theirs_index = [i - 7 for i in theirs_index]
    _two_ranks(monkeypatch, rank, _pairs(theirs_best, theirs_index))
    got = state.vocab_parallel_argmax(torch.tensor(ours_best), torch.tensor(ours_index))
    assert got.dtype == torch.int64
    tie = ours_index[2] if rank == 0 else theirs_index[2]
    assert got.tolist() == [ours_index[0], theirs_index[1], tie]


def test_one_rank_returns_its_own_ids():
    index = torch.tensor([4, 2])
    assert state.vocab_parallel_argmax(torch.tensor([1.0, 2.0]), index) is index


def test_the_last_blocks_zero_padding_never_wins(monkeypatch):
    """Vocabulary 7 over 2 ranks: blocks of 4, rank 1 holds ids 4..6 and one zero row. With every real
    logit negative, the zero row's logit 0 would be the block's best if it were not cut off."""
    _two_ranks(monkeypatch, 1, _pairs([-3.0], [1]))  # rank 0's best for the one row: id 1, logit -3
    head = LMHead(7, 4, tied=False)
    assert head.parallel and head.weight.shape == (4, 4)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[-1.0, 0, 0, 0], [-2.0, 0, 0, 0], [-0.5, 0, 0, 0], [0.0, 0, 0, 0]]))
    hidden = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # logits of ids 4, 5, 6: -1, -2, -0.5 (the pad row: 0)
    assert head.greedy(hidden, embedding=None).tolist() == [6]


def test_soft_capped_logits_pick_the_same_token(monkeypatch):
    _two_ranks(monkeypatch, 0, _pairs([0.1], [5]))  # rank 1: id 5, logit 0.1 after the cap
    head = LMHead(8, 2, tied=False, final_softcap=30.0)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 0.0]]))
    # ours: ids 0..3 with raw logits 3, 1, 6, 0 -> capped, id 2 still the best and above 0.1
    assert head.greedy(torch.tensor([[3.0, 1.0]]), embedding=None).tolist() == [2]
