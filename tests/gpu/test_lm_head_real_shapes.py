"""The LM head's greedy and sampling paths (`lm_head_argmax`, no logits in memory) natively on CUDA at
Gemma 3's vocabulary (262,144) and hidden sizes, both launch settings, against the argmax of the
library GEMM's float32 logits; `LMHead.greedy` against `LMHead.forward` with and without a final
soft-cap; and the head's draws against the Sampler's on the same seeds."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import numpy as np

from swaserve.kernels.lm_head_argmax import SMALL_M, gumbel_noise, gumbel_noise_ref, lm_head_argmax
from swaserve.layers.embedding import LMHead, VocabEmbedding
from swaserve.request import SamplingParams
from swaserve.runner.sampler import Sampler
from swaserve.runner.sampling_batch import SamplingBatch

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


@pytest.mark.parametrize("bs", [7, 256])
def test_masked_greedy_head_matches_masked_logits(bs):
    """Structured outputs' greedy rows at Gemma's vocabulary: the fused head with bitmasks (every other row
    constrained, a third of the tokens allowed) against the argmax of the logits with the rest at -inf."""
    from swaserve.runner.token_mask import apply_token_bitmask

    hidden = 1152
    g = torch.Generator(device=DEV).manual_seed(bs)
    w = torch.randn(VOCAB, hidden, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(bs, hidden, device=DEV, generator=g, dtype=torch.bfloat16)
    rows = torch.arange(0, bs, 2, device=DEV)
    masks = torch.randint(-2**31, 2**31 - 1, (rows.numel(), VOCAB // 32), device=DEV, generator=g, dtype=torch.int32)
    masks &= torch.randint(-2**31, 2**31 - 1, masks.shape, device=DEV, generator=g, dtype=torch.int32)
    index = torch.full((bs,), -1, dtype=torch.int32, device=DEV)
    index[rows] = torch.arange(rows.numel(), dtype=torch.int32, device=DEV)
    logits = apply_token_bitmask(torch.mm(x, w.t(), out_dtype=torch.float32), masks, rows)
    _check(lm_head_argmax(x, w, allowed=masks, allowed_index=index), logits, f"masked bs {bs}")


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


def test_noise_matches_numpy_reference():
    seeds = torch.tensor([0, 1, 12345, (1 << 63) - 1, 1 << 62], dtype=torch.int64)
    got = gumbel_noise(seeds.to(DEV), VOCAB).cpu()
    want = torch.from_numpy(gumbel_noise_ref(seeds.numpy(), np.arange(VOCAB)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.max() < 23.5 and torch.isfinite(got).all()


@pytest.mark.parametrize("bs", [5, SMALL_M + 9])
def test_head_draws_are_the_samplers_draws(bs):
    """A batch of temperature-only rows (the head samples) and the same rows next to a top-p row
    (the Sampler draws from the logits) give each seeded row the same token, up to rounding near
    a tie; the flags route them that way."""
    hidden = 1152
    g = torch.Generator(device=DEV).manual_seed(bs)
    w = torch.randn(VOCAB, hidden, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(bs + 1, hidden, device=DEV, generator=g, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.5 + 0.1 * i, seed=100 + i) if i % 4 else SamplingParams(temperature=0)
              for i in range(bs)]
    alone = SamplingBatch.build(params, [[]] * bs, [[]] * bs, VOCAB, DEV)
    mixed = SamplingBatch.build([*params, SamplingParams(temperature=1.0, top_p=0.9)], [[]] * (bs + 1),
                                [[]] * (bs + 1), VOCAB, DEV)
    assert alone.inv_temperatures is not None and mixed.inv_temperatures is None and mixed.seeds is not None
    assert torch.equal(alone.seeds[alone.inv_temperatures > 0], mixed.seeds[:bs][alone.inv_temperatures > 0])
    head = lm_head_argmax(x[:bs], w, None, alone.inv_temperatures, alone.seeds)
    logits = torch.mm(x, w.t(), out_dtype=torch.float32)
    sampler = Sampler()(logits, mixed).next_token_ids[:bs]
    inv_t = alone.inv_temperatures[:, None]
    scores = torch.where(inv_t > 0, logits[:bs] * inv_t + gumbel_noise(alone.seeds, VOCAB), logits[:bs])
    _check(head, scores, f"head bs {bs}")
    _check(sampler, scores, f"sampler bs {bs}")
    assert (head != sampler).float().mean() < 0.05


@pytest.mark.parametrize("bs", [6, SMALL_M + 9])
def test_masked_head_draws_are_the_samplers_masked_draws(bs):
    """Structured outputs with temperature sampling: `LMHead.sample` with bitmasks on every other row (a
    third of the tokens allowed) draws each seeded row the token the Sampler draws from the masked logits
    on the same seeds (up to rounding near a tie), and only tokens the row's mask allows."""
    from swaserve.runner.token_mask import allowed_tokens, apply_token_bitmask

    hidden = 640
    g = torch.Generator(device=DEV).manual_seed(bs)
    emb = VocabEmbedding(VOCAB, hidden).to(DEV, torch.bfloat16)
    emb.weight.data.copy_(torch.randn(VOCAB, hidden, device=DEV, generator=g) * 0.02)
    head = LMHead(VOCAB, hidden, tied=True).to(DEV)
    x = torch.randn(bs, hidden, device=DEV, generator=g, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.5 + 0.1 * i, seed=100 + i) if i % 3 else SamplingParams(temperature=0)
              for i in range(bs)]
    sb = SamplingBatch.build(params, [[]] * bs, [[]] * bs, VOCAB, DEV)
    assert sb.inv_temperatures is not None
    rows = torch.arange(0, bs, 2, device=DEV)
    masks = torch.randint(-2**31, 2**31 - 1, (rows.numel(), VOCAB // 32), device=DEV, generator=g, dtype=torch.int32)
    masks &= torch.randint(-2**31, 2**31 - 1, masks.shape, device=DEV, generator=g, dtype=torch.int32)
    with torch.inference_mode():
        drawn = head.sample(x, emb, sb.inv_temperatures, sb.seeds, (masks, rows))
        logits = apply_token_bitmask(head(x, emb), masks, rows)
        sampler = Sampler()(logits.clone(), sb).next_token_ids
    inv_t = sb.inv_temperatures[:, None]
    scores = torch.where(inv_t > 0, logits * inv_t + gumbel_noise(sb.seeds, VOCAB), logits)
    _check(drawn, scores, f"masked head bs {bs}")
    _check(sampler, scores, f"masked sampler bs {bs}")
    allowed = allowed_tokens(masks, VOCAB)
    assert allowed[torch.arange(rows.numel(), device=DEV), drawn[rows]].all(), "a disallowed token"
