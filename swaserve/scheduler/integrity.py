"""The scheduler's invariants (`check_scheduler`; a `Scheduler` built with `check=check_scheduler` runs it
from `check_integrity()`): the pools hold exactly the slots the live requests and the prefix cache own,
table rows are neither leaked nor shared, at most one request is mid-prefill, and every key a request's
next query reads is still in the SWA pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swaserve.scheduler.req import ReqStatus

if TYPE_CHECKING:
    from swaserve.scheduler.scheduler import Scheduler


def owned_slots(s: Scheduler) -> torch.Tensor:
    """Every full slot held: requests' own positions and the prefix cache's nodes."""
    held = [s.table.slots(r.row, r.cache_len, r.kv_len) for r in (*s.waiting, *s.running) if r.row is not None]
    if s.prefix is not None:
        held.append(s.prefix.cache.owned_slots())
    return torch.cat(held) if held else torch.empty(0, dtype=torch.int64)


def check_scheduler(s: Scheduler) -> None:
    """Pools consistent with exactly the slots the live requests hold; queues consistent."""
    s.allocator.check_integrity(owned_slots(s))
    s.table.check_integrity()
    rows = [r.row for r in (*s.waiting, *s.running) if r.row is not None]
    assert sorted(rows) == s.table.live_rows(), "request table rows leaked or shared"
    mid = [r for r in s.waiting if r.kv_len > 0]
    assert len(mid) <= 1 and (not mid or mid[0] is s.waiting[0]), "more than one mid-prefill request"
    assert all(r.status is ReqStatus.RUNNING and r.pending == 1 for r in s.running)
    assert all(0 <= r.inflight <= 2 for r in (*s.waiting, *s.running)), "one token per launched step"
    live = [r for r in (*s.waiting, *s.running) if r.row is not None]
    for r in live:
        assert s.table.clear_from(r.row, r.kv_len), f"{r.rid}: table entries past its K/V length"  # type: ignore[arg-type]
    if s.prefix is not None:
        s.prefix.check_integrity(live)
    if s.evictor is not None:  # the keys every request's next query attends are in the SWA pool
        table = s.allocator.full_to_swa  # type: ignore[attr-defined]
        for r in live:
            need = s.table.slots(r.row, max(0, r.kv_len - s.evictor.window + 1), r.kv_len)  # type: ignore[arg-type]
            assert bool((table[need] > 0).all()), f"{r.rid}: an SWA slot its next query reads was freed"
