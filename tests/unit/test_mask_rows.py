"""`fill_token_masks` into a reused `MaskRows` buffer: the same host storage every step, each live row
exactly the mask a fresh fill gives, and every row without a live grammar (none, or terminated) all
ones again even where the buffer held another step's mask; `SequenceGrammar.terminated` is the matcher's own
`is_terminated()`."""

from __future__ import annotations

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from swaserve.grammar.matcher import MaskRows, SequenceGrammar, fill_token_masks  # noqa: E402

VOCAB = ["<eos>", "a", "b", "ab", "ba", "c", "x", "y"] + [f"t{i}" for i in range(40)]  # 48 tokens: 2 words


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[0])
    return xgr.GrammarCompiler(info).compile_grammar('root ::= ("a" | "b")+ "c"')


def test_reused_rows_equal_fresh_fills(compiled):
    rows = MaskRows((len(VOCAB) + 31) // 32)
    g = [SequenceGrammar(compiled, [0]) for _ in range(3)]
    first = fill_token_masks([g[0], None, g[1]], len(VOCAB), rows)
    assert first is not None and first.shape == (3, 2)
    assert (first[1] == -1).all()  # no grammar: every token
    allowed = {t for t in range(len(VOCAB)) if int(first[0, t // 32]) >> (t % 32) & 1}
    assert allowed == {1, 2, 3, 4}  # a, b, ab, ba
    storage = first.untyped_storage().data_ptr()

    for tok in (1, 5, 0):  # g[1]: "a", "c", then the stop token: terminated
        assert g[1].accept(tok)
    assert g[1].terminated
    g[0].accept(3)  # "ab": now "c" may end it
    again = fill_token_masks([None, g[0], g[1], g[2]], len(VOCAB), rows)
    assert again.untyped_storage().data_ptr() == storage, "the buffer is reused"
    fresh = fill_token_masks([None, g[0], g[1], g[2]], len(VOCAB))
    assert torch.equal(again, fresh)
    assert (again[0] == -1).all() and (again[2] == -1).all()  # no grammar; a finished one
    assert fill_token_masks([None, g[1]], len(VOCAB), rows) is None  # no live grammar: unconstrained


def test_terminated_is_the_matchers_own(compiled):
    """The flag kept beside the matcher agrees with xgrammar after every token, refused ones included
    (a stop token before the grammar may end is refused and ends nothing)."""
    g = SequenceGrammar(compiled, [0])
    for tok in (0, 1, 6, 2, 0, 5, 3, 0, 0, 1):
        ok = g.accept(tok)
        assert g.terminated == g.matcher.is_terminated(), tok
        assert ok or tok in (0, 6, 3, 1)
    assert g.terminated and g.rejected == 4  # 0 and 6 refused, 3 after "c" refused, then ended
