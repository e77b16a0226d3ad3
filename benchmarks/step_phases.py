"""Where an engine step's host time goes, by phase: wall time and the step loop thread's own CPU time
(`time.thread_time`) of each part of `Engine._advance` / `_commit` / `step_deltas`, per step. Wall time
above CPU time in a phase is time the loop spent off the CPU (waiting for the device, for the GIL, or
descheduled); CPU time above another run's for the same work is the work itself running slower (caches,
frequency). Used by `structured_outputs.py --phases` to put the constrained loop beside the plain one.

    timer = PhaseTimer(engine)      # wraps the engine's methods (its instance, and two module names)
    ... step ...
    row = timer.take(steps)         # {phase: [wall ms, cpu ms] a step, its own}, counters reset
    timer.close()                   # the engine as it was
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# (what is patched, its attribute, the phase name): the engine's collaborators as `_advance` / `_commit` call them
PHASES = (
    ("scheduler", "schedule", "schedule"),
    ("scheduler", "process_output", "process_output"),
    ("launcher", "launch", "launch"),
    ("launcher", "sample_deferred", "sample_deferred"),
    ("launcher", "start_masks", "start_masks"),
    ("launcher", "prepare_deferred", "prepare_deferred"),
)
MODULE_PHASES = ("accept_later", "accept_tokens", "seq_deltas")  # names `swaserve.engine` imported


class PhaseTimer:
    def __init__(self, engine: Any):
        import swaserve.engine as engine_mod
        from swaserve.launched_step import LaunchedStep

        self.totals: dict[str, list[float]] = {}
        self._stack: list[list[float]] = []
        self._undo: list[Callable[[], None]] = []
        for owner_name, attr, phase in PHASES:
            owner = getattr(engine, owner_name)
            fn = getattr(owner, attr)
            setattr(owner, attr, self._wrap(phase, fn))
            self._undo.append(lambda o=owner, a=attr: delattr(o, a))
        for name in MODULE_PHASES:
            fn = getattr(engine_mod, name)
            setattr(engine_mod, name, self._wrap(name, fn))
            self._undo.append(lambda n=name, f=fn: setattr(engine_mod, n, f))
        wait = LaunchedStep.wait
        LaunchedStep.wait = self._wrap("wait_device", wait)  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(LaunchedStep, "wait", wait))
        for name in ("step", "step_deltas"):  # the step itself, whichever way it is taken: its own time is `step`
            setattr(engine, name, self._wrap("step", getattr(engine, name)))
            self._undo.append(lambda n=name: delattr(engine, n))

    def _wrap(self, phase: str, fn: Callable) -> Callable:
        """`fn` timed as `phase`, exclusively: time in a nested phase (`sample_deferred` inside `launch`, the
        whole step around them) counts for the nested one only."""
        totals = self.totals.setdefault(phase, [0.0, 0.0])
        stack = self._stack

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack.append([0.0, 0.0])  # the time of the phases this one calls
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dw, dc = time.perf_counter() - w, time.thread_time() - c
                inner = stack.pop()
                totals[0] += dw - inner[0]
                totals[1] += dc - inner[1]
                if stack:
                    stack[-1][0] += dw
                    stack[-1][1] += dc
        return timed

    def take(self, steps: int) -> dict[str, list[float]]:
        """Per phase [wall, cpu] ms a step since the last take, each phase's own time (`step`: the step's
        outside every named phase; `total`: the whole step). The counters restart."""
        n = max(steps, 1)
        out = {k: [round(v[0] * 1e3 / n, 3), round(v[1] * 1e3 / n, 3)] for k, v in self.totals.items() if v[0]}
        out["total"] = [round(sum(v[i] for v in out.values()), 3) for i in (0, 1)]
        for v in self.totals.values():
            v[0] = v[1] = 0.0
        return out

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def phase_table(rows: dict[str, dict[str, list[float]]]) -> str:
    """Modes side by side: `phase  wall/cpu (mode 1)  wall/cpu (mode 2) ...`, ms a step."""
    modes = list(rows)
    phases = sorted({p for r in rows.values() for p in r}, key=lambda p: (p == "total", p == "step", p))
    lines = [f"  {'phase (ms a step, wall / loop CPU)':<36}" + "".join(f"{m:>26}" for m in modes)]
    for p in phases:
        cells = "".join(f"{'%.3f / %.3f' % tuple(rows[m].get(p, [0.0, 0.0])):>26}" for m in modes)
        lines.append(f"  {p:<36}{cells}")
    return "\n".join(lines)
