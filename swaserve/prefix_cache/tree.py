"""The SWA-aware radix tree: token-id runs whose nodes own full-pool slots, and SWA slots only where
still live (a node without them is a tombstone). Matching, insertion, locks (integrity: integrity.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from swaserve.memory.allocator import TokenToKVPoolAllocator
from swaserve.memory.swa import SWATokenToKVPoolAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """A run of tokens at positions [start, start + len(key)) of every sequence through this node.

    `value[i]` (int64, cpu) is the full-pool slot holding the K/V of `key[i]`. `live`: every slot
    of the node has an SWA slot (`full_to_swa != 0`); otherwise none has (a tombstone, full K/V
    only). `lock`: running requests whose cached prefix runs through this node; `swa_lock`: those
    of them that may still read its SWA K/V. A request locks every node of its path, so
    `lock >= swa_lock >= 0` and a node's lock is at least the sum of its children's.
    """

    __slots__ = ("key", "value", "parent", "children", "start", "live", "lock", "swa_lock", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, start: int, live: bool):
        self.key = key
        self.value = value  # [len(key)] int64, cpu: full-pool slots
        self.parent = parent  # None for the root and for deleted nodes
        self.children: dict[int, TreeNode] = {}  # by first token
        self.start = start
        self.live = live
        self.lock = 0
        self.swa_lock = 0
        self.last_access = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)


class RadixCache:
    """Cached K/V of token prefixes, owned in full-pool slots.

    Invariants (`check_integrity`): each slot is owned by one node at most, never slot 0; a live
    node's slots all map to SWA slots, a tombstone's none; an unlocked leaf is never a tombstone
    (its full K/V could never be matched: the query after it needs its SWA K/V); the counters
    equal their definitions. With `window=None` (no SWA pool) every node is live and any textual
    prefix matches.

    The match rule: a prefix of length m is usable iff positions [max(0, m - W + 1), m) are all
    live — the query at m attends exactly those keys in SWA layers — and m < len(ids), so that at
    least one token is computed to give logits.
    """

    def __init__(self, allocator: SWATokenToKVPoolAllocator | TokenToKVPoolAllocator, window: int | None,
                 check: Callable[[RadixCache], None] | None = None):
        self.allocator = allocator
        self.check = check  # integrity.check_tree: the check imports the tree, never the reverse
        self.hybrid = isinstance(allocator, SWATokenToKVPoolAllocator) and window is not None
        self.window = window if self.hybrid else None
        self.root = TreeNode([], _EMPTY, None, 0, True)
        self.root.lock = 1  # the root is never evicted
        self._clock = 0
        # Slot counts (each a sum over nodes): held, and freeable by eviction right now.
        self.full_cached = 0
        self.swa_cached = 0
        self.full_evictable = 0  # nodes with lock == 0 (their subtrees are unlocked too)
        self.swa_evictable = 0  # live nodes with swa_lock == 0 (tombstoned, or deleted if a free leaf)

    # -- accounting --------------------------------------------------------------------------

    def _account(self, node: TreeNode, sign: int) -> None:
        n = sign * len(node.key)
        self.full_cached += n
        if node.lock == 0:
            self.full_evictable += n
        if node.live and self.hybrid:
            self.swa_cached += n
            if node.swa_lock == 0:
                self.swa_evictable += n

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- matching ----------------------------------------------------------------------------

    def match(self, ids: Sequence[int], limit: int) -> tuple[int, TreeNode]:
        """Longest usable cached prefix of `ids[:limit]`: (m, the node ending exactly at m; the
        root for m = 0). Splits a node if m falls inside it; refreshes the path's LRU time."""
        node, pos, run = self.root, 0, 0  # run: live positions ending at pos
        best, best_node, best_off = 0, self.root, 0
        w = self.window
        while pos < limit:
            child = node.children.get(ids[pos])
            if child is None:
                break
            c = _common(child.key, ids, pos, limit)
            if child.live:
                run += c
                if w is None or run >= min(pos + c, w - 1):
                    best, best_node, best_off = pos + c, child, c
            else:
                run = 0
            if c < len(child.key):
                break
            node, pos = child, pos + c
        if best_node is not self.root and best_off < len(best_node.key):
            best_node = self.split(best_node, best_off)
        now = self.tick()
        for n in self.path(best_node):
            n.last_access = now
        return best, best_node

    def path(self, node: TreeNode) -> Iterator[TreeNode]:
        """`node` and its ancestors up to (not including) the root."""
        while node is not self.root:
            yield node
            node = node.parent  # type: ignore[assignment]

    def path_slots(self, node: TreeNode) -> torch.Tensor:
        """Full slots of positions [0, node.end) (int64, cpu)."""
        parts = [n.value for n in self.path(node)]
        return torch.cat(parts[::-1]) if parts else _EMPTY

    # -- structure ---------------------------------------------------------------------------

    def split(self, node: TreeNode, c: int) -> TreeNode:
        """Cut `node` after its first c tokens; returns the new parent holding them. `node` keeps
        the tail (so requests' handles to it stay valid) and both keep its locks and liveness."""
        assert 0 < c < len(node.key)
        head = TreeNode(node.key[:c], node.value[:c], node.parent, node.start, node.live)
        head.lock, head.swa_lock, head.last_access = node.lock, node.swa_lock, node.last_access
        head.parent.children[node.key[0]] = head  # type: ignore[union-attr]
        node.key, node.value, node.start = node.key[c:], node.value[c:], node.start + c
        head.children[node.key[0]] = node
        node.parent = head
        return head

    def _add(self, parent: TreeNode, key: list[int], value: torch.Tensor, live: bool) -> TreeNode:
        node = TreeNode(key, value, parent, parent.end, live)
        node.last_access = self._clock
        parent.children[key[0]] = node
        self._account(node, +1)
        return node

    def delete(self, node: TreeNode) -> None:
        """Remove an unlocked leaf, freeing its full slots (and SWA slots if live)."""
        assert not node.children and node.lock == 0 and node is not self.root
        self._account(node, -1)
        self.allocator.free(node.value)
        del node.parent.children[node.key[0]]  # type: ignore[union-attr]
        node.parent = None

    def tombstone(self, node: TreeNode) -> None:
        """Free a live node's SWA slots, keeping its full K/V."""
        assert node.live and node.swa_lock == 0 and self.hybrid
        self._account(node, -1)
        self.allocator.free_swa(node.value)  # type: ignore[union-attr]
        node.live = False
        self._account(node, +1)

    def prune(self, node: TreeNode) -> TreeNode:
        """Delete unlocked tombstone leaves from `node` upwards (nothing could ever match them);
        returns the first node kept."""
        while node is not self.root and not node.children and node.lock == 0 and not node.live:
            parent = node.parent
            self.delete(node)
            node = parent  # type: ignore[assignment]
        return node

    # -- insertion ---------------------------------------------------------------------------

    def insert(self, ids: Sequence[int], slots: torch.Tensor, node: TreeNode, swa_from: int) -> tuple[TreeNode, torch.Tensor]:
        """Hand a request's K/V of positions [node.end, len(slots)) to the tree.

        `node` is the request's cached path (positions [0, node.end) are already the tree's);
        `slots` its full slots of every position; positions >= `swa_from` have live SWA slots, the
        others none. Where the tree already holds a position the request's slots are freed (a
        tombstoned node first takes over the request's SWA slots: healing). Returns the node
        ending at len(slots) and the tree's slots of [node.end, len(slots)) for the request's row.
        """
        pos, n = node.end, slots.numel()
        start = pos
        out: list[torch.Tensor] = []
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:
                cut = min(max(pos, swa_from), n)
                if cut > pos:  # the part the request already freed in the SWA pool
                    node = self._add(node, list(ids[pos:cut]), slots[pos:cut], live=not self.hybrid)
                if n > cut:
                    node = self._add(node, list(ids[cut:n]), slots[cut:n], live=True)
                out.append(slots[pos:n])
                pos = n
                break
            c = _common(child.key, ids, pos, n)
            if c < len(child.key):
                child = self.split(child, c)
            if not child.live and pos < swa_from < pos + c:
                c = swa_from - pos  # this part stays a tombstone; the next round heals the rest
                child = self.split(child, c)
            mine = slots[pos : pos + c]
            if not child.live and pos >= swa_from:
                self._account(child, -1)
                self.allocator.move_swa(mine, child.value)  # type: ignore[union-attr]
                child.live = True
                self._account(child, +1)
            self.allocator.free(mine)
            out.append(child.value)
            node, pos = child, pos + c
        now = self.tick()
        for p in self.path(node):
            p.last_access = now
        return node, torch.cat(out) if out else slots[start:start]

    # -- locks -------------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """A request's cached prefix now ends at `node`: it reads the full K/V of the whole path."""
        for n in self.path(node):
            self._account(n, -1)
            n.lock += 1
            self._account(n, +1)

    def unlock(self, node: TreeNode) -> None:
        for n in self.path(node):
            self._account(n, -1)
            n.lock -= 1
            self._account(n, +1)
            assert n.lock >= n.swa_lock >= 0, "unbalanced prefix-cache lock"

    def lock_swa(self, node: TreeNode, lo: int) -> None:
        """The request may read the SWA K/V of positions [lo, node.end): SWA-lock the path's nodes
        from position lo on (splitting one at lo, so that later splits keep the locked set exactly
        the path nodes starting at or after lo)."""
        self._cut(node, lo)
        for n in self.path(node):
            if n.start < lo:
                break
            self._account(n, -1)
            n.swa_lock += 1
            self._account(n, +1)

    def unlock_swa(self, node: TreeNode, lo: int, upto: int | None = None) -> int:
        """Undo `lock_swa(node, lo)` for the nodes ending at or before `upto` (all when None),
        splitting one at `upto`; returns the new lower end of the locked range."""
        if upto is not None:
            self._cut(node, upto)
        new_lo = lo
        for n in self.path(node):
            if n.start < lo:
                break
            if upto is None or n.end <= upto:
                self._account(n, -1)
                n.swa_lock -= 1
                self._account(n, +1)
                assert n.lock >= n.swa_lock >= 0, "unbalanced prefix-cache SWA lock"
                new_lo = max(new_lo, n.end)
        return new_lo

    def _cut(self, node: TreeNode, pos: int) -> None:
        """Make `pos` a node boundary on the path to `node` (if it falls inside a path node)."""
        for n in self.path(node):
            if n.start < pos < n.end:
                self.split(n, pos - n.start)
                return
            if n.end <= pos:
                return

    # -- inspection --------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def owned_slots(self) -> torch.Tensor:
        parts = [n.value for n in self.nodes()]
        return torch.cat(parts) if parts else _EMPTY

    def check_integrity(self) -> None:
        """Structure, liveness against the SWA mapping, no free tombstone leaf, counters, locks."""
        assert self.check is not None, "built without check= (prefix_cache.integrity.check_tree)"
        self.check(self)


def _common(key: list[int], ids: Sequence[int], start: int, end: int) -> int:
    """Length of the common prefix of `key` and `ids[start:end]`."""
    n = min(len(key), end - start)
    if key[:n] == list(ids[start : start + n]):
        return n
    i = 0
    while key[i] == ids[start + i]:
        i += 1
    return i
