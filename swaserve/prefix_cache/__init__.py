"""The SWA-aware prefix cache: a radix tree of cached prompt K/V (full slots always, SWA slots only
near branch ends) with LRU eviction; the scheduler matches, locks and inserts through it."""

from swaserve.prefix_cache.evict import evict, evict_all
from swaserve.prefix_cache.tree import RadixCache, TreeNode

__all__ = ["RadixCache", "TreeNode", "evict", "evict_all"]
