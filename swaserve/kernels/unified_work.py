"""The extend tiles of a captured extend step (`extend_tiles`): the unified attention's work list, built
on the device from the step's `qo_indptr`, so an extend launch's grid depends on no batch.

A request with n > 1 queries gets ceil(n / toks) tiles of `toks` queries (`unified_attention`'s extend
tile: 64 rows of (query, head of the GQA group) pairs); a request with one query is a decode row, which
the step's decode launch takes; a padded request (no queries) gets none. Tile i is `(b, t0)`: request b,
its queries t0 .. t0 + toks - 1. Entries past the step's tiles hold (0, `NO_TILE`): their programs exit.
"""

from __future__ import annotations

import torch

NO_TILE = 1 << 30  # a first query no request reaches


def extend_tile_capacity(max_tokens: int, max_requests: int, toks: int) -> int:
    """Tiles a step of at most `max_tokens` queries over `max_requests` requests can need: every request
    with queries past a multiple of `toks` adds one, and each has at least two queries."""
    return -(-max_tokens // toks) + min(max_requests, max_tokens // 2)


def extend_tiles(qo_indptr: torch.Tensor, toks: int, capacity: int) -> torch.Tensor:
    """`[2, capacity]` int32 (request row, first query) per tile, from `qo_indptr` (`[R+1]` int32, device).
    Device ops only, no host sync: it can be captured in a CUDA graph."""
    ext = (qo_indptr[1:] - qo_indptr[:-1]).long()
    tiles = torch.where(ext > 1, (ext + toks - 1) // toks, 0)
    ends = tiles.cumsum(0)  # tile i is request b's where ends[b-1] <= i < ends[b]
    i = torch.arange(capacity, device=qo_indptr.device)
    b = torch.searchsorted(ends, i, right=True).clamp_(max=ext.numel() - 1)
    t0 = (i - (ends[b] - tiles[b])) * toks
    live = i < ends[-1]
    return torch.stack([torch.where(live, b, 0), torch.where(live, t0, NO_TILE)]).to(torch.int32)
