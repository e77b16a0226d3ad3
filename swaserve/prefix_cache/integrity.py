"""check_tree: the prefix tree's invariants, checked by walking every node; a `RadixCache` built with
`check=check_tree` runs it from `check_integrity()`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from swaserve.prefix_cache.tree import RadixCache


def check_tree(cache: RadixCache) -> None:
    """Structure, liveness against the SWA mapping, no free tombstone leaf, counters, locks."""
    counts = [0, 0, 0, 0]
    table = cache.allocator.full_to_swa if cache.hybrid else None  # type: ignore[union-attr]
    for n in cache.nodes():
        p = n.parent
        assert p is not None and p.children.get(n.key[0]) is n, "child not under its first token"
        assert len(n.key) == n.value.numel() > 0 and n.start == p.end, "node key/value/start mismatch"
        assert int(n.value.min()) >= 1, "the prefix cache owns slot 0"
        assert n.lock >= n.swa_lock >= 0, "lock < swa_lock"
        assert n.lock >= sum(c.lock for c in n.children.values()), "a child is locked more than its parent"
        assert n.children or n.live or n.lock > 0, "an unlocked leaf is a tombstone"
        if table is not None:
            mapped = table[n.value] > 0
            assert bool(mapped.all()) if n.live else not bool(mapped.any()), "node liveness != SWA mapping"
        ln = len(n.key)
        counts[0] += ln
        counts[1] += ln if n.live and cache.hybrid else 0
        counts[2] += ln if n.lock == 0 else 0
        counts[3] += ln if n.live and cache.hybrid and n.swa_lock == 0 else 0
    assert counts == [cache.full_cached, cache.swa_cached, cache.full_evictable, cache.swa_evictable], (
        f"cache counters {[cache.full_cached, cache.swa_cached, cache.full_evictable, cache.swa_evictable]} "
        f"!= recount {counts}")
    owned = cache.owned_slots()
    assert torch.unique(owned).numel() == owned.numel(), "a slot is owned by two cache nodes"
