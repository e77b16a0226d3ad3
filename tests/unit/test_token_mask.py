"""`runner/token_mask.py`: bitmasks read as bytes give exactly "token t allowed iff bit t % 32 of word t // 32"
(the sign bit included, a vocabulary that ends inside a word), and masks given for some rows only
(`rows`) change those rows' logits as a mask per row would, leaving the others untouched."""

from __future__ import annotations

import torch

from swaserve.runner.token_mask import allowed_tokens, apply_token_bitmask


def reference(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.tensor([[bool(int(row[t // 32]) >> (t % 32) & 1) for t in range(vocab)] for row in masks])


def test_bits_read_as_bytes_match_the_word_definition():
    g = torch.Generator().manual_seed(0)
    masks = torch.randint(-(2**31), 2**31, (5, 4), dtype=torch.int64, generator=g).to(torch.int32)
    masks[0] = -1  # every token
    masks[1] = 0  # none
    masks[2, 1] = -(2**31)  # the sign bit alone: token 63
    for vocab in (128, 100, 97):
        assert torch.equal(allowed_tokens(masks, vocab), reference(masks, vocab)), vocab
    assert allowed_tokens(masks, 128)[2, 32:64].nonzero().flatten().tolist() == [31]


def test_masks_for_some_rows_only():
    g = torch.Generator().manual_seed(1)
    vocab = 70
    logits = torch.randn(4, vocab, generator=g)
    masks = torch.randint(-(2**31), 2**31, (2, 3), dtype=torch.int64, generator=g).to(torch.int32)
    full = torch.full((4, 3), -1, dtype=torch.int32)
    full[[1, 3]] = masks
    want = apply_token_bitmask(logits.clone(), full)
    got = apply_token_bitmask(logits.clone(), masks, torch.tensor([1, 3]))
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    allowed = reference(masks, vocab)
    assert torch.isinf(got[[1, 3]][~allowed]).all() and torch.equal(got[[1, 3]][allowed], logits[[1, 3]][allowed])
