"""Speculative verify steps through captured CUDA graphs (`VerifyGraphRunner`) against the eager extend
path, on tiny random models of three families (dense Gemma 3; Gemma 4 MoE: KV-shared layers and per-pool
K/V shapes; GPT-OSS as released: sinks, MXFP4 experts; its SwiGLU clamp is 7.0 where transformers
hard-codes it, as the GPU machine's 5.17 does): the batch shrinks and grows across replays, rows carry 0..K
drafts, free slots and slot 0 are poisoned. fp32: same tokens, hidden states and live K/V (tight
tolerance) at every step; bf16: the same checks up to the first step where a near-tie flips a token
between the two GEMM shapes (reported). Bit-identical steps are counted and recorded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from engine_driver import record  # noqa: E402
from test_verify_graph_padding import run_lockstep  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["gemma3", "gemma4_moe", "gpt_oss_mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_graphs_match_eager(tmp_path, family, dtype):
    fp32 = dtype is torch.float32
    stats = run_lockstep(family, tmp_path, "cuda", dtype, tol=1e-4 if fp32 else 5e-2, same_tokens=fp32)
    record({"test": "verify_graph_padding", **stats})
    assert stats["verify_replays"] > 0
