"""SlotBudget: the scheduler's view of KV memory: how many slots an allocation can get from both pools
(free ones plus unlocked prefix cache it would evict), allocating with that eviction, and freeing the
SWA slots of positions that left the window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from swaserve.memory.window import SWAEvictor
    from swaserve.scheduler.prefix import PrefixSharing
    from swaserve.scheduler.req import Req


class SlotAllocator(Protocol):
    size: int

    def alloc(self, n: int) -> torch.Tensor | None: ...
    def free(self, slots: torch.Tensor) -> None: ...
    def available(self) -> int: ...
    def check_integrity(self, owned_full: torch.Tensor | None = None) -> None: ...


class SlotBudget:
    def __init__(self, allocator: SlotAllocator, evictor: SWAEvictor | None, prefix: PrefixSharing | None):
        self.allocator, self.evictor, self.prefix = allocator, evictor, prefix
        self.full = getattr(allocator, "full", allocator)  # the full pool's allocator (hybrid or not)

    def full_available(self) -> int:
        free = self.full.available()
        return free + self.prefix.cache.full_evictable if self.prefix is not None else free

    def swa_free(self) -> int | None:
        swa = getattr(self.allocator, "swa", None)
        return swa.available() if swa is not None else None

    def available(self) -> int:
        """Slots an allocation can get: free ones, plus unlocked prefix cache it would evict."""
        if self.prefix is None:
            return self.allocator.available()
        return self.prefix.available(self.full.available(), self.swa_free())

    def alloc(self, n: int) -> torch.Tensor:
        """n slots (both pools); evicts prefix cache if needed. At most `available()`."""
        slots = self.allocator.alloc(n)
        if slots is None and self.prefix is not None:
            self.prefix.make_room(n, self.full.available(), self.swa_free())
            slots = self.allocator.alloc(n)
        assert slots is not None, "allocated more than available()"
        return slots

    def evict_due(self, reqs: Sequence[Req]) -> None:
        """Free out-of-window SWA slots of `reqs` that have a chunk's worth due. Positions below
        kv_len belong to launched steps; a slot one of them still reads may be handed out again,
        since every write to it is enqueued after that step."""
        if self.evictor is None:
            return
        due = self.evictor.threshold
        ready = [r for r in reqs if r.kv_len - r.swa_evicted >= due and r.row is not None and not r.finished]
        if ready:
            if self.prefix is None:
                items = [(r.row, r.kv_len, r.swa_evicted) for r in ready]
            else:
                free = self.swa_free() or 0
                items = [(r.row, self.prefix.evict_point(r, free), r.swa_evicted) for r in ready]
            new = self.evictor.evict_many(items)  # type: ignore[arg-type]
            for r, evicted in zip(ready, new):
                r.swa_evicted = evicted


def check_fits(prompt_len: int, max_tokens: int, max_context: int, pool_tokens: int) -> None:
    """ValueError for a request that could never run (an empty prompt, or more tokens than the context or
    the full-attention pool holds), instead of letting it wait forever."""
    if prompt_len < 1:
        raise ValueError("the prompt is empty")
    total = prompt_len + max_tokens
    if total > max_context:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} "
                         f"exceeds the maximum context of {max_context} tokens")
    if total > pool_tokens:
        raise ValueError(f"prompt + max_tokens = {total} tokens exceeds the KV pool of {pool_tokens} tokens")
