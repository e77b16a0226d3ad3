"""N-gram drafter: propose the tokens that followed the most recent earlier occurrence of the
sequence's own last n tokens (prompt lookup). Free to run, and strong on copy-heavy text (code
edits, summaries that quote, structured output)."""

from __future__ import annotations

from typing import Any


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one growing sequence starts, ascending. `update`
    indexes the n-grams the new tokens complete, so a step costs O(new tokens * max_n), not a scan
    of the history."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.seen = 0
        self.starts: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n + 1)]

    def update(self, ids: list[int]) -> None:
        for end in range(self.seen, len(ids)):  # n-grams ending at `end`
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                j = end - n + 1
                self.starts[n].setdefault(tuple(ids[j : end + 1]), []).append(j)
        self.seen = len(ids)


class NgramDrafter:
    """`lookup(ids, k)`: up to k tokens. Longest suffix first (`max_n` down to `min_n`); among
    matches of one length the latest one with k tokens after it wins, else the earliest (the most
    after it: in a repeating sequence the latest match sits right before the end). Looks back at
    most `lookback` tokens. `propose` answers the same from a per-request `NgramIndex`; `lookup`
    is the plain scan, kept as its reference."""

    def __init__(self, min_n: int = 1, max_n: int = 4, lookback: int = 4096):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n, self.lookback = min_n, max_n, lookback
        self.index: dict[str, NgramIndex] = {}

    def propose(self, reqs: list[Any], ks: list[int]) -> list[list[int]]:
        out = []
        for r, k in zip(reqs, ks):
            if k <= 0:
                out.append([])
                continue
            idx = self.index.get(r.rid)
            if idx is None:
                idx = self.index[r.rid] = NgramIndex(self.min_n, self.max_n)
            idx.update(r.ids)
            out.append(self.lookup_indexed(idx, r.ids, k))
        return out

    def release(self, req: Any) -> None:
        self.index.pop(req.rid, None)

    def lookup_indexed(self, idx: NgramIndex, ids: list[int], k: int) -> list[int]:
        n_ids = len(ids)
        lo = max(0, n_ids - self.lookback)
        for n in range(min(self.max_n, n_ids - 1), self.min_n - 1, -1):
            best = -1
            for j in reversed(idx.starts[n].get(tuple(ids[n_ids - n :]), ())):
                if j >= n_ids - n:
                    continue  # the suffix itself
                if j < lo:
                    break
                if n_ids - (j + n) >= k:
                    return ids[j + n : j + n + k]
                best = j
            if best >= 0:
                return ids[best + n : best + n + k]
        return []

    def lookup(self, ids: list[int], k: int) -> list[int]:
        n_ids = len(ids)
        lo = max(0, n_ids - self.lookback)
        for n in range(min(self.max_n, n_ids - 1), self.min_n - 1, -1):
            suffix = ids[n_ids - n:]
            first = suffix[0]
            best = -1
            # Starts j < n_ids - n with ids[j:j+n] == suffix, latest first (something follows each).
            for j in range(n_ids - n - 1, lo - 1, -1):
                if ids[j] == first and ids[j:j + n] == suffix:
                    if n_ids - (j + n) >= k:
                        return ids[j + n: j + n + k]
                    best = j  # scanning backwards: ends as the earliest match
            if best >= 0:
                return ids[best + n: best + n + k]
        return []
