"""SequenceGrammar: one sequence's place in its compiled grammar (xgrammar's `GrammarMatcher`), advanced
by every token the sequence appends (its masks: `grammar/masks.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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
