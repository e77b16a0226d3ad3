"""Slot allocator of one KV pool: hands out slots 1..size, slot 0 is the reserved dummy slot."""

from __future__ import annotations

import torch


class TokenToKVPoolAllocator:
    """A free list of KV slots, kept on the CPU so allocation never waits on the device.

    Invariants: slot 0 is never handed out; every slot 1..size is either free (exactly once on the
    free list) or owned by exactly one caller; `available() + used() == size`. Freed slots go to the
    back of the list, so after wrap-around the order in which slots come out is no longer monotonic
    (kernels must not assume it is).
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a KV pool needs at least one slot, got size={size}")
        self.size = size
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)  # [n_free] int64, cpu

    def available(self) -> int:
        return self._free.numel()

    def used(self) -> int:
        return self.size - self._free.numel()

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take n slots (int64, cpu), all or none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat([self._free, slots.reshape(-1).to(device="cpu", dtype=torch.int64)])

    def check_integrity(self, owned: torch.Tensor | None = None) -> None:
        """Check the free list; with `owned` (every slot callers hold), check the partition exactly."""
        free = self._free
        assert free.numel() <= self.size, f"free list holds {free.numel()} > {self.size} slots (double free)"
        if free.numel():
            assert int(free.min()) >= 1, "slot 0 (or a negative slot) is on the free list"
            assert int(free.max()) <= self.size, "a slot beyond the pool is on the free list"
            assert torch.unique(free).numel() == free.numel(), "a slot is on the free list twice (double free)"
        if owned is not None:
            owned = owned.reshape(-1).to(torch.int64)
            assert owned.numel() == self.used(), f"callers own {owned.numel()} slots, allocator counts {self.used()}"
            both = torch.cat([free, owned])
            assert torch.equal(torch.sort(both).values, torch.arange(1, self.size + 1)), (
                "free + owned slots are not exactly 1..size (slot owned twice, or owned and free)"
            )
