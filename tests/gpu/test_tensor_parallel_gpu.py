"""Tensor parallelism on two GPUs (NCCL, one rank process per GPU), fp32: the same greedy tokens at TP=2
as at TP=1, with the Triton backend, decode CUDA graphs with padded rows, piecewise graphs and overlap
scheduling, on the Gemma 4 MoE form (K/V heads sharded on sliding layers, one K = V head copied on the
full ones, expert widths split). Every rank's tables equal rank 0's after every step; both pools end
empty. One TP engine per process (`scripts/gpu_check.py` runs each file in its own)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny HF families
from families import make_hf_model  # noqa: E402
from scheduled import greedy_tokens  # noqa: E402

from swaserve.engine import Engine  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
PROMPT_LENS = (23, 9, 40, 17, 3)
OPTIONS = {"max_prefill_tokens": 16, "max_running_requests": 8, "max_context": 128, "kv_cache_bytes": 8 << 20}


def generate(path: str, prompts: list[list[int]], tp: int) -> dict[str, list[int]]:
    engine = Engine(path, device="cuda", dtype="float32", tensor_parallel_size=tp, **OPTIONS)
    try:
        out = greedy_tokens(engine, prompts, 12, engine.check_integrity)
        stats = engine.memory_stats()
        assert stats["full_tokens_used"] == 0 and stats["swa_tokens_used"] == 0
        return out
    finally:
        engine.close()


def test_tp2_tokens_equal_tp1_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    hf = make_hf_model("gemma4_moe", tmp_path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    one = generate(str(tmp_path), prompts, 1)
    two = generate(str(tmp_path), prompts, 2)
    assert sorted(one) == [str(i) for i in range(len(prompts))]
    assert two == one
