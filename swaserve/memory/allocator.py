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
        # A ring of free slots: `_count` of them starting at `_head`, wrapping. Alloc takes from the
        # head, free appends at the tail, so both cost O(n) in the slots moved, not in the pool size.
        self._ring = torch.arange(1, self.size + 1, dtype=torch.int64)  # [size] int64, cpu
        self._head = 0
        self._count = self.size

    def available(self) -> int:
        return self._count

    def used(self) -> int:
        return self.size - self._count

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take n slots (int64, cpu, a new tensor), all or none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._count:
            return None
        out = self._read(self._head, n)
        self._head = (self._head + n) % self.size
        self._count -= n
        return out

    def free(self, slots: torch.Tensor) -> None:
        k = slots.numel()
        if not k:
            return
        assert self._count + k <= self.size, (
            f"freeing {k} slots with only {self.size - self._count} in use (double free)"
        )
        slots = slots.reshape(-1).to(device="cpu", dtype=torch.int64)
        tail = (self._head + self._count) % self.size
        first = min(k, self.size - tail)
        self._ring[tail : tail + first] = slots[:first]
        if first < k:
            self._ring[: k - first] = slots[first:]
        self._count += k

    def free_slots(self) -> torch.Tensor:
        """The free slots in the order they will be handed out (int64, cpu, a copy)."""
        return self._read(self._head, self._count)

    def _read(self, start: int, n: int) -> torch.Tensor:
        first = min(n, self.size - start)
        if first == n:
            return self._ring[start : start + n].clone()
        return torch.cat([self._ring[start:], self._ring[: n - first]])

    def check_integrity(self, owned: torch.Tensor | None = None) -> None:
        """Check the free list; with `owned` (every slot callers hold), check the partition exactly."""
        free = self.free_slots()
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
