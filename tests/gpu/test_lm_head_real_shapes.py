"""The greedy LM head (`lm_head_argmax`, no logits in memory) natively on CUDA at Gemma 3's vocabulary
(262,144) and hidden sizes, both launch settings, against the argmax of the library GEMM's float32
logits; and `LMHead.greedy` against `LMHead.forward` with and without a final soft-cap."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from swaserve.kernels.lm_head_argmax import SMALL_M, lm_head_argmax
from swaserve.layers.embedding import LMHead, VocabEmbedding

pytestmark = pytest.mark.gpu
DEV = "cuda"
VOCAB = 262144


def _check(got: torch.Tensor, logits: torch.Tensor, where: str) -> None:
    """Same token as the reference argmax, or a near-tie of it (the two sum in different orders)."""
    want = logits.argmax(-1)
    best = logits.gather(1, want[:, None]).squeeze(1)
    picked = logits.gather(1, got[:, None]).squeeze(1)
    flips = got != want
    clear = flips & (best - picked > 1e-2 * (1 + best.abs()))
    assert not clear.any(), f"{where}: rows {clear.nonzero().flatten().tolist()} picked far from the best"
    assert flips.float().mean() < 0.05, f"{where}: {int(flips.sum())} of {len(got)} rows flipped"


@pytest.mark.parametrize("hidden", [1152, 2560])
@pytest.mark.parametrize("bs", [1, 7, SMALL_M, SMALL_M + 1, 256])
def test_greedy_head_matches_library_argmax(hidden, bs):
    g = torch.Generator(device=DEV).manual_seed(hidden + bs)
    w = torch.randn(VOCAB, hidden, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(bs, hidden, device=DEV, generator=g, dtype=torch.bfloat16)
    logits = torch.mm(x, w.t(), out_dtype=torch.float32)
    _check(lm_head_argmax(x, w), logits, f"hidden {hidden} bs {bs}")


def test_greedy_head_ties_and_last_tile():
    """Tied best rows in different vocab tiles give the lower index; the best token in the last tile
    (the vocab's end) is found."""
    hidden = 1152
    w = torch.randn(VOCAB, hidden, device=DEV, dtype=torch.bfloat16) * 0.02
    x = torch.randn(3, hidden, device=DEV, dtype=torch.bfloat16)
    w[1000] = w[200000] = x[0] * 0.1  # tied best of row 0 (identical bits: same dot product)
    w[VOCAB - 1] = x[1] * 0.1
    w[5] = w[6] = x[2] * 0.1  # tied, same tile
    for bs_pad in (0, SMALL_M):  # both launch settings
        xs = torch.cat([x, torch.zeros(bs_pad, hidden, device=DEV, dtype=x.dtype)])
        assert lm_head_argmax(xs, w)[:3].tolist() == [1000, VOCAB - 1, 5]


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_lm_head_greedy_matches_forward(softcap):
    torch.manual_seed(0)
    emb = VocabEmbedding(VOCAB, 640).to(DEV, torch.bfloat16)
    torch.nn.init.normal_(emb.weight, std=0.05)
    head = LMHead(VOCAB, 640, tied=True, final_softcap=softcap).to(DEV)
    hidden = torch.randn(40, 640, device=DEV, dtype=torch.bfloat16) * 8  # logits past the cap
    with torch.inference_mode():
        _check(head.greedy(hidden, emb), head(hidden, emb), f"softcap {softcap}")
