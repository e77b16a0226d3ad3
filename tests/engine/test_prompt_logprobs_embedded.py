"""Prompt logprobs on the embedded model under speculative decoding (prefill chunks of 8 tokens inside verify
steps), against the session engine's one-chunk prefill."""

from __future__ import annotations

import pytest

from swaserve import SamplingParams
from swaserve.engine import Engine

IDS = [2, 818, 8858, 5148, 13958, 13198, 1496, 506, 20743, 236761, 45808, 10454, 607, 9902, 532, 14541, 236764, 43651]


def _reference(llm) -> list:
    out = llm.generate([IDS], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return out.prompt_logprobs


@pytest.mark.slow  # an engine of its own (~15 s to load on 2 free cores)
def test_prompt_logprobs_in_verify_steps(llm) -> None:
    ref = _reference(llm)
    e = Engine(None, device="cpu", max_context=256, max_prefill_tokens=8, speculative_method="ngram")
    rep = e.tokenizer.encode("a b c a b c a b c a b c a b c a b c")
    e.add_request("r", rep, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for _ in range(5):  # the repeating request is drafting before the scored one arrives
        e.step()
    e.add_request("p", IDS, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0))
    outs, kinds = {}, []
    while e.has_unfinished():
        outs.update((o.request_id, o) for o in e.step())
        kinds.append(e.last_step[0] if e.last_step else None)
    assert "verify" in kinds[:3] and e.counters()["spec_draft_tokens_total"] > 0
    got = outs["p"].prompt_logprobs
    assert got[0] is None and len(got) == len(IDS) and e.counters()["prompt_logprob_tokens_total"] == len(IDS) - 1
    assert max(abs(got[j][IDS[j]] - ref[j][IDS[j]]) for j in range(1, len(IDS))) < 2e-3
    e.close()

