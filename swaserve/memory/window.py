"""Out-of-window freeing: release the SWA slots of positions no present or future query can see.

The window, defined once (HF convention): a query at position p attends keys p-W+1 .. p, i.e. W
keys including itself. If every query at positions < `next_query_pos` has run, the earliest key any
remaining query can read is `next_query_pos - W + 1`; everything before it, less `margin` positions
kept for steps in flight, is dead in the SWA pool. Full-pool slots are untouched.

Bound: slots are freed in chunks of `chunk`, so right after `evict` a request keeps at most
`swa_slots_kept(W, margin, chunk) = (W - 2) + margin + chunk` SWA slots (fewer than a chunk of dead
positions left, plus the W - 1 + margin live ones), and holds that plus the tokens scheduled after it:
in steady decode (one new token per step) W - 1 + margin + chunk.
"""

from __future__ import annotations

import torch

from swaserve.memory.req_to_token import ReqToTokenPool
from swaserve.memory.swa import SWATokenToKVPoolAllocator


def swa_slots_kept(window: int, margin: int, chunk: int) -> int:
    """Most SWA slots a request keeps right after out-of-window freeing at its `next_query_pos`:
    the W - 1 + margin positions a future query may still read, plus up to `chunk - 1` dead ones
    waiting for a full chunk. The memory planner counts requests with it."""
    return window - 2 + margin + chunk


class SWAEvictor:
    """Frees out-of-window SWA slots of one request at a time; stateless apart from its settings."""

    def __init__(
        self,
        allocator: SWATokenToKVPoolAllocator,
        req_to_token: ReqToTokenPool,
        window: int,
        margin: int = 1,
        chunk: int = 1,
    ):
        if window < 1 or margin < 0 or chunk < 1:
            raise ValueError(f"bad eviction settings: window={window} margin={margin} chunk={chunk}")
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.window = window
        self.margin = margin
        self.chunk = chunk

    @property
    def threshold(self) -> int:
        """`evict` frees something iff `next_query_pos - evicted >= threshold`: callers test this
        inline on the per-step path instead of calling `evict` for every request."""
        return swa_slots_kept(self.window, self.margin, self.chunk) + 1

    def frontier(self, next_query_pos: int) -> int:
        """First position that a query at >= next_query_pos may still read (less the margin)."""
        return max(0, next_query_pos - self.window + 1 - self.margin)

    def evict(self, row: int, next_query_pos: int, evicted: int) -> int:
        """Free SWA slots of positions [evicted, frontier) once at least `chunk` are dead.

        Args:
            row: the request's row in the request table.
            next_query_pos: every query at a position below this has run (= KV-committed length).
            evicted: positions below this were already freed in the SWA pool.
        Returns:
            the new `evicted`.
        """
        return self.evict_many([(row, next_query_pos, evicted)])[0]

    def evict_many(self, items: list[tuple[int, int, int]]) -> list[int]:
        """`evict` for several (row, next_query_pos, evicted) at once, with one `free_swa` call for
        all of them (a decode step evicts a few requests; each call costs several tensor ops, and on
        a GPU a copy and a launch). Returns the new `evicted` of each."""
        out, dead = [], []
        for row, next_query_pos, evicted in items:
            frontier = self.frontier(next_query_pos)
            if frontier - evicted < self.chunk:
                out.append(evicted)
                continue
            dead.append(self.req_to_token.slots(row, evicted, frontier))
            out.append(frontier)
        if dead:
            self.allocator.free_swa(dead[0] if len(dead) == 1 else torch.cat(dead))
        return out

    def max_held(self, new_tokens_per_step: int = 1) -> int:
        """Most SWA slots one request holds after freeing and then allocating `new_tokens_per_step`
        (the module docstring; exact: a request decoding in step with its chunks reaches it)."""
        return swa_slots_kept(self.window, self.margin, self.chunk) + new_tokens_per_step
