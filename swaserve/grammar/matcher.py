"""SequenceGrammar: one sequence's place in its compiled grammar (xgrammar's `GrammarMatcher`), advanced
by every token the sequence appends; `fill_token_masks`: a batch's allowed-token bitmasks on the host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_BATCH: Any = None  # xgrammar's BatchGrammarMatcher (a thread pool), made on first use


class SequenceGrammar:
    """The grammar state of one sequence (a request with n > 1 has one per sequence).

    Invariant: the matcher has accepted exactly the sequence's output tokens the host has seen, in order
    (a sampled token always obeys the mask it was drawn under, so it is always accepted; a sequence
    retracted and recomputed keeps its tokens and so its state). `terminated` once it accepted a stop
    token: the output is complete. That is the matcher's `is_terminated()`, kept here so that the step
    loop asks xgrammar once per token, not three times."""

    __slots__ = ("matcher", "rejected", "stops", "terminated")

    def __init__(self, compiled: Any, stop_ids: Sequence[int]):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids) or None)
        self.stops = frozenset(self.matcher.stop_token_ids)  # (the compiled grammar's when stop_ids is empty)
        self.terminated = False
        self.rejected = 0  # tokens the grammar refused (only a token forced past the mask could be one)

    def accept(self, token: int) -> bool:
        if self.terminated:
            return False
        if self.matcher.accept_token(token):
            # A stop token is accepted only where the grammar may end, and ends it.
            self.terminated = token in self.stops
            return True
        self.rejected += 1
        return False


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


def fill_token_masks(grammars: Sequence[SequenceGrammar | None], vocab_size: int,
                     out: MaskRows | None = None) -> torch.Tensor | None:
    """`[n, ceil(vocab_size / 32)]` int32 on the host (in `out`'s buffer when given): row i has bit t of
    word t // 32 set where token t is allowed next for grammars[i]. Rows without a grammar (None, or a
    finished one: a sequence that ended while its next step was already launched) allow every token.
    None when no row has a live grammar (the batch samples unconstrained)."""
    global _BATCH
    live = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
    if not live:
        return None
    import xgrammar as xgr

    if _BATCH is None:
        _BATCH = xgr.BatchGrammarMatcher(max_threads="auto")
    words = (vocab_size + 31) // 32
    if out is None:
        out = MaskRows(words)
    assert out.words == words, (out.words, words)
    masks = out.rows(len(grammars))
    if len(live) < len(grammars):
        free = sorted(set(range(len(grammars))) - set(live))
        masks[free] = -1
    # Writes each live row whole.
    _BATCH.batch_fill_next_token_bitmask([grammars[i].matcher for i in live], masks,  # type: ignore[union-attr]
                                         indices=live)
    return masks
