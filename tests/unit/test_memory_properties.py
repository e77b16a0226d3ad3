"""Property tests: random operation sequences over the allocators, with integrity checked after each.

1,000+ random sequences in total (three state machines below). A reference model tracks which full
slots each request owns and which positions it has evicted; after every operation the allocator's
own `check_integrity` runs with the exact set of owned slots.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from swaserve.memory import ReqToTokenPool, SWAEvictor, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator

FULL, SWA, ROWS, CTX = 48, 20, 4, 48


class HybridMemoryMachine(RuleBasedStateMachine):
    """Requests grow by extend/decode, lose out-of-window SWA slots, get freed; pools run dry."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SWATokenToKVPoolAllocator(FULL, SWA)
        self.table = ReqToTokenPool(ROWS, CTX)
        self.reqs: dict[int, dict[str, int]] = {}  # row -> {"len", "evicted", "window"}

    @rule(n=st.integers(1, 12), window=st.integers(1, 10))
    def new_request(self, n: int, window: int) -> None:
        if self.table.available() == 0:
            return
        slots = self.alloc.alloc(n)
        if slots is None:
            assert n > min(self.alloc.full.available(), self.alloc.swa.available()), "refused with room"
            return
        row = self.table.alloc()
        self.table.write(row, 0, slots)
        self.reqs[row] = {"len": n, "evicted": 0, "window": window}

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 6))
    def extend(self, data: st.DataObject, n: int) -> None:
        row = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[row]
        if r["len"] + n > CTX:
            return
        before = (self.alloc.full.available(), self.alloc.swa.available())
        slots = self.alloc.alloc(n)
        if slots is None:
            assert (self.alloc.full.available(), self.alloc.swa.available()) == before, "partial allocation"
            return
        self.table.write(row, r["len"], slots)
        r["len"] += n

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), margin=st.integers(0, 3), chunk=st.integers(1, 4))
    def evict(self, data: st.DataObject, margin: int, chunk: int) -> None:
        row = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[row]
        window = r["window"]  # fixed per request, as in a model
        ev = SWAEvictor(self.alloc, self.table, window, margin, chunk)
        r["evicted"] = max(r["evicted"], ev.evict(row, r["len"], r["evicted"]))
        swa = self.alloc.translate_full_to_swa(self.table.slots(row, 0, r["len"]))
        first_visible = max(0, r["len"] - window + 1)
        assert (swa[first_visible:] > 0).all(), "a position a future query can see lost its SWA slot"

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs.pop(row)
        self.alloc.free(self.table.slots(row, 0, r["len"]))
        self.table.free(row)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_swa_again(self, data: st.DataObject) -> None:
        """free_swa of already-evicted positions is a no-op (mapping is 0)."""
        row = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[row]
        used = self.alloc.swa.used()
        self.alloc.free_swa(self.table.slots(row, 0, r["evicted"]))
        assert self.alloc.swa.used() == used

    @invariant()
    def integrity(self) -> None:
        owned = [self.table.slots(row, 0, r["len"]) for row, r in self.reqs.items()]
        owned_t = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
        self.alloc.check_integrity(owned_full=owned_t)
        self.table.check_integrity()
        live_swa = sum(r["len"] - r["evicted"] for r in self.reqs.values())
        assert self.alloc.swa.used() == live_swa, "SWA slots held != positions not yet evicted"
        assert self.alloc.available() == min(self.alloc.full.available(), self.alloc.swa.available())

    def teardown(self) -> None:
        for row, r in list(self.reqs.items()):
            self.alloc.free(self.table.slots(row, 0, r["len"]))
            self.table.free(row)
        assert self.alloc.full.available() == FULL and self.alloc.swa.available() == SWA
        assert not self.alloc.full_to_swa[1:-1].any(), "mapping back to all zeros"
        self.alloc.check_integrity(owned_full=torch.empty(0, dtype=torch.int64))
        self.table.check_integrity()


class DeferredMirrorMachine(HybridMemoryMachine):
    """The same sequences with the mapping's device mirror written only by `sync_device` (the runtime's
    `defer_device`, synced before each forward): between syncs the mirror differs from the host table at
    remapped slots only, and a sync (the `forward` rule, any number of rules apart) brings it level."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc.defer_device = True

    @rule()
    def forward(self) -> None:
        self.alloc.sync_device()
        assert not self.alloc._dirty
        assert torch.equal(self.alloc.full_to_swa_device.long(), self.alloc.full_to_swa), "a sync left a stale entry"
        super().integrity()  # every allocator check, the mirror's included

    @invariant()
    def integrity(self) -> None:  # (no sync here: the mirror may lag until `forward`)
        a = self.alloc
        remapped = torch.zeros(a.full_to_swa.numel(), dtype=torch.bool)
        for slots in a._dirty:
            remapped[slots] = True
        stale = a.full_to_swa_device.long() != a.full_to_swa
        assert not (stale & ~remapped).any(), "the mirror differs at a slot no write listed"
        assert a.swa.used() == sum(r["len"] - r["evicted"] for r in self.reqs.values())


class PlainAllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.a = TokenToKVPoolAllocator(16)
        self.owned: list[torch.Tensor] = []

    @rule(n=st.integers(0, 20))
    def alloc(self, n: int) -> None:
        s = self.a.alloc(n)
        if s is None:
            assert n > self.a.available()
        else:
            assert s.numel() == n
            self.owned.append(s)

    @precondition(lambda self: self.owned)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        self.a.free(self.owned.pop(i % len(self.owned)))

    @invariant()
    def integrity(self) -> None:
        owned = torch.cat(self.owned) if self.owned else torch.empty(0, dtype=torch.int64)
        self.a.check_integrity(owned=owned)

    def teardown(self) -> None:
        for s in self.owned:
            self.a.free(s)
        assert self.a.available() == 16


_settings = dict(stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestHybridMemory = HybridMemoryMachine.TestCase
TestHybridMemory.settings = settings(max_examples=700, **_settings)
TestDeferredMirror = DeferredMirrorMachine.TestCase
TestDeferredMirror.settings = settings(max_examples=300, **_settings)
TestPlainAllocator = PlainAllocatorMachine.TestCase
TestPlainAllocator.settings = settings(max_examples=400, **_settings)
