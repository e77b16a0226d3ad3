"""The request table: one row per running request, mapping position -> full-pool KV slot."""

from __future__ import annotations

import torch

from swaserve.h2d import copy_into, to_device
from swaserve.memory.table_ops import TableOp


class ReqToTokenPool:
    """Rows of full-pool slot indices, one row per live request.

    Invariants: row 0 is never handed out and stays all zeros (padded graph rows read it); a free
    row is all zeros, so unwritten entries of a live row are 0 as well and translate to the dummy
    slot. The table lives on the pool's device for kernels; a CPU mirror is kept so the scheduler
    never reads device memory (no host sync on the step path).
    """

    @staticmethod
    def nbytes(max_reqs: int, max_context: int) -> int:
        """Device bytes of a table for `max_reqs` requests (row 0 included)."""
        return (max_reqs + 1) * max_context * 4

    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str = "cpu"):
        if max_reqs < 1 or max_context < 1:
            raise ValueError("ReqToTokenPool needs max_reqs >= 1 and max_context >= 1")
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(max_reqs + 1, max_context, dtype=torch.int32, device=self.device)  # [R+1, C] int32, device
        self._host = (
            self.req_to_token if self.device.type == "cpu" else torch.zeros_like(self.req_to_token, device="cpu")
        )  # [R+1, C] int32, cpu mirror
        self._free_rows = list(range(max_reqs, 0, -1))  # popped from the end: lowest row first
        self._live: set[int] = set()
        # Tensor parallelism: every device write is also recorded here for the other ranks' tables
        # (`distributed.table_log`); None: no other rank.
        self.log: list[list] | None = None

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._live.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._live:
            raise ValueError(f"row {row} is not allocated (double free or reserved row 0)")
        self._live.remove(row)
        self._host[row].zero_()
        if self._host is not self.req_to_token:
            self.req_to_token[row].zero_()
        if self.log is not None:
            self.log.append([TableOp.ZERO_ROW, row])
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record `slots` (full-pool, any int dtype) for positions start .. start+len-1 of `row`."""
        assert row in self._live, f"write to row {row} that is not allocated"
        end = start + slots.numel()
        if end > self.max_context:
            raise ValueError(f"position {end - 1} is beyond the table's max_context {self.max_context}")
        host = slots.to(device="cpu", dtype=torch.int32)
        self._host[row, start:end] = host
        if self._host is not self.req_to_token:
            copy_into(self.req_to_token[row, start:end], host)
        if self.log is not None:
            self.log.append([TableOp.WRITE, row, start, host.tolist()])

    def clear(self, row: int, start: int, end: int) -> None:
        """Zero positions start .. end-1 of `row` (speculative tokens the target rejected)."""
        if end > start:
            self.write(row, start, torch.zeros(end - start, dtype=torch.int32))

    def write_tokens(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """Record one slot per (row, position) pair in one copy: the decode step's table update."""
        r, p = torch.tensor([rows, positions], dtype=torch.int64)  # one conversion for both lists
        if len(positions) and max(positions) >= self.max_context:
            raise ValueError(f"position {max(positions)} is beyond the table's max_context {self.max_context}")
        host = slots.to(device="cpu", dtype=torch.int32)
        self._host[r, p] = host
        if self._host is not self.req_to_token:
            dev = to_device(torch.stack([r, p, host.to(torch.int64)]), self.device)  # one copy: [3, n]
            self.req_to_token[dev[0], dev[1]] = dev[2].to(torch.int32)
        if self.log is not None:
            self.log.append([TableOp.WRITE_TOKENS, list(rows), list(positions), host.tolist()])

    def clear_from(self, row: int, start: int) -> bool:
        """Whether every entry of `row` from position `start` on is 0 (nothing written past a request's
        K/V length, or left behind by tokens given back, e.g. rejected speculative drafts)."""
        return not bool(self._host[row, start:].any())

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Full-pool slots of positions start .. end-1 (int64, cpu), read from the host mirror."""
        return self._host[row, start:end].to(torch.int64)

    def live_rows(self) -> list[int]:
        return sorted(self._live)

    def check_integrity(self) -> None:
        assert not self._host[0].any(), "row 0 of req_to_token must stay all zeros"
        free = set(self._free_rows)
        assert len(free) == len(self._free_rows), "a row is on the free list twice"
        assert not (free & self._live), "a row is both free and live"
        assert free | self._live == set(range(1, self.max_reqs + 1)), "rows lost or row 0 handed out"
        if free:
            assert not self._host[sorted(free)].any(), "a free row holds stale slots"
        if self._host is not self.req_to_token:
            assert torch.equal(self.req_to_token.cpu(), self._host), "device table differs from host mirror"
