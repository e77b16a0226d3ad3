"""The server's Prometheus histogram: an observation lands in the first bucket whose bound it does not exceed
(a value equal to a bound included, +Inf past the last), weighted by `times`; non-finite values are dropped;
`render` prints cumulative counts, the sum and the count."""

from __future__ import annotations

import math
import random

import pytest

from swaserve.server.metrics import ITL_BUCKETS, Histogram


def test_buckets_match_their_definition():
    h = Histogram("x", "test", ITL_BUCKETS)
    rng = random.Random(0)
    values = [rng.uniform(0, 2 * ITL_BUCKETS[-1]) for _ in range(500)] + list(ITL_BUCKETS) + [0.0, -1.0]
    want = [0] * (len(ITL_BUCKETS) + 1)
    for k, v in enumerate(values):
        times = 1 + k % 3
        h.observe(v, times)
        want[next((i for i, b in enumerate(ITL_BUCKETS) if v <= b), len(ITL_BUCKETS))] += times
    h.observe(math.nan)
    h.observe(math.inf)
    assert h._counts == want
    lines = h.render()
    total = sum(want)
    assert f'x_bucket{{le="+Inf"}} {total}' in lines and f"x_count {total}" in lines
    cumulative = [int(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("x_bucket")]
    assert cumulative == [sum(want[: i + 1]) for i in range(len(want))]


def test_bounds_must_ascend():
    with pytest.raises(AssertionError, match="ascend"):
        Histogram("x", "test", [0.1, 0.05])
