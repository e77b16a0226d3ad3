"""Engine defaults sized from the device and the memory plan: the step token budget, the running-request
limit and the largest decode batch captured as a CUDA graph (rules and measurements: docs/defaults.md).
Options the user gave are kept as given; only the ones left unset (None) are chosen here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from swaserve.config import SchedulerConfig
from swaserve.memory.planner import MemoryPlan

# CPU: a small machine (CI's has 2 cores); these are the defaults every CPU test and doc example assumes.
CPU_MAX_RUNNING = 64
CPU_STEP_TOKENS = 2048
# CUDA, by the device's memory: (at least GiB, running-request cap, step token budget).
GPU_TIERS = ((70, 1024, 8192), (35, 512, 4096), (0, 256, 2048))
# The full:SWA pool split is sized for requests of this many tokens (prompt + output), or the max
# context where that is shorter (`--plan-request-tokens` overrides): sizing it for max-context requests
# (128k-256k tokens on recent models) left the SWA pool room for few typical requests.
PLAN_REQUEST_TOKENS = 4096
# The running limit is at most the requests of this many tokens the pools hold: beyond it, admission
# would only be cut short by memory (and retraction) anyway.
SHORT_REQUEST_TOKENS = 512
# Decode CUDA graphs are captured up to the running limit, at most this batch (eager above it).
MAX_GRAPH_BS = 1024


@dataclass(frozen=True)
class Sizing:
    """What was chosen and why: the resolved scheduler config and one line per choice."""

    sched: SchedulerConfig
    reasons: tuple[str, ...]

    def line(self) -> str:
        return "; ".join(self.reasons)


def gpu_tier(total_gib: float) -> tuple[int, int]:
    """(running-request cap, step token budget) for a GPU with `total_gib` of memory."""
    for at_least, cap, step in GPU_TIERS:
        if total_gib >= at_least:
            return cap, step
    raise AssertionError("the last tier starts at 0 GiB")


def resolve_step_tokens(sched: SchedulerConfig, device_type: str, total_gib: float | None) -> tuple[SchedulerConfig, str]:
    """The step token budget (`max_prefill_tokens`): the device's tier on CUDA, 2048 on CPU."""
    if sched.max_prefill_tokens is not None:
        return sched, f"step budget {sched.max_prefill_tokens} tokens (given)"
    if device_type == "cuda" and total_gib is not None:
        step = gpu_tier(total_gib)[1]
        why = f"{total_gib:.0f} GiB GPU"
    else:
        step, why = CPU_STEP_TOKENS, "CPU"
    return dataclasses.replace(sched, max_prefill_tokens=step), f"step budget {step} tokens ({why})"


def resolve_running(sched: SchedulerConfig, device_type: str, total_gib: float | None,
                    plan: MemoryPlan) -> tuple[SchedulerConfig, str]:
    """The running-request limit: on CUDA, as many requests of SHORT_REQUEST_TOKENS as the pools hold
    (what memory would allow anyway), capped by the device's tier and rounded down to a multiple of 16;
    64 on CPU."""
    if sched.max_running_requests is not None:
        return sched, f"running limit {sched.max_running_requests} (given)"
    if device_type != "cuda" or total_gib is None:
        n, why = CPU_MAX_RUNNING, "CPU"
    else:
        cap = gpu_tier(total_gib)[0]
        fit = plan.max_concurrent_requests(min(SHORT_REQUEST_TOKENS, plan.max_context))
        n = max(16, min(cap, fit) // 16 * 16)
        why = (f"the pools hold {fit} requests of {SHORT_REQUEST_TOKENS} tokens" if fit < cap
               else f"the {total_gib:.0f} GiB tier's cap; the pools hold {fit} requests of {SHORT_REQUEST_TOKENS} tokens")
    return dataclasses.replace(sched, max_running_requests=n), f"running limit {n} ({why})"


def graph_max_bs(max_running: int) -> int:
    """The largest decode batch captured: the running limit, at most MAX_GRAPH_BS."""
    return min(max_running, MAX_GRAPH_BS)
