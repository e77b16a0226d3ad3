"""A step's masks (`grammar/masks.py`): only rows with a live grammar get one (`TokenMasks.rows`), filled into
reused `MaskRows` buffers (two host buffers in turn, each row exactly the mask a fresh fill gives),
on the worker thread as inline; `SequenceGrammar.terminated` is the matcher's own `is_terminated()`; a step's
rows accepted at once (`accept_tokens`) end in the states one token at a time gives, and the append after
does not accept again."""

from __future__ import annotations

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from swaserve.grammar.masks import MaskRows, fill_threads, fill_token_masks, start_fill
from swaserve.grammar.matcher import SequenceGrammar, accept_later, accept_tokens
from swaserve.runner.token_mask import allowed_tokens

VOCAB = ["<eos>", "a", "b", "ab", "ba", "c", "x", "y"] + [f"t{i}" for i in range(40)]  # 48 tokens: 2 words


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[0])
    return xgr.GrammarCompiler(info).compile_grammar('root ::= ("a" | "b")+ "c"')


def allowed(masks: torch.Tensor, j: int) -> set[int]:
    return set(allowed_tokens(masks[j : j + 1], len(VOCAB))[0].nonzero().flatten().tolist())


def test_masks_of_live_rows_only_in_a_reused_buffer(compiled):
    rows = MaskRows((len(VOCAB) + 31) // 32)
    g = [SequenceGrammar(compiled, [0]) for _ in range(3)]
    first = fill_token_masks([g[0], None, g[1]], len(VOCAB), rows)
    assert first is not None and first.masks.shape == (2, 2) and first.rows == [0, 2] and first.n == 3
    assert not first.every_row
    assert allowed(first.masks, 0) == allowed(first.masks, 1) == {1, 2, 3, 4}  # a, b, ab, ba
    storage = first.masks.untyped_storage().data_ptr()

    for tok in (1, 5, 0):  # g[1]: "a", "c", then the stop token: terminated
        assert g[1].accept(tok)
    assert g[1].terminated
    assert not g[1].accept(1)  # nothing after the end
    g[0].accept(3)  # "ab": now "c" may end it
    again = fill_token_masks([None, g[0], g[1], g[2]], len(VOCAB), rows)
    assert again is not None and again.rows == [1, 3], "no mask for no grammar, nor for a finished one"
    assert again.masks.untyped_storage().data_ptr() != storage, "the other buffer: the first may still be copied"
    third = fill_token_masks([None, g[0], g[1], g[2]], len(VOCAB), rows)
    assert third is not None and third.masks.untyped_storage().data_ptr() == storage, "the buffers are reused"
    fresh = fill_token_masks([None, g[0], g[1], g[2]], len(VOCAB))
    assert fresh is not None and torch.equal(again.masks, fresh.masks) and torch.equal(third.masks, fresh.masks)
    assert allowed(again.masks, 0) == {1, 2, 3, 4, 5} and allowed(again.masks, 1) == {1, 2, 3, 4}
    assert fill_token_masks([None, g[1]], len(VOCAB), rows) is None  # no live grammar: unconstrained
    every = fill_token_masks([g[0], g[2]], len(VOCAB))
    assert every is not None and every.every_row


def test_terminated_is_the_matchers_own(compiled):
    """The flag kept beside the matcher agrees with xgrammar after every token, refused ones included
    (a stop token before the grammar may end is refused and ends nothing)."""
    g = SequenceGrammar(compiled, [0])
    for tok in (0, 1, 6, 2, 0, 5, 3, 0, 0, 1):
        ok = g.accept(tok)
        assert g.terminated == g.matcher.is_terminated(), tok
        assert ok or tok in (0, 6, 3, 1)
    assert g.terminated and g.rejected == 4  # 0 and 6 refused, 3 after "c" refused, then ended


def test_accept_tokens_at_once_equals_one_at_a_time(compiled):
    """Random token streams (refused tokens, stop tokens, tokens after the end) through 12 sequences:
    `accept_tokens` then `appended` (the step loop's order) leaves every grammar where `accept` alone does:
    the same flags, refusals and next masks."""
    import random

    rnd = random.Random(0)
    one = [SequenceGrammar(compiled, [0]) for _ in range(12)]
    batch = [SequenceGrammar(compiled, [0]) for _ in range(12)]
    for _ in range(8):
        toks = [rnd.choice([1, 2, 3, 5, 0, 6]) for _ in one]
        before = sum(g.rejected for g in one)
        for g, t in zip(one, toks):
            g.accept(t)
        assert accept_tokens(batch, toks) == sum(g.rejected for g in one) - before  # the refused count
        assert all(g.ahead == 1 for g in batch)
        for g, t in zip(batch, toks):
            g.appended(t)  # counted down, not accepted twice
        assert [(g.terminated, g.rejected, g.ahead) for g in batch] == [(g.terminated, g.rejected, 0) for g in one]
        live = [i for i, g in enumerate(one) if not g.terminated]
        if live:
            a = fill_token_masks([one[i] for i in live], len(VOCAB))
            b = fill_token_masks([batch[i] for i in live], len(VOCAB))
            assert a is not None and b is not None and torch.equal(a.masks, b.masks)
    assert any(g.terminated for g in one) and any(g.rejected for g in one)
    assert accept_tokens([], []) == 0  # nothing to do


def test_accept_later_on_the_worker_equals_accepting_now(compiled):
    """`accept_later` (the step loop's bookkeeping) and the worker's job (xgrammar's accept, then the fill)
    leave every grammar where `accept_tokens` does, and fill the masks of the same states, for token streams
    drawn under each row's mask (what sampling gives): at once the flags the loop reads (terminated on a
    stop token), after the job the same next masks; no token refused. The rows it leaves live
    (`PendingAccept.live`) are the ones a pass over the grammars finds."""
    import random

    rnd = random.Random(1)
    now = [SequenceGrammar(compiled, [0]) for _ in range(12)]
    later = [SequenceGrammar(compiled, [0]) for _ in range(12)]
    words = (len(VOCAB) + 31) // 32
    rows = MaskRows(words)
    for step in range(10):
        live = [i for i, g in enumerate(now) if not g.terminated]
        if not live:
            break
        masks = fill_token_masks([now[i] for i in live], len(VOCAB))
        assert masks is not None
        toks = [0] * len(now)
        for j, i in enumerate(live):  # a token each live row's mask allows
            toks[i] = rnd.choice(sorted(allowed(masks.masks, j)))
        assert accept_tokens(now, toks) == 0
        pending = accept_later(later, toks)
        assert pending is not None and len(pending.grammars) == len(live)
        assert [g.terminated for g in later] == [g.terminated for g in now]  # known before xgrammar's call
        going = [i for i, g in enumerate(later) if not g.terminated]
        assert pending.live is not None and pending.live.rows == going and pending.live.n == len(later)
        assert pending.live.grammars == [later[i] for i in going]
        assert pending.live.handles == [later[i].handle for i in going]
        # the next step over the same rows fills from the pass `accept_later` made (every other step), or
        # from a pass of its own
        job = start_fill(pending.live if step % 2 else later, len(VOCAB), rows, background=True, accept=pending)
        expect = fill_token_masks(now, len(VOCAB))
        if job is None:  # every row ended: the accept is the caller's
            pending.run()
            assert expect is None
        else:
            got = job.result()
            assert expect is not None and got.rows == expect.rows and torch.equal(got.masks, expect.masks)
        assert pending.rejected == 0 and all(g.rejected == 0 for g in later)
        for g, h, t in zip(later, now, toks):
            g.appended(t)
            h.appended(t)
        assert [g.matcher.is_terminated() for g in later] == [g.matcher.is_terminated() for g in now]
    assert any(g.terminated for g in now)
    assert accept_later([], []) is None


def test_upload_copies_the_rows_handed_out(compiled):
    """`MaskRows.upload`: the filled rows on the device (on a GPU through the copy stream, the compute stream
    waiting for it; here the plain copy), equal to the host rows."""
    rows = MaskRows((len(VOCAB) + 31) // 32)
    g = [SequenceGrammar(compiled, [0]) for _ in range(3)]
    masks = fill_token_masks(g, len(VOCAB), rows)
    assert masks is not None
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = rows.upload(masks.masks, dev)
    assert out.device.type == dev.type and torch.equal(out.cpu(), masks.masks)


def test_background_fill_equals_inline(compiled):
    g = [SequenceGrammar(compiled, [0]) for _ in range(40)]
    for i, s in enumerate(g):
        for tok in ([1] * (i % 3) + [5] * (i % 2 and i % 3 > 0)):
            s.accept(tok)
    words = (len(VOCAB) + 31) // 32
    inline = fill_token_masks(g, len(VOCAB), MaskRows(words))
    job = start_fill(g, len(VOCAB), MaskRows(words), background=True)
    assert inline is not None and job is not None
    got = job.result()
    assert got.rows == inline.rows and torch.equal(got.masks, inline.masks)
    assert job.fill_seconds > 0


def test_fill_threads():
    assert fill_threads(1) == 1 and fill_threads(64, 8) == 1 and fill_threads(65, 8) == 2  # a thread per 64 rows
    assert fill_threads(256, 8) == 4 and fill_threads(300, 8) == 5 and fill_threads(4096, 8) == 8
    assert 1 <= fill_threads(4096) <= 8  # the default: a quarter of this process's CPUs, at most 8
    assert fill_threads(1024, 3) == 3 and fill_threads(1024, 0) == 1
