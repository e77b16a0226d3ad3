"""Where a step's GPU time goes, from a torch profiler trace: kernels by name and launch grid, and how
busy the device was over the profiled steps (kernel time against wall time: the rest is host time,
waits at collectives and gaps between launches)."""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path


def kernel_events(prof) -> list[dict]:
    """The trace's GPU kernel events (name, ts and dur in microseconds, args with the grid)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    return [e for e in events if e.get("cat") == "kernel"]


def by_launch_shape(prof, top: int = 14, events: list[dict] | None = None) -> str:
    """The kernels split by grid (one GEMM kernel serves every projection; the grid tells them apart):
    calls, mean and total microseconds."""
    groups = defaultdict(list)
    for e in kernel_events(prof) if events is None else events:
        groups[(e["name"][:48], tuple(e.get("args", {}).get("grid", ())))].append(e["dur"])
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    lines = [f"{'kernel':<48} {'grid':<16} {'calls':>6} {'mean us':>8} {'total us':>9}"]
    lines += [f"{k:<48} {list(g)!s:<16} {len(d):>6} {sum(d) / len(d):>8.1f} {sum(d):>9.0f}"
              for (k, g), d in rows]
    return "\n".join(lines)


# Kernel name fragments -> the part of the step they belong to (first match wins; lower-case).
KERNEL_KINDS = (
    ("all-reduce", ("allreduce", "all_reduce", "one_shot", "two_shot", "nccl", "multimem", "barrier")),
    ("moe", ("moe", "expert", "align_pairs", "combine", "grouped", "mxfp4")),
    ("attention", ("attention", "attn", "decode_kernel", "flash", "unified")),
    ("gemm", ("gemm", "matmul", "cutlass", "sm90_xmma", "nvjet", "cublas", "splitk", "skinny", "linear")),
    ("norm/rope/act", ("norm", "rope", "rotary", "gelu", "silu", "act_", "softcap")),
    ("sampling/logits", ("argmax", "sample", "softmax", "topk", "logits", "gather")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, parts in KERNEL_KINDS:
        if any(p in low for p in parts):
            return kind
    return "other"


def step_breakdown(events: list[dict], steps: int, wall_s: float) -> str:
    """Per step: GPU kernel time by part of the step, the device's busy time (the union of kernel
    intervals) and the wall time; busy < wall is time the device waited (host, peers, gaps)."""
    if not events or steps <= 0:
        return "no kernel events recorded"
    by_kind: dict[str, float] = defaultdict(float)
    for e in events:
        by_kind[kernel_kind(e["name"])] += e["dur"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    wall_us = wall_s * 1e6 / steps
    head = (f"per step (mean of {steps}): wall {wall_us:.0f} us, device busy {busy / steps:.0f} us "
            f"({busy / steps / wall_us * 100:.0f}%), kernels {len(events) / steps:.0f}")
    lines = [head]
    lines += [f"  {k:<16} {v / steps:>9.0f} us" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)
