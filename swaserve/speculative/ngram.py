"""N-gram drafter: propose the tokens that followed the most recent earlier occurrence of the
sequence's own last n tokens (prompt lookup). Free to run, and strong on copy-heavy text (code
edits, summaries that quote, structured output)."""

from __future__ import annotations


class NgramDrafter:
    """`lookup(ids, k)`: up to k tokens. Longest suffix first (`max_n` down to `min_n`); among
    matches of one length the latest one with k tokens after it wins, else the earliest (the most
    after it: in a repeating sequence the latest match sits right before the end). Looks back at most `lookback` tokens, so a step costs
    O(lookback * max_n) per request at worst."""

    def __init__(self, min_n: int = 1, max_n: int = 4, lookback: int = 4096):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n, self.lookback = min_n, max_n, lookback

    def propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        return [self.lookup(r.ids, k) if k > 0 else [] for r, k in zip(reqs, ks)]

    def release(self, req: object) -> None:
        pass  # nothing kept per request

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
