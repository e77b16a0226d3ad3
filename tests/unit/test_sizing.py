"""Engine defaults sized from the device and the memory plan (`swaserve.sizing`): the step budget and the
running-request limit follow the documented rule, given values are kept, the pool split is sized for
the planned request length, and every decode batch the engine runs has a captured graph."""

from __future__ import annotations

import pytest
import torch

from swaserve.config import SchedulerConfig
from swaserve.memory.planner import plan_memory
from swaserve.model_config import KVGroup
from swaserve.runner.graph_buffers import capture_batch_sizes, padded_batch_size
from swaserve.sizing import (
    CPU_MAX_RUNNING,
    CPU_STEP_TOKENS,
    GPU_TIERS,
    SHORT_REQUEST_TOKENS,
    gpu_tier,
    graph_max_bs,
    resolve_running,
    resolve_step_tokens,
)

# Gemma-3-1B's K/V: 4 full and 22 sliding layers of one 256-wide head; window 512.
FULL_1B = KVGroup(tuple(range(4)), 1, 256, 256)
SWA_1B = KVGroup(tuple(range(4, 26)), 1, 256, 256)
# Gemma-4-26B-A4B's: 5 full layers of 2 heads x 512, 25 sliding of 8 x 256; window 1024.
FULL_G4 = KVGroup(tuple(range(5)), 2, 512, 512)
SWA_G4 = KVGroup(tuple(range(5, 30)), 8, 256, 256)


def plan(budget_gib: float, full: KVGroup, swa: KVGroup, ctx: int, window: int, request_tokens: int | None = 4096,
         step: int = 8192):
    return plan_memory(int(budget_gib * (1 << 30)), full, swa, torch.bfloat16, ctx, window, prefill_chunk=step,
                       request_tokens=request_tokens)


def test_cpu_keeps_the_small_machine_defaults():
    sched, why = resolve_step_tokens(SchedulerConfig(), "cpu", None)
    assert sched.max_prefill_tokens == CPU_STEP_TOKENS == 2048 and "CPU" in why
    p = plan(0.5, FULL_1B, SWA_1B, 4096, 512, step=2048)
    sched, why = resolve_running(sched, "cpu", None, p)
    assert sched.max_running_requests == CPU_MAX_RUNNING == 64 and "CPU" in why


@pytest.mark.parametrize(("gib", "cap", "step"), [(79.2, 1024, 8192), (139.8, 1024, 8192), (47.5, 512, 4096),
                                                  (23.6, 256, 2048)])
def test_gpu_tiers(gib, cap, step):
    assert gpu_tier(gib) == (cap, step)
    sched, why = resolve_step_tokens(SchedulerConfig(), "cuda", gib)
    assert sched.max_prefill_tokens == step and f"{gib:.0f} GiB GPU" in why
    assert [t[0] for t in GPU_TIERS] == sorted((t[0] for t in GPU_TIERS), reverse=True)


def test_given_values_are_kept_whatever_the_device():
    given = SchedulerConfig(max_running_requests=7, max_prefill_tokens=300)
    for device, gib in (("cuda", 79.2), ("cpu", None)):
        sched, why = resolve_step_tokens(given, device, gib)
        assert sched.max_prefill_tokens == 300 and "given" in why
        sched, why = resolve_running(sched, device, gib, plan(60, FULL_1B, SWA_1B, 32768, 512))
        assert sched.max_running_requests == 7 and "given" in why


def test_a_small_model_on_a_big_gpu_runs_the_tiers_cap():
    """Gemma-3-1B with ~60 GiB of KV holds thousands of 512-token requests: the 80 GiB tier's cap."""
    p = plan(60, FULL_1B, SWA_1B, 32768, 512)
    assert p.max_concurrent_requests(SHORT_REQUEST_TOKENS) > 1024
    sched, why = resolve_running(SchedulerConfig(), "cuda", 79.2, p)
    assert sched.max_running_requests == 1024 and "cap" in why


