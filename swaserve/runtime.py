"""Assembles what the engine runs on: the memory plan, pools, allocator, evictor, model runner and
scheduler, from a loaded model and the configs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from swaserve.config import CacheConfig, RunnerConfig, SchedulerConfig
from swaserve.distributed.state import tp_group
from swaserve.memory import (
    MemoryPlan,
    ReqToTokenPool,
    SWAEvictor,
    SWAKVPool,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    plan_memory,
)
from swaserve.model_config import KVGroup, ModelConfig
from swaserve.prefix_cache import RadixCache
from swaserve.prefix_cache.integrity import check_tree
from swaserve.runner.memory_budget import device_memory_gib, kv_budget_bytes
from swaserve.runner.piecewise_graph import PIECEWISE_MAX_TOKENS
from swaserve.scheduler.integrity import check_scheduler
from swaserve.scheduler.scheduler import Scheduler
from swaserve.sizing import PLAN_REQUEST_TOKENS, Sizing, graph_max_bs, resolve_running, resolve_step_tokens

if TYPE_CHECKING:
    from torch import nn


@dataclass
class Runtime:
    plan: MemoryPlan
    kv: SWAKVPool
    req_to_token: ReqToTokenPool
    allocator: SWATokenToKVPoolAllocator | TokenToKVPoolAllocator
    evictor: SWAEvictor | None
    runner: Any  # ModelRunner
    scheduler: Scheduler
    sizing: Sizing  # the scheduler config with every default resolved, and why each value

    @property
    def sched(self) -> SchedulerConfig:
        return self.sizing.sched


def rank_kv_config(config: ModelConfig) -> ModelConfig:
    """`config` with the K/V heads this tensor-parallel rank caches (`distributed.state.shard_heads`);
    unchanged at one rank."""
    tp = tp_group()
    if not tp.enabled:
        return config

    def local(group: KVGroup) -> KVGroup:
        heads = group.num_kv_heads // tp.size if group.num_kv_heads >= tp.size else 1
        return dataclasses.replace(group, num_kv_heads=heads)

    return dataclasses.replace(config, full_group=local(config.full_group), swa_group=local(config.swa_group))


def common_budget(budget: int) -> int:
    """The smallest rank's KV budget, so every rank plans the same pool sizes (the scheduler on rank 0
    hands out slots that must exist on every rank)."""
    tp = tp_group()
    if not tp.enabled:
        return budget
    t = torch.tensor([budget], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=tp.cpu_group)
    return int(t[0])


def size_runtime(config: ModelConfig, device: torch.device, dtype: torch.dtype, cache: CacheConfig,
                 sched: SchedulerConfig) -> tuple[MemoryPlan, Sizing]:
    """The memory plan and the scheduler config with its unset options chosen (`swaserve.sizing`) for
    this device's KV budget (the smallest rank's under tensor parallelism, so every rank agrees)."""
    kv_dtype, swa_kv_dtype = cache.kv_dtypes(dtype)
    ctx = config.max_context
    config = rank_kv_config(config)
    gib = device_memory_gib(device)
    sched, step_why = resolve_step_tokens(sched, device.type, gib)
    budget = common_budget(kv_budget_bytes(device, cache))

    def plan_for(budget_bytes: int) -> MemoryPlan:
        return plan_memory(
            budget_bytes,
            config.full_group,
            config.swa_group,
            kv_dtype,
            ctx,
            config.sliding_window,
            hybrid=not cache.disable_hybrid_swa,
            swa_full_tokens_ratio=cache.swa_full_tokens_ratio,
            evict_margin=cache.swa_evict_margin,
            evict_chunk=cache.swa_evict_chunk,
            prefill_chunk=sched.max_prefill_tokens,
            kv_shared_layers=len(config.kv_source),
            request_tokens=cache.plan_request_tokens or PLAN_REQUEST_TOKENS,
            swa_dtype=swa_kv_dtype,
        )

    plan = plan_for(budget)
    if cache.swa_kv_cache_dtype is not None and not plan.hybrid:
        raise ValueError(f"swa_kv_cache_dtype sets the sliding-window pool's dtype, and {config.architecture} has no "
                         "sliding-window pool (no sliding layers): use kv_cache_dtype")
    sched, running_why = resolve_running(sched, device.type, gib, plan)
    if cache.kv_cache_bytes is None and device.type == "cuda":
        # The request table comes out of the measured budget too.
        plan = plan_for(budget - ReqToTokenPool.nbytes(sched.max_running_requests + 1, ctx))
    if not plan.hybrid:
        split = "one pool for every layer"
    elif cache.swa_full_tokens_ratio is not None:
        split = f"SWA:full pool tokens {cache.swa_full_tokens_ratio} (given)"
    else:
        split = f"pools split for {plan.planned_request_tokens}-token requests"
    return plan, Sizing(sched, (running_why, step_why, split))


def build_runtime(
    config: ModelConfig,
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    cache: CacheConfig,
    sched: SchedulerConfig,
    runner_cfg: RunnerConfig,
    start: bool = True,
) -> Runtime:
    """Pools, allocator, runner and scheduler for `model`, with the scheduler options left unset chosen
    from the device and the plan (`Runtime.sizing`). `start=False` leaves graph capture and warm-up to
    the caller (`start_runner`), e.g. after a drafter has attached to the runtime."""
    from swaserve.runner.model_runner import ModelRunner

    ctx = config.max_context
    plan, sizing = size_runtime(config, device, dtype, cache, sched)
    sched = sizing.sched
    config = rank_kv_config(config)
    need = plan.swa_tokens_per_request + sched.max_prefill_tokens
    if plan.hybrid and plan.swa_tokens < need:
        raise ValueError(
            f"the SWA pool ({plan.swa_tokens} tokens) cannot hold one request's window plus a prefill chunk "
            f"({need} tokens): raise the KV budget or swa_full_tokens_ratio, or lower max_prefill_tokens"
        )
    check_kv_device(plan, device)
    table = ReqToTokenPool(sched.max_running_requests + 1, ctx, device)
    kv = SWAKVPool.build(config, plan.full_tokens, plan.swa_tokens, hybrid=plan.hybrid, dtype=plan.full_dtype,
                         device=device, swa_dtype=plan.swa_dtype)
    apply_kv_scales(kv, getattr(model, "kv_cache_scales", None) or {})
    evictor: SWAEvictor | None = None
    if plan.hybrid:
        allocator: Any = SWATokenToKVPoolAllocator(plan.full_tokens, plan.swa_tokens, device)
        evictor = SWAEvictor(allocator, table, config.sliding_window, cache.swa_evict_margin, cache.swa_evict_chunk)  # type: ignore[arg-type]
        full_to_swa = allocator.full_to_swa_device
    else:
        allocator = TokenToKVPoolAllocator(plan.full_tokens)
        full_to_swa = None
    runner = ModelRunner(config, model, kv, table, full_to_swa, device, dtype, attention_backend=runner_cfg.attention_backend,
                         deterministic=runner_cfg.enable_deterministic_inference)
    if plan.hybrid:  # the SWA mapping's device mirror written once a step, before the forward reads it
        allocator.defer_device = True
        runner.before_forward = allocator.sync_device
    # The tree checks SWA windows only where SWA K/V can be missing: in a hybrid SWA pool.
    prefix_cache = (None if cache.disable_prefix_cache
                    else RadixCache(allocator, config.sliding_window if plan.hybrid else None, check_tree))
    scheduler = Scheduler(sched, ctx, table, allocator, evictor, prefix_cache, check_scheduler)
    rt = Runtime(plan, kv, table, allocator, evictor, runner, scheduler, sizing)
    if start:
        start_runner(rt, runner_cfg)
    return rt


def check_kv_device(plan: MemoryPlan, device: torch.device) -> None:
    """An FP8 KV cache needs a GPU that converts e4m3 (compute capability 8.9+: Ada, Hopper): older ones
    are refused before any pool is allocated or kernel compiled."""
    fp8 = torch.float8_e4m3fn in (plan.full_dtype, plan.swa_dtype)
    if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(f"an FP8 KV cache needs a GPU of compute capability 8.9+ (Ada, Hopper), this one is {cap}: "
                         "use kv_cache_dtype auto")


def apply_kv_scales(kv: SWAKVPool, scales: dict[int, tuple[float, float]]) -> None:
    """A checkpoint's static FP8 KV scales (layer id -> (k_scale, v_scale)) into the FP8 pools; layers
    cached in the model dtype ignore theirs."""
    for layer_id, (k_scale, v_scale) in sorted(scales.items()):
        # A KV-shared layer reads its source's K/V, stored with the source's scales.
        if layer_id in kv.layer_ids and layer_id not in kv.kv_source and kv.kv_scales(layer_id) is not None:
            kv.set_kv_scales(layer_id, k_scale, v_scale)


def start_runner(rt: Runtime, runner_cfg: RunnerConfig, verify: tuple[int, int] | None = None) -> None:
    """Capture the decode graphs, the piecewise graphs of extend steps (and, with `verify` = (max
    batch, tokens per request), the speculative verify graphs) and warm the kernels up, before the
    first request."""
    runner, device, sched = rt.runner, rt.runner.device, rt.sched
    use_graphs = (device.type == "cuda" and not runner_cfg.disable_cuda_graph) or (
        device.type == "cpu" and runner_cfg.enable_cpu_graph
    )
    if use_graphs:
        runner.enable_decode_graphs(graph_max_bs(sched.max_running_requests))
        if verify is not None and device.type == "cuda" and not runner.deterministic:
            runner.enable_verify_graphs(min(verify[0], sched.max_running_requests), verify[1])
    piecewise = runner_cfg.enable_piecewise_cuda_graph
    if piecewise or (piecewise is None and use_graphs and device.type == "cuda"):
        mode = runner_cfg.extend_graph
        whole = mode == "whole" or (mode == "auto" and runner.attn_backend.captures_extend)
        runner.enable_piecewise_graphs(min(sched.max_prefill_tokens, PIECEWISE_MAX_TOKENS), whole=whole)
    if device.type == "cuda":
        runner.warmup()  # the prefill kernels' JIT compiles, before the first request
