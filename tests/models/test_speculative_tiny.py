"""Speculative decoding on tiny random models: greedy tokens identical to plain decoding for the n-gram
drafter and for a draft model (here the target itself), prompts crossing the 8-12 token windows,
batched, prefill chunked; a self-draft accepts every drafted token; integrity after every step and
both pools (and the draft model's) empty at the end."""

from __future__ import annotations

import pytest
import torch
from families import make_hf_model
from scheduled import greedy_tokens

from swaserve.engine import Engine

OPTIONS = {"max_prefill_tokens": 16, "max_running_requests": 4, "max_context": 160, "kv_cache_bytes": 4 << 20}


def run(path: str, prompts: list[list[int]], steps: int, **spec) -> tuple[dict[str, list[int]], Engine]:
    engine = Engine(path, device="cpu", dtype="float32", **OPTIONS, **spec)
    drafter = engine.scheduler.speculation.drafter if engine.scheduler.speculation else None

    def check() -> None:
        engine.check_integrity()
        if hasattr(drafter, "check_integrity"):
            drafter.check_integrity()

    out = greedy_tokens(engine, prompts, steps, check)
    stats = engine.memory_stats()
    assert stats["full_tokens_used"] == 0 and stats["swa_tokens_used"] == 0
    return out, engine


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "gemma4_moe", "mistral"])
def test_speculation_is_lossless(family, tmp_path):
    hf = make_hf_model(family, tmp_path)
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(1, hf.config.vocab_size, (7,), generator=g).tolist()
    prompts = [motif * 5, torch.randint(1, hf.config.vocab_size, (30,), generator=g).tolist(), motif[:3] * 4]
    plain, _ = run(str(tmp_path), prompts, 20)
    ngram, eng = run(str(tmp_path), prompts, 20, speculative_method="ngram", speculative_num_tokens=3)
    assert ngram == plain
    assert eng.counters()["spec_draft_tokens_total"] > 0
    draft, eng = run(str(tmp_path), prompts, 20, speculative_method="draft", speculative_draft_model=str(tmp_path),
                     speculative_num_tokens=4)
    assert draft == plain
    c = eng.counters()
    assert c["spec_draft_tokens_total"] > 20 and c["spec_accepted_tokens_total"] == c["spec_draft_tokens_total"]
    assert not eng.scheduler.speculation.drafter.seqs, "the drafter forgets finished sequences"