def test_a_large_model_runs_what_its_pools_hold():
    """Gemma-4-26B-A4B next to 52 GB of weights: ~22 GiB of KV; its wide sliding layers make the SWA
    pool the limit. The running limit is what the pools hold at 512 tokens, a multiple of 16."""
    p = plan(22, FULL_G4, SWA_G4, 262144, 1024)
    fit = p.max_concurrent_requests(SHORT_REQUEST_TOKENS)
    sched, why = resolve_running(SchedulerConfig(max_prefill_tokens=8192), "cuda", 79.2, p)
    n = sched.max_running_requests
    assert n == fit // 16 * 16 and 16 <= n < 1024 and f"the pools hold {fit}" in why


def test_the_split_is_sized_for_the_planned_request_length():
    """Requests of the planned length fill both pools together (within a prefill chunk of headroom);
    sized for max-context requests (256k tokens), the SWA pool held a few dozen typical requests."""
    for request_tokens in (2048, 4096, 16384):
        p = plan(22, FULL_G4, SWA_G4, 262144, 1024, request_tokens=request_tokens, step=0)
        by_full = p.full_tokens // request_tokens
        by_swa = p.swa_tokens // min(request_tokens, p.swa_tokens_per_request)
        assert abs(by_full - by_swa) <= 1, (request_tokens, by_full, by_swa)
        assert p.planned_request_tokens == request_tokens
    old = plan(22, FULL_G4, SWA_G4, 262144, 1024, request_tokens=None)
    new = plan(22, FULL_G4, SWA_G4, 262144, 1024)
    assert old.planned_request_tokens == 262144
    assert new.max_concurrent_requests(1536) > 2 * old.max_concurrent_requests(1536)
    # A context shorter than the planned length plans for the context: the split of old.
    short = plan(1, FULL_1B, SWA_1B, 2048, 512, request_tokens=4096)
    assert short.planned_request_tokens == 2048
    with pytest.raises(ValueError, match="request_tokens must be positive"):
        plan(1, FULL_1B, SWA_1B, 2048, 512, request_tokens=0)


@pytest.mark.parametrize("max_running", [1, 7, 64, 100, 256, 300, 512, 1000, 1024])
def test_every_batch_up_to_the_running_limit_has_a_graph_with_little_padding(max_running):
    sizes = capture_batch_sizes(graph_max_bs(max_running))
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_running
    for raw in range(1, max_running + 1):
        bs = padded_batch_size(raw, sizes)
        assert bs is not None and raw <= bs
        assert raw <= 64 or bs - raw < raw / 4
        assert raw <= 256 or bs - raw < raw / 8
    assert len(capture_batch_sizes(1024)) <= 39  # capture time stays small at the largest tier


def test_the_engine_states_what_it_chose_and_keeps_what_was_given(tmp_path):
    from transformers import Gemma3TextConfig

    from swaserve.engine import Engine

    Gemma3TextConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, sliding_window=8, max_position_embeddings=256,
                     layer_types=["sliding_attention", "full_attention"]).save_pretrained(tmp_path)
    e = Engine(str(tmp_path), device="cpu", load_format="dummy", kv_cache_bytes=1 << 20)
    assert (e.scheduler.config.max_running_requests, e.scheduler.config.max_prefill_tokens) == (64, 2048)
    line = e.startup_line()
    assert "running limit 64 (CPU)" in line and "step budget 2048 tokens (CPU)" in line
    assert "pools split for 256-token requests" in line and "KV cache hybrid" in line
    e = Engine(str(tmp_path), device="cpu", load_format="dummy", kv_cache_bytes=1 << 20, max_running_requests=5,
               max_prefill_tokens=100, plan_request_tokens=64)
    assert (e.scheduler.config.max_running_requests, e.scheduler.config.max_prefill_tokens) == (5, 100)
    assert e._runtime.req_to_token.max_reqs == 6  # the limit + 1 rows: the table is sized from the resolved limit
    assert "(given)" in e.startup_line() and "pools split for 64-token requests" in e.startup_line()
