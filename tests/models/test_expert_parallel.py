"""Expert parallelism end to end on CPU (gloo, two rank processes, fp32): `tensor_parallel_size=2,
enable_expert_parallel=True` gives the same greedy tokens as one rank, and top-5 logprobs within float
rounding (the ranks' partial sums associate differently), on tiny random models of each MoE form:
Gemma 4's stacked experts split unevenly (5 experts: 3 and 2), MiMo-V2-Flash's block-FP8 experts stored
one by one (each rank reads and keeps only its own), GPT-OSS's biased MXFP4 experts. Prompts cross the
window, prefill is chunked, requests batch; every rank's tables equal rank 0's after every step; rank
0 holds only its experts."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, make_hf_model

from swaserve.engine import Engine
from swaserve.request import SamplingParams

PROMPT_LENS = (23, 9, 40)
STEPS = 10
OPTIONS = {"max_prefill_tokens": 16, "max_running_requests": 4, "max_context": 128, "kv_cache_bytes": 4 << 20}


def greedy_top5(engine: Engine, prompts: list[list[int]], steps: int) -> dict[str, tuple[list[int], list[dict]]]:
    """Each request's (greedy tokens, top-5 logprobs per token), every rank's tables checked after every
    step; both pools empty at the end. (tests/gpu/test_expert_parallel_gpu.py drives its engines so too.)"""
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = (list(o.outputs[0].token_ids), list(o.outputs[0].logprobs))
        engine.check_integrity()  # every rank's tables included
    stats = engine.memory_stats()
    assert stats["full_tokens_used"] == 0 and stats["swa_tokens_used"] == 0
    return out


def run(path: str, prompts: list[list[int]], **parallel) -> tuple[dict[str, tuple[list[int], list[dict]]], list]:
    """Each request's (tokens, top-5 logprobs per token), and rank 0's expert modules."""
    with Engine(path, device="cpu", dtype="float32", **OPTIONS, **parallel) as engine:
        out = greedy_top5(engine, prompts, STEPS)
        experts = [m for m in engine.runner.model.modules() if hasattr(m, "expert_split")]
        return out, experts


# Changes to the families' tiny configs: 5 experts split 3 + 2; a dense first-layer MLP of 256, which two
# ranks cut on 128-input FP8 blocks (tensor parallelism still splits the dense MLPs).
CHANGES = {"gemma4_moe": {"num_experts": 5}, "mimo_v2_flash_fp8": {"intermediate_size": 256}}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma4_moe", "mimo_v2_flash_fp8", "gpt_oss_mxfp4"])
def test_ep2_tokens_equal_tp1(family, tmp_path, monkeypatch):
    from families import FP8_FAMILIES

    table = FP8_FAMILIES if family in FP8_FAMILIES else FAMILIES
    make_config, cls = table[family]

    def changed():
        config = make_config()
        for key, value in CHANGES.get(family, {}).items():
            setattr(config, key, value)
        return config

    monkeypatch.setitem(table, family, (changed, cls))
    hf = make_hf_model(family, tmp_path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    one, whole = run(str(tmp_path), prompts)
    two, held = run(str(tmp_path), prompts, tensor_parallel_size=2, enable_expert_parallel=True)
    assert sorted(one) == [str(i) for i in range(len(prompts))]
    for rid in one:
        assert two[rid][0] == one[rid][0], f"request {rid}: tokens differ"
        for step, (a, b) in enumerate(zip(one[rid][1], two[rid][1])):
            assert a.keys() == b.keys(), f"request {rid} step {step}: top-5 differs"
            for tok in a:
                assert abs(a[tok] - b[tok]) < 1e-4, (rid, step, tok, a[tok], b[tok])
    total = whole[0].expert_split.total
    assert all(m.expert_split.start == 0 and m.expert_split.count == -(-total // 2) for m in held)
    ours = sum(p.numel() for m in held for p in m.parameters() if p.dim() > 1)
    theirs = sum(p.numel() for m in whole for p in m.parameters() if p.dim() > 1)
    assert ours * total == theirs * held[0].expert_split.count, "rank 0 holds more than its experts"
