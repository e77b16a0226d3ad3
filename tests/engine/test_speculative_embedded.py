"""Speculative decoding on the embedded Gemma 3 270M (CPU, fp32): the n-gram drafter gives exactly the
plain greedy tokens on a prompt longer than the 512-token window (chunked prefill), a copy-heavy prompt
and a short one, batched, and accepts a real share of its drafts on copy-heavy text; seeded sampling
repeats; the pools are empty afterwards."""

from __future__ import annotations

import pytest

from swaserve import LLM, SamplingParams

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"


@pytest.fixture(scope="module")
def spec_llm():
    with LLM(device="cpu", speculative_method="ngram", speculative_num_tokens=4, max_prefill_tokens=256) as llm:
        yield llm


@pytest.mark.slow
def test_ngram_greedy_equals_plain_and_accepts_on_copy_heavy_text(llm, spec_llm, long_ids):
    prompts = [long_ids[:700], CODE * 4 + "def div(a, b):", "The capital of France is"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    before = spec_llm.stats()
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    assert spec == plain
    after = spec_llm.stats()
    drafted = after["spec_draft_tokens_total"] - before["spec_draft_tokens_total"]
    accepted = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    assert drafted > 0 and accepted / drafted > 0.3, (accepted, drafted)
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 3 * 32
    spec_llm.engine.check_integrity()
    assert after["full_tokens_used"] == 0 and after["swa_tokens_used"] == 0


@pytest.mark.slow
def test_seeded_sampling_with_speculation_repeats(spec_llm):
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    a = spec_llm.generate([CODE * 2], params)[0].outputs[0].token_ids
    b = spec_llm.generate([CODE * 2], params)[0].outputs[0].token_ids
    assert a == b and len(a) == 24
