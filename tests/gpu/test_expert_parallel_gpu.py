"""Expert parallelism on two GPUs (NCCL, one rank process per GPU), fp32: Gemma-4-26B-A4B's real shape
(128 experts of width 704, top 8, beside a dense MLP; 262k vocabulary) cut to three layers (two sliding,
one full), random weights from `--load-format dummy` (the same whole tensors whatever the layout): the
same greedy tokens with `--tp 2 --enable-expert-parallel` as on one GPU, with the Triton backend, decode
CUDA graphs with padded rows and piecewise graphs (the fused MoE's expert_start path in the kernels and in
the graphs), top-5 logprobs within float rounding, every rank's tables equal to rank 0's after every
step, rank 0 holding 64 of the 128 experts. One TP engine per process (`scripts/gpu_check.py` runs each
file in its own)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from common import gemma4_hf_config  # noqa: E402
from test_expert_parallel import greedy_top5  # noqa: E402

from swaserve.engine import Engine  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
PROMPT_LENS = (1100, 23, 9, 300, 40, 3)  # the first crosses the 1024-token window, in prefill chunks
STEPS = 16
OPTIONS = {"max_prefill_tokens": 256, "max_running_requests": 8, "max_context": 2048,
           "kv_cache_bytes": 512 << 20, "load_format": "dummy"}


def run(path: str, prompts: list[list[int]], **parallel) -> tuple[dict, list]:
    """Each request's (tokens, top-5 logprobs per token) and rank 0's expert modules' held counts."""
    with Engine(path, device="cuda", dtype="float32", **OPTIONS, **parallel) as engine:
        out = greedy_top5(engine, prompts, STEPS)
        held = [m.gate_up_proj.shape[0] for m in engine.runner.model.modules() if hasattr(m, "expert_split")]
        return out, held


def test_ep2_tokens_equal_tp1_on_the_26b_a4b_shape(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    gemma4_hf_config("26b-a4b", max_positions=4096, num_layers=3).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(10, 200000, (n,), generator=g).tolist() for n in PROMPT_LENS]
    one, whole = run(str(tmp_path), prompts)
    two, held = run(str(tmp_path), prompts, tensor_parallel_size=2, enable_expert_parallel=True)
    assert whole == [128] * 3 and held == [64] * 3
    assert sorted(one) == [str(i) for i in range(len(prompts))]
    for rid in one:
        assert two[rid][0] == one[rid][0], f"request {rid}: tokens differ"
        for step, (a, b) in enumerate(zip(one[rid][1], two[rid][1])):
            assert a.keys() == b.keys(), f"request {rid} step {step}: top-5 differs"
            for tok in a:
                assert abs(a[tok] - b[tok]) < 1e-3, (rid, step, tok, a[tok], b[tok])
