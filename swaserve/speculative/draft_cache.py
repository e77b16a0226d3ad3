"""DraftCache: a drafter's own KV cache (its runtime's request table, allocator and evictor), one row
per target sequence; allocates the slots of a draft forward, builds its batch, drops the entries past
a length, and checks that the pools hold exactly the tracked rows' entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from swaserve.runner.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from swaserve.runtime import Runtime


@dataclass
class DraftRow:
    """One sequence's row: entries `[0, length)` hold K/V, nothing past them."""

    row: int
    length: int = 0
    swa_evicted: int = 0


class DraftCache:
    """Owns the rows of a drafter's runtime. Invariant: every live row's table entries `[0, length)`
    are allocated slots in both pools, entries past `length` are 0, and no other slot is owned."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.rows: dict[str, DraftRow] = {}  # target request id -> its row

    def open(self, rid: str) -> DraftRow | None:
        """The row of `rid`, a fresh one if it has none; None when the table is full."""
        r = self.rows.get(rid)
        if r is None:
            row = self.rt.req_to_token.alloc()
            if row is None:
                return None
            r = self.rows[rid] = DraftRow(row)
        return r

    def truncate(self, r: DraftRow, n: int) -> None:
        """Free the entries from `n` on (both pools; the table entries return to 0)."""
        if r.length > n:
            table = self.rt.req_to_token
            self.rt.allocator.free(table.slots(r.row, n, r.length))
            table.clear(r.row, n, r.length)
            r.length = n

    def close(self, rid: str) -> None:
        r = self.rows.pop(rid, None)
        if r is not None:
            self.truncate(r, 0)
            self.rt.req_to_token.free(r.row)

    def batch(self, mode: ForwardMode, rows: list[DraftRow], ids: list[list[int]] | None,
              positions: list[list[int]], counts: list[int] | None = None) -> ForwardBatch:
        """A forward appending `ids[i]` at rope positions `positions[i]` to rows[i] (slots allocated
        in one go, the table written in one copy, lengths advanced); extend-shaped unless `mode` is
        DECODE (one token a row). `ids` None (decode): the inputs are in the runner's last-token
        table; `counts` then gives the tokens per row (1 each)."""
        counts = [len(new) for new in ids] if ids is not None else counts or [1] * len(rows)
        slots = self.rt.allocator.alloc(sum(counts))
        if slots is None:  # sized for every running request at full context
            raise RuntimeError("the drafter's KV cache is full")
        prefix = [r.length for r in rows]
        table_rows = [r.row for r in rows]
        self.rt.req_to_token.write_tokens([r for r, n in zip(table_rows, counts) for _ in range(n)],
                                          [p for a, n in zip(prefix, counts) for p in range(a, a + n)], slots)
        for r, n in zip(rows, counts):
            r.length += n
        flat_ids = [t for new in ids for t in new] if ids is not None else None
        flat_pos = [p for ps in positions for p in ps]
        seq_lens = [r.length for r in rows]
        device = self.rt.runner.device
        if mode == ForwardMode.DECODE:
            return ForwardBatch.build(mode, flat_ids, flat_pos, table_rows, seq_lens, slots, device)
        return ForwardBatch.build(mode, flat_ids, flat_pos, table_rows, seq_lens, slots, device,
                                  extend_prefix_lens=prefix, extend_seq_lens=counts)

    def evict(self, rows: list[DraftRow]) -> None:
        """Free the SWA slots that left every future query's window (a head with sliding layers)."""
        ev = self.rt.evictor
        if ev is None:
            return
        new = ev.evict_many([(r.row, r.length, r.swa_evicted) for r in rows])
        for r, e in zip(rows, new):
            r.swa_evicted = e

    def check_integrity(self) -> None:
        """The pools hold exactly the tracked rows' entries."""
        table = self.rt.req_to_token
        owned = [table.slots(r.row, 0, r.length) for r in self.rows.values()]
        self.rt.allocator.check_integrity(torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64))
        table.check_integrity()
        assert all(table.clear_from(r.row, r.length) for r in self.rows.values())
