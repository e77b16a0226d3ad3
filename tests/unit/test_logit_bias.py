"""logit_bias in SamplingParams and the Sampler: validation, greedy rows forced and banned, per-row biases in a
mixed batch, the batch no longer plain greedy, and logprobs of the biased distribution."""

from __future__ import annotations

import pytest
import torch

from swaserve.request import SamplingParams
from swaserve.runner.sampler import Sampler
from swaserve.runner.sampling_batch import SamplingBatch, is_plain_greedy

V = 50


def _sample(params: list[SamplingParams], logits: torch.Tensor):
    sb = SamplingBatch.build(params, [[] for _ in params], [[] for _ in params], V, "cpu")
    return Sampler()(logits, sb), sb


@pytest.mark.parametrize("bias,match", [
    ({-1: 1}, "non-negative"), ({True: 1}, "non-negative"), ({"3": 1}, "non-negative"),
    ({3: 100.5}, r"\[-100, 100\]"), ({3: float("nan")}, "finite"), ({3: "1"}, "number"), ([3], "dict"),
])
def test_bad_logit_bias_is_a_value_error(bias, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


def test_greedy_rows_forced_banned_and_untouched() -> None:
    logits = torch.randn(3, V)
    best = logits.argmax(-1)
    force = SamplingParams(temperature=0, logit_bias={7: 100})
    ban = SamplingParams(temperature=0, logit_bias={int(best[1]): -100})
    plain = SamplingParams(temperature=0)
    assert not is_plain_greedy([force]) and is_plain_greedy([plain]) and SamplingParams(logit_bias={}).logit_bias is None
    out, _ = _sample([force, ban, plain], logits.clone())
    assert out.next_token_ids[0] == 7 and out.next_token_ids[1] != best[1] and out.next_token_ids[2] == best[2]


def test_sampled_rows_and_logprobs_see_the_bias() -> None:
    logits = torch.zeros(2, V)
    p = SamplingParams(temperature=1.0, seed=1, logprobs=1, logit_bias={3: 100, 4: -100})
    out, sb = _sample([p, SamplingParams(temperature=1.0, seed=1, logprobs=1)], logits.clone())
    assert out.next_token_ids[0] == 3 and sb.logit_bias is not None
    lp = out.logprob_dicts([1, 1])
    assert lp[0][3] > -1e-3  # the biased token holds nearly all the mass
    assert abs(lp[1][int(out.next_token_ids[1])] + torch.log(torch.tensor(float(V))).item()) < 1e-4
