"""Tensor parallelism on the embedded Gemma 3 270M (CPU, two gloo ranks, fp32): its single K/V head is
replicated, its 262k vocabulary split. Greedy tokens equal the one-rank engine's on a prompt longer
than the 512-token window (chunked), next to short ones, with out-of-window SWA freeing under way."""

from __future__ import annotations

import pytest

from swaserve import LLM, SamplingParams


@pytest.mark.slow
def test_embedded_tp2_greedy_equals_tp1(llm, long_ids):
    prompts = [long_ids[:700], "The capital of France is", long_ids[1000:1040]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(device="cpu", tensor_parallel_size=2, max_prefill_tokens=256) as tp:
        two = [o.outputs[0].token_ids for o in tp.generate(prompts, params)]
        tp.engine.check_integrity()
        assert tp.memory_stats()["full_tokens_used"] == 0
    assert two == one
