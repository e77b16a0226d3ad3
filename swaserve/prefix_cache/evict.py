"""Eviction from the prefix cache under memory pressure: SWA parts first (tombstones), then whole
least-recently-used leaves."""

from __future__ import annotations

import heapq

from swaserve.prefix_cache.tree import RadixCache, TreeNode


def evict(cache: RadixCache, full_slots: int, swa_slots: int) -> None:
    """Free at least `full_slots` full and `swa_slots` SWA slots of unlocked cache, if there are.

    SWA: live nodes nobody may read the SWA K/V of, least recently used first and, within one
    path (same time), nearest the root first, so a branch keeps the tail that makes its end
    matchable. An inner node (or a leaf a request still holds in full) becomes a tombstone; a free
    leaf is deleted instead, since a tombstone leaf could never be matched. Full: least recently
    used unlocked leaves, deleted; parents that become free leaves join the candidates.
    """
    alloc = cache.allocator
    if swa_slots > 0 and cache.hybrid:
        target = alloc.swa.available() + min(swa_slots, cache.swa_evictable)  # type: ignore[union-attr]
        cands = sorted((n for n in cache.nodes() if n.live and n.swa_lock == 0), key=lambda n: (n.last_access, n.start))
        for node in cands:
            if alloc.swa.available() >= target:  # type: ignore[union-attr]
                break
            if node.parent is None or not node.live:  # deleted or tombstoned on the way
                continue
            if not node.children and node.lock == 0:
                parent = node.parent
                cache.delete(node)
                cache.prune(parent)
            else:
                cache.tombstone(node)
    if full_slots > 0:
        full = getattr(alloc, "full", alloc)
        target = full.available() + min(full_slots, cache.full_evictable)
        heap = [_key(n) for n in cache.nodes() if not n.children and n.lock == 0]
        heapq.heapify(heap)
        while heap and full.available() < target:
            *_, node = heapq.heappop(heap)
            if node.parent is None or node.children:
                continue
            parent = node.parent
            cache.delete(node)
            parent = cache.prune(parent)
            if parent is not cache.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, _key(parent))


def _key(node: TreeNode) -> tuple[int, int, int, TreeNode]:
    # Least recently used first; within one time, deepest first (leaves of one path go tail-first).
    return (node.last_access, -node.start, id(node), node)


def evict_all(cache: RadixCache) -> None:
    """Drop every unlocked node (the locked paths of running requests stay)."""
    evict(cache, cache.full_evictable, 0)
