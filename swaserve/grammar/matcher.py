"""SequenceGrammar: one sequence's place in its compiled grammar (xgrammar's `GrammarMatcher`), advanced
by every token the sequence appends (its masks: `grammar/masks.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class SequenceGrammar:
    """The grammar state of one sequence (a request with n > 1 has one per sequence).

    Invariant: the matcher has accepted exactly the sequence's output tokens the host has seen, in order
    (a sampled token always obeys the mask it was drawn under, so it is always accepted; a sequence
    retracted and recomputed keeps its tokens and so its state). `terminated` once it accepted a stop
    token: the output is complete. That is the matcher's `is_terminated()`, kept here so that the step
    loop asks xgrammar once per token, not three times. `ahead`: tokens accepted (`accept_tokens`) before
    the sequence appended them; its append then only counts them down."""

    __slots__ = ("ahead", "handle", "matcher", "rejected", "stops", "terminated")

    def __init__(self, compiled: Any, stop_ids: Sequence[int]):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids) or None)
        self.handle = getattr(self.matcher, "_handle", None)  # xgrammar's core object (`_batch_accept`)
        self.stops = frozenset(self.matcher.stop_token_ids)  # (the compiled grammar's when stop_ids is empty)
        self.terminated = False
        self.rejected = 0  # tokens the grammar refused (only a token forced past the mask could be one)
        self.ahead = 0

    def accept(self, token: int) -> bool:
        if self.terminated:
            return False
        return self._accepted(token, self.matcher.accept_token(token))

    def appended(self, token: int) -> None:
        """The sequence appended `token`: accept it, unless `accept_tokens` already did."""
        if self.ahead:
            self.ahead -= 1
        else:
            self.accept(token)

    def _accepted(self, token: int, ok: bool) -> bool:
        if ok:
            # A stop token is accepted only where the grammar may end, and ends it.
            self.terminated = token in self.stops
            return True
        self.rejected += 1
        return False


def accept_tokens(grammars: Sequence[SequenceGrammar | None], tokens: Sequence[int]) -> int:
    """Each grammar accepts its token ahead of the sequence's append (`SequenceGrammar.appended`), the live
    ones in one xgrammar call (None: a row without a grammar, or one that will not append, skipped): the step
    loop does this first thing after a step's tokens arrive, so the next step's masks can start filling
    before the rest of the step's output is processed. Returns how many tokens were refused: 0 unless a
    token was sampled past its row's mask (`grammar_rejected_tokens_total`)."""
    live, toks = [], []
    for g, t in zip(grammars, tokens):  # one pass: at 256 rows each pass over them costs ~15-30 us
        if g is None:
            continue
        g.ahead += 1
        if not g.terminated:
            live.append(g)
            toks.append(t)
    if not live:
        return 0
    oks = _batch_accept(live, [g.handle for g in live], toks)
    if oks is None:  # every token accepted (the usual case: each was drawn under its row's mask)
        # `_accepted(t, True)` inlined: the call a row cost ~0.5 us of the ~1.7 (CPU, --host-only)
        for g, t in zip(live, toks):
            g.terminated = t in g.stops
        return 0
    for g, t, ok in zip(live, toks, oks):
        g._accepted(t, ok)
    return sum(not ok for ok in oks)


class LiveRows(NamedTuple):
    """A batch's rows with a live grammar: their grammars, positions in the batch (ascending) and xgrammar
    core objects, and the batch's size `n`."""

    grammars: list[SequenceGrammar]
    rows: list[int]
    handles: list[Any]
    n: int


class PendingAccept:
    """A step's tokens its live grammars took as accepted (`accept_later`) before xgrammar has seen them:
    `run()` makes the one xgrammar call, on the mask worker, right before it fills the next step's masks
    from the states it leaves (`masks.MaskJob`). Until then the matchers lag the sequences by this token;
    nothing reads them meanwhile (the step loop's next read is that fill's result). `handles`: xgrammar's
    core objects of `grammars`, gathered by the step loop's pass, so the worker holds the GIL for no pass
    of its own between its two calls. `rejected`: tokens refused (0 unless one was sampled past its row's
    mask). `live`: what the same pass found for a next step over the same rows (`masks.start_fill` takes
    it for its grammars): the grammars that did not end on their token, with their positions and handles."""

    __slots__ = ("grammars", "handles", "live", "rejected", "tokens")

    def __init__(self, grammars: list[SequenceGrammar], handles: list[Any], tokens: list[int], live: LiveRows):
        self.grammars = grammars
        self.handles = handles
        self.tokens = tokens
        self.live = live
        self.rejected = 0

    def run(self) -> None:
        oks = _batch_accept(self.grammars, self.handles, self.tokens)
        if oks is None:
            return
        for g, ok in zip(self.grammars, oks):
            if not ok:  # (`terminated` stays as `accept_later` set it: the loop may have read it already)
                g.rejected += 1
                self.rejected += 1


def accept_later(grammars: Sequence[SequenceGrammar | None], tokens: Sequence[int]) -> PendingAccept | None:
    """`accept_tokens` without the xgrammar call, which the returned `PendingAccept` makes later (None: no
    grammar was live): each live grammar counts its token as accepted now, terminated if it is one of its
    stop tokens (what xgrammar says of a token drawn under the row's mask), so the step loop can go on
    committing the step while a worker thread makes the call (~1-3 us a row, the GIL released). None
    entries are skipped, as in `accept_tokens`. The same pass lists the rows whose grammar goes on
    (`PendingAccept.live`), the next step's fill where it runs over the same rows."""
    live, handles, toks, rows = [], [], [], []
    ended = False
    for i, (g, t) in enumerate(zip(grammars, tokens)):
        if g is None:
            continue
        g.ahead += 1
        if not g.terminated:
            live.append(g)
            handles.append(g.handle)
            toks.append(t)
            rows.append(i)
            if t in g.stops:
                g.terminated = ended = True
    if not live:
        return None
    n = len(grammars)
    going = LiveRows(live, rows, handles, n)
    if ended:  # (rare: a grammar ended on this token) the rows that go on
        keep = [j for j, g in enumerate(live) if not g.terminated]
        going = LiveRows([live[j] for j in keep], [rows[j] for j in keep], [handles[j] for j in keep], n)
    return PendingAccept(live, handles, toks, going)


def _batch_accept(grammars: list[SequenceGrammar], handles: list[Any], tokens: list[int]) -> Sequence[bool] | None:
    """xgrammar's batch accept (`handles`: the grammars' core objects); None when it accepted every token.
    Its public wrapper converts the result row by row through the FFI (a third of the call at 256 rows,
    ~0.6 us a row); the core's array (of ints 0 / 1: `False in` never matches) answers `0 in` natively, so
    rows are read one by one only when some token was refused."""
    import xgrammar as xgr

    core = getattr(getattr(xgr.matcher, "_core", None), "BatchGrammarMatcher", None)
    if core is None or handles[0] is None:  # another xgrammar layout: the public call
        oks = xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], tokens)
        return None if all(oks) else oks
    result = core.batch_accept_token(handles, tokens, False)
    return None if 0 not in result else [bool(ok) for ok in result]
