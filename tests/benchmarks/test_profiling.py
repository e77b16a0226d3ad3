"""benchmarks/profiling.py: the per-step breakdown of a profiled decode step (kernel time by part of the
step, the device's busy time as the union of kernel intervals), on hand-made kernel events."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from profiling import kernel_kind, step_breakdown  # noqa: E402


def _k(name: str, ts: float, dur: float) -> dict:
    return {"name": name, "ts": ts, "dur": dur, "cat": "kernel"}


def test_kernels_are_sorted_into_parts_of_the_step():
    assert kernel_kind("void (anonymous namespace)::one_shot_all_reduce_kernel<...>") == "all-reduce"
    assert kernel_kind("ncclDevKernel_AllGather_RING_LL") == "all-reduce"
    assert kernel_kind("_moe_gemm_kernel") == "moe"
    assert kernel_kind("_decode_stage1") == "other"  # attention's kernel names vary: the rest
    assert kernel_kind("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_TNT") == "gemm"
    assert kernel_kind("_rms_norm_kernel") == "norm/rope/act"


def test_busy_time_is_the_union_of_kernel_intervals():
    # two steps: overlapping kernels count once, the gap between them is idle
    events = [_k("_moe_gemm_kernel", 0, 10), _k("nvjet_gemm", 5, 10), _k("one_shot_all_reduce", 30, 5),
              _k("_moe_gemm_kernel", 100, 20)]
    text = step_breakdown(events, steps=2, wall_s=100e-6)
    first = text.splitlines()[0]
    assert "wall 50 us" in first and "device busy 20 us (40%)" in first and "kernels 2" in first
    parts = {line.split()[0]: float(line.split()[-2]) for line in text.splitlines()[1:]}
    assert parts == {"moe": 15.0, "gemm": 5.0, "all-reduce": 2.0}  # per step: (10 + 20) / 2, 10 / 2, 5 / 2
    assert step_breakdown([], 1, 1.0) == "no kernel events recorded"
