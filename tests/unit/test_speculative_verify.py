"""The acceptance rule and the n-gram drafter, on their own. Sampling with speculation must draw from
the target's distribution exactly (checked with chi-square tests on a five-token vocabulary), greedy
must give the target's argmax sequence, and seeded draws must repeat."""

from __future__ import annotations

import math

import pytest
import torch

from swaserve.request import SamplingParams
from swaserve.scheduler.speculate import speculates
from swaserve.speculative.ngram import NgramDrafter
from swaserve.speculative.verify import accept


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson chi-square against `probs`, at the 0.1% level (4 degrees of freedom: 18.47)."""
    n = counts.sum()
    expected = probs * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat < 18.47


def test_greedy_keeps_the_agreeing_prefix_and_the_target_token():
    logits = torch.full((4, 5), -5.0)
    for i, t in enumerate([3, 1, 4, 2]):
        logits[i, t] = 5.0
    greedy = SamplingParams(temperature=0)
    assert accept(logits, [3, 1, 4], greedy, 10) == [3, 1, 4, 2]  # all accepted, plus the bonus token
    assert accept(logits, [3, 0, 4], greedy, 10) == [3, 1]  # the correction at the first disagreement
    assert accept(logits[:1], [], greedy, 10) == [3]


def test_sampled_tokens_follow_the_target_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0], [0.3, 1.1, -1.0, 0.0, 0.5]])
    params = SamplingParams(temperature=0.8)
    p = torch.softmax(logits / 0.8, dim=-1)
    first = torch.zeros(5)
    second = torch.zeros(5)
    draft = 3  # a token the target finds plausible, but not its favourite
    for _ in range(20000):
        out = accept(logits, [draft], params, 0)
        first[out[0]] += 1
        if out[0] == draft:
            second[out[1]] += 1
    assert _chi2_ok(first, p[0]), first / first.sum()
    assert _chi2_ok(second, p[1]), second / second.sum()  # after an accepted draft: the next distribution
    assert abs(float(first[draft] / first.sum()) - float(p[0, draft])) < 4 * math.sqrt(0.25 / 20000)


def test_seeded_draws_repeat():
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=1.0, seed=1234)
    runs = {tuple(accept(logits, [7, 8, 9], params, 42)) for _ in range(5)}
    assert len(runs) == 1
    assert {tuple(accept(logits, [7, 8, 9], SamplingParams(temperature=1.0, seed=s), 42)) for s in range(40)} != runs


def test_which_requests_speculate():
    assert speculates(SamplingParams(temperature=0))
    assert speculates(SamplingParams(temperature=0.7, seed=3))
    for kw in ({"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"logprobs": 2}, {"repetition_penalty": 1.2}):
        assert not speculates(SamplingParams(temperature=0.7, **kw)), kw


def test_ngram_proposes_what_followed_the_latest_match():
    d = NgramDrafter(min_n=1, max_n=3)
    assert d.lookup([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]
    assert d.lookup([1, 2, 3, 9, 1, 2, 3, 4, 2, 3], 2) == [4, 2]  # the latest "2 3" wins
    assert d.lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence of any suffix
    assert d.lookup([7, 7, 7, 7], 2) == [7]  # what follows the latest earlier "7 7 7"
    assert NgramDrafter(2, 3).lookup([1, 2, 9, 2], 2) == []  # a 1-gram match is below min_n


@pytest.mark.parametrize("seed", range(3))
def test_ngram_index_answers_as_the_scan_while_sequences_grow(seed):
    """The per-request index (updated with a few tokens a step, as decoding appends them) proposes
    exactly what the reference scan does, over small vocabularies (many matches, repeats), with a
    lookback shorter than the sequence; releasing a request drops its index."""
    import random

    from swaserve.speculative.ngram import NgramIndex

    rng = random.Random(seed)
    d = NgramDrafter(min_n=1 + seed % 2, max_n=4, lookback=40)

    class R:
        rid, ids = "a", [rng.randrange(6) for _ in range(5)]

    checked = 0
    for _ in range(150):
        k = rng.randrange(1, 6)
        got = d.propose([R], [k])[0]
        assert got == d.lookup(R.ids, k), (R.ids, k)
        checked += bool(got)
        R.ids += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
    assert checked > 50 and isinstance(d.index["a"], NgramIndex)
    d.release(R)
    assert not d.index
