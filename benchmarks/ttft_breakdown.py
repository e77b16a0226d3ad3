"""Where time to first token goes: offline (waiting for the step boundary, then the engine) and served
(HTTP, IPC plus the wait for the running step, the engine, the way back), from the clients' timings
joined with the server's request trace (`swaserve/core/request_trace.py`). Used by
`serving_vs_offline.py`; p50 and p99 of each stage, in ms.
"""

from __future__ import annotations

import glob
import json
from typing import Any

OFFLINE_STAGES = ("wait for the step boundary", "engine: add -> first token out")
# Per request, TTFT less its engine stage: what serving adds is this row's served value less its offline one (the
# p50 of a sum is not the sum of its stages' p50s).
OUTSIDE = "all but the engine (TTFT - engine stage)"
SERVED_STAGES = ("client -> frontend route (HTTP)", "frontend: body, parse, tokenize, send",
                 "frontend -> core (IPC, wait for the running step)",
                 "engine: add -> first token sent", "core -> frontend (IPC)",
                 "frontend -> client (detokenize, SSE)")


def _read(pattern: str) -> dict[str, list[float]]:
    """{request: [*t_in, t_first]} from every trace file matching `pattern`."""
    out = {}
    for path in glob.glob(pattern):
        with open(path) as f:
            for line in f:
                rid, *times = json.loads(line)
                out[rid] = times
    return out


def offline(timings: list[Any]) -> dict[str, list[float]]:
    ok = [t for t in timings if t.first and t.added]
    waits = [t.added - t.arrival for t in ok]
    return dict(zip(OFFLINE_STAGES, (waits, [t.first - t.added for t in ok]))) | {OUTSIDE: waits}


def served(timings: list[Any], prefix: str) -> dict[str, list[float]]:
    """Stages per request whose first token passed every process (a request is `<response id>-0`)."""
    core, front = _read(f"{prefix}.core*"), _read(f"{prefix}.frontend*")
    stages: list[list[float]] = [[] for _ in SERVED_STAGES]
    outside: list[float] = []
    for t in timings:
        rid = f"{t.rid}-0"
        if not t.first or rid not in core or rid not in front:
            continue
        (f_in, f_sent, f_first), (c_in, c_first) = front[rid], core[rid]
        for vals, v in zip(stages, (f_in - t.arrival, f_sent - f_in, c_in - f_sent, c_first - c_in,
                                    f_first - c_first, t.first - f_first)):
            vals.append(v)
        outside.append(t.first - t.arrival - (c_first - c_in))
    return dict(zip(SERVED_STAGES, stages)) | {OUTSIDE: outside}


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values` (seconds) in ms; nan when empty."""
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] * 1000 if s else float("nan")


def print_breakdown(name: str, stages: dict[str, list[float]]) -> dict[str, Any]:
    """Print one table; returns {stage: [p50 ms, p99 ms, mean ms, n]} for the JSON line."""
    print(f"TTFT breakdown, {name} (ms)        p50      p99     mean      n")
    out = {}
    for stage, vals in stages.items():
        mean = 1000 * sum(vals) / len(vals) if vals else float("nan")
        out[stage] = [pct(vals, 0.5), pct(vals, 0.99), mean, len(vals)]
        print(f"  {stage:<52}{out[stage][0]:>7.2f}{out[stage][1]:>9.2f}{mean:>9.2f}{len(vals):>7}")
    return out
