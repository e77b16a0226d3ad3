"""Speculative decoding under tensor parallelism (CPU, two gloo ranks, fp32): rank 0 drafts alone with
the whole drafter (`speculative.setup.RankZeroDrafter`) and every rank verifies. Greedy tokens with the
n-gram drafter and with a draft model equal the TP=2 engine's without speculation; EAGLE-3 (sharing the
target's embedding, gathered whole from the ranks) and MiMo-V2's MTP layer (sharing its embedding and LM
head) propose exactly what a plain-torch reference of the head proposes, losslessly; Gemma 4's
assistant, which reads the target's sharded KV cache, is refused before any rank starts."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from families import FP8_FAMILIES, make_hf_model
from scheduled import greedy_tokens
from test_eagle3_tiny import eagle3_run
from test_mimo_mtp_tiny import mtp_run

from swaserve.engine import Engine

OPTIONS = {"max_prefill_tokens": 16, "max_running_requests": 4, "max_context": 160, "kv_cache_bytes": 4 << 20}


def run(path: str, prompts: list[list[int]], **spec) -> tuple[dict[str, list[int]], dict[str, int]]:
    with Engine(path, device="cpu", dtype="float32", tensor_parallel_size=2, **OPTIONS, **spec) as engine:
        out = greedy_tokens(engine, prompts, 20, engine.check_integrity)  # every rank's tables included
        stats = engine.memory_stats()
        assert stats["full_tokens_used"] == 0 and stats["swa_tokens_used"] == 0
        return out, engine.counters()


@pytest.mark.slow
def test_tp2_ngram_and_draft_model_are_lossless(tmp_path):
    hf = make_hf_model("gemma4_moe", tmp_path)  # K/V heads and expert widths split over the ranks
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(1, hf.config.vocab_size, (7,), generator=g).tolist()
    prompts = [motif * 5, torch.randint(1, hf.config.vocab_size, (30,), generator=g).tolist(), motif[:3] * 4]
    plain, _ = run(str(tmp_path), prompts)
    ngram, c = run(str(tmp_path), prompts, speculative_method="ngram", speculative_num_tokens=3)
    assert ngram == plain
    assert c["spec_draft_tokens_total"] > 0
    # The target drafts for itself: every draft is accepted, so verify steps append K + 1 tokens.
    draft, c = run(str(tmp_path), prompts, speculative_method="draft", speculative_draft_model=str(tmp_path),
                   speculative_num_tokens=4)
    assert draft == plain
    assert c["spec_draft_tokens_total"] > 20 and c["spec_accepted_tokens_total"] == c["spec_draft_tokens_total"]


@pytest.mark.slow
def test_tp2_eagle3_drafts_match_reference_and_are_lossless(tmp_path):
    agree, total = eagle3_run("llama", tmp_path, tp=2)  # the head reads the target's embedding
    assert agree == total, f"{agree}/{total} proposals equal the reference"


@pytest.mark.slow
def test_tp2_mimo_mtp_drafts_match_reference_and_are_lossless(tmp_path):
    agree, total = mtp_run(tmp_path, "cpu", tp=2)
    assert agree == total, f"{agree}/{total} proposals equal the reference"


@pytest.mark.slow
def test_tp2_fp8_mimo_mtp_drafts_match_reference_and_are_lossless(tmp_path, monkeypatch):
    # Two ranks cut the dense first-layer MLP (256 wide here) on 128-input FP8 blocks; the experts, whose
    # 24-wide FP8 blocks cannot be cut, are split whole (expert parallelism). Rank 0's MTP head is whole.
    make_config, cls = FP8_FAMILIES["mimo_v2_flash_fp8"]

    def wider():
        config = make_config()
        config.intermediate_size = 256
        return config

    monkeypatch.setitem(FP8_FAMILIES, "mimo_v2_flash_fp8", (wider, cls))
    agree, total = mtp_run(tmp_path, "cpu", tp=2, family="mimo_v2_flash_fp8", enable_expert_parallel=True)
    assert agree == total, f"{agree}/{total} proposals equal the reference"


def test_tp2_frozen_kv_assistant_is_refused_before_any_rank_starts(tmp_path):
    make_hf_model("gemma4", tmp_path)
    with pytest.raises(ValueError, match="reads the target's KV cache"):
        Engine(str(tmp_path), device="cpu", load_format="dummy", tensor_parallel_size=2,
               speculative_method="mtp", speculative_draft_model=str(tmp_path))
    assert not multiprocessing.active_children(), "a refused configuration started a rank"
