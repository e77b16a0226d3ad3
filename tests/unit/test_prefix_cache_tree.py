"""The radix tree alone: random insert / match / lock / unlock / evict sequences over both pools,
the match rule against a brute-force definition, and integrity of tree and pools after each op."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.memory import SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from swaserve.prefix_cache import RadixCache, evict, evict_all
from swaserve.prefix_cache.integrity import check_tree

FULL, SWA, W = 120, 60, 4


def brute_match(cache: RadixCache, ids: list[int], limit: int) -> int:
    """The match rule spelled out: the longest textual prefix m <= limit whose positions
    [m - W + 1, m) are live (all of [0, m) when m < W); 0 if none."""
    live, node, pos = [], cache.root, 0
    while pos < limit and ids[pos] in node.children:
        child = node.children[ids[pos]]
        k = 0
        while k < len(child.key) and pos < limit and child.key[k] == ids[pos]:
            live.append(child.live)
            k, pos = k + 1, pos + 1
        if k < len(child.key):
            break
        node = child
    window = cache.window
    ok = [m for m in range(len(live) + 1) if window is None or all(live[max(0, m - window + 1) : m])]
    return max(ok)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 3), st.integers(1, 30), st.integers(0, 30), st.booleans()),
        st.tuples(st.just("match"), st.integers(0, 3), st.integers(1, 30), st.just(0), st.booleans()),
        st.tuples(st.just("unlock"), st.integers(0, 10), st.just(0), st.just(0), st.just(False)),
        st.tuples(st.just("evict"), st.integers(0, 40), st.integers(0, 40), st.just(0), st.just(False)),
    ),
    max_size=40,
)


def seq(base: int, n: int) -> list[int]:
    # Four families of sequences sharing prefixes and diverging at different points.
    return [(k * 7 + (base if k >= 5 * base else 0)) % 11 for k in range(n)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, hybrid=st.booleans())
def test_random_tree_operations(ops, hybrid):
    alloc = SWATokenToKVPoolAllocator(FULL, SWA) if hybrid else TokenToKVPoolAllocator(FULL)
    cache = RadixCache(alloc, W if hybrid else None, check_tree)
    locked = []  # (node, SWA-locked from this position, or None) held by fake requests

    def check():
        cache.check_integrity()
        alloc.check_integrity(cache.owned_slots())
        for node, lo in locked:
            assert node.parent is not None, "a locked node was evicted"
            if lo is not None:  # the window before the match point keeps its SWA slots
                live = [n.live for n in reversed(list(cache.path(node))) for _ in n.key]
                assert all(live[lo:]), "an SWA-locked node lost its SWA slots"

    for op, a, b, c, flag in ops:
        if op == "insert":
            ids = seq(a, b)
            slots = alloc.alloc(b)
            if slots is None:
                evict(cache, b, b)
                slots = alloc.alloc(b)
                if slots is None:
                    continue
            swa_from = min(c, b)
            if hybrid and swa_from:
                alloc.free_swa(slots[:swa_from])  # the 'request' freed its out-of-window SWA slots
            node, tree = cache.insert(ids, slots, cache.root, swa_from if hybrid else 0)
            assert torch.equal(cache.path_slots(node), tree) and node.end == b
            if flag:
                cache.lock(node)
                locked.append((node, None))
            else:
                cache.prune(node)
        elif op == "match":
            ids = seq(a, b) + [99]
            expect = brute_match(cache, ids, b)
            m, node = cache.match(ids, b)
            assert m == expect and node.end == m
            if flag and m:
                cache.lock(node)
                lo = max(0, m - W + 1) if hybrid else None
                if lo is not None:
                    cache.lock_swa(node, lo)
                locked.append((node, lo))
        elif op == "unlock" and locked:
            node, lo = locked.pop(a % len(locked))
            if lo is not None:
                cache.unlock_swa(node, lo)
            cache.unlock(node)
            cache.prune(node)
        elif op == "evict":
            before = (alloc.full.available() if hybrid else alloc.available(), cache.full_evictable, cache.swa_evictable)
            evict(cache, a, b)
            full_free = alloc.full.available() if hybrid else alloc.available()
            assert full_free >= before[0] + min(a, before[1]), "evicted fewer full slots than asked and evictable"
            if hybrid:
                assert cache.swa_evictable <= max(0, before[2] - b) or alloc.swa.available() >= b
        check()
    for node, lo in locked:
        if lo is not None:
            cache.unlock_swa(node, lo)
        cache.unlock(node)
    locked.clear()
    evict_all(cache)
    check()
    assert cache.full_cached == 0 and not cache.root.children


def test_tombstone_cuts_the_match_back_and_healing_restores_it():
    alloc = SWATokenToKVPoolAllocator(40, 40)
    cache = RadixCache(alloc, W, check_tree)
    ids = list(range(1, 21))
    slots = alloc.alloc(20)
    alloc.free_swa(slots[:12])  # positions 0..11 were out of the request's window
    node, _ = cache.insert(ids, slots, cache.root, 12)
    assert [n.live for n in reversed(list(cache.path(node)))] == [False, True]
    assert cache.match(ids + [0], 20)[0] == 20
    assert cache.match(ids[:14] + [0], 14)[0] == 0, "positions 11-13 must be live for m = 14; 11 is not"
    assert cache.match(ids[:15] + [0], 15)[0] == 15
    # A second request computed positions 0..19 again and still holds SWA for 8..19: the
    # tombstone heals from 8 on, and its duplicate full slots go back to the pool.
    mine = alloc.alloc(20)
    alloc.free_swa(mine[:8])
    free_before = alloc.full.available()
    node2, tree = cache.insert(ids, mine, cache.root, 8)
    assert node2 is node and torch.equal(tree, slots)
    assert alloc.full.available() == free_before + 20
    assert cache.match(ids[:14] + [0], 14)[0] == 14
    cache.check_integrity()
    alloc.check_integrity(cache.owned_slots())


def test_eviction_frees_swa_first_then_lru_leaves():
    alloc = SWATokenToKVPoolAllocator(60, 40)
    cache = RadixCache(alloc, W, check_tree)
    for ids in ([1] * 10, [2] * 10):  # the oldest entries
        cache.insert(ids, alloc.alloc(10), cache.root, 0)
    inner, _ = cache.insert([3] * 10, alloc.alloc(10), cache.root, 0)
    leaf, _ = cache.insert([3] * 10 + [4] * 5, torch.cat([inner.value, alloc.alloc(5)]), inner, 0)
    evict(cache, 0, 5)  # the LRU live node is a free leaf: deleted whole (never left a tombstone)
    assert set(cache.root.children) == {2, 3} and cache.full_cached == 25
    cache.lock(leaf)  # a request reads the branch's full K/V, no longer its SWA K/V
    evict(cache, 0, 15)  # then [2]*10 (free leaf), then the inner node, root side first: tombstoned
    assert set(cache.root.children) == {3} and not inner.live and leaf.live
    evict(cache, 0, 5)  # a locked leaf may lose its SWA part in place (its request extends it)
    assert not leaf.live and leaf.parent is inner
    evict(cache, 15, 0)
    assert cache.full_cached == 15, "locked: nothing to delete"
    cache.check_integrity()
    cache.unlock(leaf)
    cache.prune(leaf)  # an unlocked tombstone leaf can never match: it goes, and its parent
    assert cache.full_cached == 0 and alloc.full.available() == 60 and alloc.swa.available() == 40
    alloc.check_integrity(cache.owned_slots())


@pytest.mark.parametrize("swa", [False, True])
def test_locked_paths_are_never_evicted(swa):
    alloc = SWATokenToKVPoolAllocator(30, 30)
    cache = RadixCache(alloc, W, check_tree)
    node, _ = cache.insert(list(range(10)), alloc.alloc(10), cache.root, 0)
    cache.lock(node)
    if swa:
        cache.lock_swa(node, 4)  # splits the node at 4: [4, 10) keeps its SWA slots
    evict_all(cache)
    evict(cache, 0, 30)
    # Locked in full only, a leaf may lose its SWA part in place; SWA-locked, [4, 10) keeps it.
    assert node.parent is not None and node.live == swa and node.start == (4 if swa else 0)
    assert not swa or not node.parent.live
    if swa:
        cache.unlock_swa(node, 4)
    cache.unlock(node)
    evict_all(cache)
    assert cache.full_cached == 0 and alloc.full.available() == 30 and alloc.swa.available() == 30
