"""A step's allowed-token bitmasks on the host, for its constrained rows only: filled by xgrammar's batch
matcher (its own threads) into one reused host buffer (`MaskRows`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swaserve.grammar.matcher import SequenceGrammar

# xgrammar builds a thread pool for every batch fill; give each thread at least this many rows.
_ROWS_PER_THREAD = 32
_MAX_THREADS = 8


def fill_threads(rows: int) -> int:
    """xgrammar threads for filling `rows` masks: half the CPUs this process may run on (xgrammar's "auto"
    counts the whole machine's), at most 8, and one per 32 rows (its pool is made anew every call)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, cpus // 2, -(-rows // _ROWS_PER_THREAD)))


# xgrammar BatchGrammarMatcher by thread count, per calling thread: one with threads keeps its pool in
# itself during a call, so two threads must not share one.
_BATCHES = threading.local()


def _batch(threads: int) -> Any:
    mine: dict[int, Any] = _BATCHES.__dict__.setdefault("by_threads", {})
    b = mine.get(threads)
    if b is None:
        import xgrammar as xgr

        b = mine[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
    return b


class MaskRows:
    """The host buffer a step's bitmask rows are filled into, reused from step to step (pinned where CUDA
    is available) instead of a fresh pinned `[rows, words]` tensor allocated and cleared every step (8 MB
    at 256 rows of a 262k vocabulary). `rows(n)` first waits for the copy that read the buffer last (done
    already in practice: the step that used it has sampled since)."""

    def __init__(self, words: int):
        self.words = words
        self.buf: torch.Tensor | None = None
        self.read: Any = None  # torch.cuda.Event recorded after the last copy from the buffer

    def rows(self, n: int) -> torch.Tensor:
        if self.read is not None:
            self.read.synchronize()
            self.read = None
        if self.buf is None or self.buf.shape[0] < n:
            self.buf = torch.empty(max(n, 64), self.words, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        return self.buf[:n]

    def copied(self) -> None:
        """The rows handed out last are being copied to the device on the current stream."""
        if torch.cuda.is_available() and self.buf is not None and self.buf.is_pinned():
            self.read = torch.cuda.Event()
            self.read.record()


@dataclass
class TokenMasks:
    """Bitmasks of a batch's rows with a live grammar: `masks[j]` has bit t % 32 of word t // 32 set where
    token t may follow batch row `rows[j]`; the batch's other rows (`n` in all) are unconstrained."""

    masks: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, host (MaskRows' buffer when given one)
    rows: list[int]  # ascending positions in the batch
    n: int

    @property
    def every_row(self) -> bool:
        return len(self.rows) == self.n


def fill_token_masks(grammars: Sequence[SequenceGrammar | None], vocab_size: int,
                     out: MaskRows | None = None) -> TokenMasks | None:
    """The masks of `grammars`' live rows (None, or a terminated grammar: a sequence that ended while its
    next step was already launched, samples unconstrained); None when no row has a live grammar."""
    live = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
    if not live:
        return None
    words = (vocab_size + 31) // 32
    if out is None:
        out = MaskRows(words)
    assert out.words == words, (out.words, words)
    masks = TokenMasks(out.rows(len(live)), live, len(grammars))
    _batch(fill_threads(len(live))).batch_fill_next_token_bitmask([grammars[i].matcher for i in live],  # type: ignore[union-attr]
                                                                  masks.masks)
    return masks
