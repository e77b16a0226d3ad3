"""The scheduler's side of the prefix cache: matching at admission, handing a request's K/V to the
tree (after its prefill and when it ends), lock bookkeeping, eviction for room, and the checks
that tie requests, tree and pools together."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from swaserve.memory.req_to_token import ReqToTokenPool
from swaserve.memory.window import SWAEvictor
from swaserve.prefix_cache import RadixCache, evict
from swaserve.scheduler.req import Req


class PrefixSharing:
    """Requests' shares of the prefix cache.

    Ownership: positions [0, req.cache_len) of a request are the tree's, through its locked path
    ending at `req.cache_node`; positions [cache_len, kv_len) are the request's own. A request
    frees SWA slots only of its own positions (`swa_evicted >= cache_len`); the tree's SWA slots
    are freed only by eviction, of nodes no request SWA-locks. A request SWA-locks its whole path
    SWA-locks the path from `swa_lo` on, the part its next queries may read; `swa_lo` follows its
    eviction frontier (in chunks), and the lock ends when the frontier passes `cache_len`. So a
    request pins no more SWA slots than without the cache (`SWAEvictor.max_held`).

    What the tree keeps in the SWA pool: exactly what the request still held when its K/V was
    handed over, i.e. the tail of each branch. After its prefill a request hands over the whole
    prompt; while it prefills, its out-of-window freeing spares the last `2W - 1` prompt positions
    (while W SWA slots are free), so a later prompt diverging in the last W tokens
    of this one (a shared system prompt, then a different question) finds its window live. When it
    ends it hands over prompt and output with its live tail (about W + margin + chunk), so a
    follow-up that extends the whole conversation matches all of it. A prompt diverging earlier
    than that, in the middle of a long cached prompt, gets a shorter match (usually none).
    """

    def __init__(self, cache: RadixCache, table: ReqToTokenPool, evictor: SWAEvictor | None):
        self.cache = cache
        self.table = table
        self.evictor = evictor
        self.window = cache.window
        self.uncommitted: list[Req] = []  # prefilled, prompt not yet handed to the tree
        self.hit_tokens = 0  # prompt tokens served from the cache at first admission
        self.query_tokens = 0  # prompt tokens of first admissions

    # -- admission ---------------------------------------------------------------------------

    def should_wait(self, req: Req, m: int, batch: Iterable[Req]) -> bool:
        """Whether `req` (matching m tokens now) should wait a step: a request prefilled in this
        batch, or not yet handed to the tree, shares at least `min(32, rest)` more of its tokens
        (n > 1 siblings share the whole prompt). Next step it finds them in the tree instead of
        computing them again; only the head of the queue waits, for one step."""
        limit = len(req.ids) - 1
        need = min(32, limit - m)
        if need <= 0 or req.scores_prompt:  # it computes its whole prompt anyway
            return False
        for r in (*batch, *self.uncommitted):
            if r.committed or r.finished or len(r.ids) < m + need:
                continue
            if r.ids[: m + need] == req.ids[: m + need]:
                return True
        return False

    def match(self, req: Req) -> int:
        """Match and lock the longest usable cached prefix (leaving one token to compute); m. Nothing for a
        request with prompt positions left to score: a cached prefix's logits are gone, so it computes them."""
        m, node = self.cache.match(req.ids, 0 if req.scores_prompt else len(req.ids) - 1)
        self.cache.lock(node)
        req.cache_node, req.cache_len = node, m
        self._lock_swa(req, m)
        return m

    def unmatch(self, req: Req) -> None:
        """The matched request was not admitted after all."""
        self._unlock(req)
        req.cache_node, req.cache_len = None, 0

    def _lock_swa(self, req: Req, kv_len: int) -> None:
        if self.evictor is not None and self.cache.hybrid and req.cache_len:
            req.swa_lo = min(self.evictor.frontier(kv_len), req.cache_len)
            self.cache.lock_swa(req.cache_node, req.swa_lo)
            req.swa_locked = True

    def _unlock(self, req: Req) -> None:
        if req.swa_locked:
            self.cache.unlock_swa(req.cache_node, req.swa_lo)
            req.swa_locked = False
        self.cache.unlock(req.cache_node)

    def start(self, req: Req) -> None:
        """The request got its row: its first cache_len positions are the tree's slots."""
        m = req.cache_len
        if m:
            self.table.write(req.row, 0, self.cache.path_slots(req.cache_node))  # type: ignore[arg-type]
        req.kv_len = req.swa_evicted = m
        req.prefill_end, req.committed = len(req.ids), False
        if req.num_cached_tokens is None:
            req.num_cached_tokens = min(m, req.prompt_len)
            self.hit_tokens += req.num_cached_tokens
            self.query_tokens += req.prompt_len

    # -- handing K/V to the tree -------------------------------------------------------------

    def prefilled(self, req: Req) -> None:
        """The request's last prefill chunk is scheduled; its prompt is handed over at the start of
        the next schedule (a step launched later reads it; one in the same batch would race)."""
        self.uncommitted.append(req)

    def commit(self) -> None:
        for req in self.uncommitted:
            if req.row is not None and not req.committed and not req.finished:
                self._hand_over(req, req.prefill_end, keep=True)
        self.uncommitted.clear()

    def _hand_over(self, req: Req, n: int, keep: bool) -> None:
        """Insert positions [0, n) of `req` into the tree. `keep`: the request runs on, so its row
        is pointed at the tree's slots and its lock moves to the new path end."""
        row, old = req.row, req.cache_node
        assert row is not None and old is not None and n >= req.cache_len
        if self.evictor is not None and self.window is not None:
            # The tree keeps SWA K/V only for the last 2W - 1 positions handed over (what a match up
            # to W tokens before the end needs); the request frees the rest of its own first.
            cut = min(n - (2 * self.window - 1), self.evictor.frontier(req.kv_len))
            if cut > req.swa_evicted:
                self.cache.allocator.free_swa(self.table.slots(row, req.swa_evicted, cut))  # type: ignore[union-attr]
                req.swa_evicted = cut
        node, tree = self.cache.insert(req.ids, self.table.slots(row, 0, n), old, req.swa_evicted)
        if keep:
            if tree.numel() and not torch.equal(tree, self.table.slots(row, req.cache_len, n)):
                self.table.write(row, req.cache_len, tree)
            self.cache.lock(node)
        self._unlock(req)
        if keep:
            req.cache_node, req.cache_len = node, n
            self._lock_swa(req, req.kv_len)
            req.swa_evicted = max(req.swa_evicted, n)
            req.committed = True
        else:
            self.cache.prune(node)

    def release(self, req: Req, free) -> None:  # noqa: ANN001 - the allocator's free
        """The request ends (finished, aborted, retracted): every position whose token the host
        knows goes to the tree; the rest (a decode in flight on an unseen input) is freed."""
        n = min(req.kv_len, len(req.ids))
        if req.kv_len > n:
            free(self.table.slots(req.row, n, req.kv_len))  # type: ignore[arg-type]
        self._hand_over(req, n, keep=False)
        req.cache_node, req.cache_len, req.swa_locked, req.committed = None, 0, False, True

    # -- SWA locks and freeing -----------------------------------------------------------------

    def release_swa_locks(self, reqs: Iterable[Req]) -> None:
        if self.evictor is None:
            return
        for r in reqs:
            if not r.swa_locked:
                continue
            f = self.evictor.frontier(r.kv_len)
            if f >= r.cache_len:
                self.cache.unlock_swa(r.cache_node, r.swa_lo)
                r.swa_locked = False
            elif f - r.swa_lo >= self.evictor.chunk:
                r.swa_lo = self.cache.unlock_swa(r.cache_node, r.swa_lo, upto=f)

    def evict_point(self, req: Req, swa_free: int) -> int:
        """`next_query_pos` to free out-of-window SWA slots against: the request's kv_len, held back
        while its prompt is not handed over yet so that the last 2W - 1 prompt positions stay."""
        # Sparing holds up to W more slots: only while W are free, so a tight pool never stalls.
        if req.committed or self.window is None or swa_free < self.window:
            return req.kv_len
        return min(req.kv_len, max(req.cache_len, req.prefill_end - self.window))

    # -- memory ------------------------------------------------------------------------------

    def available(self, full_free: int, swa_free: int | None) -> int:
        full = full_free + self.cache.full_evictable
        return full if swa_free is None else min(full, swa_free + self.cache.swa_evictable)

    def make_room(self, n: int, full_free: int, swa_free: int | None) -> None:
        evict(self.cache, n - full_free, 0 if swa_free is None else n - swa_free)

    # -- checks ------------------------------------------------------------------------------

    def check_integrity(self, reqs: list[Req]) -> None:
        """Tree and requests agree: each request's row starts with its path's slots, and every
        node's locks count exactly the requests through it."""
        cache = self.cache
        cache.check_integrity()
        locks: dict[int, list[int]] = {}
        for r in reqs:
            if r.row is None:
                assert r.cache_node is None and r.cache_len == 0, "a request without a row holds a cache path"
                continue
            node = r.cache_node
            assert node is not None and node.end == r.cache_len <= r.kv_len, "cache path and cache_len disagree"
            assert node is cache.root or node.parent is not None, "a request holds a deleted node"
            assert r.swa_evicted >= r.cache_len, "a request frees SWA slots the tree owns"
            assert torch.equal(self.table.slots(r.row, 0, r.cache_len), cache.path_slots(node)), "row != cache path"
            for n in cache.path(node):
                c = locks.setdefault(id(n), [0, 0])
                c[0] += 1
                c[1] += r.swa_locked and n.start >= r.swa_lo
        for n in cache.nodes():
            assert [n.lock, n.swa_lock] == locks.get(id(n), [0, 0]), "node locks != requests through it"
