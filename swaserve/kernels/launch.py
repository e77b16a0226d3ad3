"""FastLaunch: `kernel[grid](*args, **constexprs, **options)` with less host work on repeat launches.

Triton's own launch binds and specialises every argument and builds a cache key each time: 24 us for
an empty 32-argument kernel on the H100 host, ~50 us through the extend-attention wrapper
(`benchmarks/launch_overhead.py`). That is invisible inside CUDA graphs but not in the eager
attention between piecewise-graph pieces, once per layer of every prefill and mixed step.

Here the first launch of each argument signature goes through Triton (which compiles or finds the
kernel and returns it); later launches with the same signature call the compiled kernel's launcher
directly. The signature is a superset of what Triton specialises on: per tensor its dtype and
16-byte alignment, per int whether it is 1, divisible by 16 and fits 32 bits, per other value the
value itself, plus the constexprs, the launch options and the device. So a launch never reuses a
kernel compiled for different specialisations. The normal path is kept for the CPU interpreter,
with launch hooks set (profilers such as proton read them), for a Triton without the launcher
interface this relies on (checked on the first launch), and with SWASERVE_FAST_LAUNCH=0.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
from triton.runtime import driver

from swaserve.kernels.common import interpret_mode

ENABLED = os.environ.get("SWASERVE_FAST_LAUNCH", "1") == "1"


def _arg_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return "b", a
    if isinstance(a, int):
        return "i", a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31)
    if isinstance(a, float):
        return "f"
    return "v", a


def _hooks_set() -> bool:
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    return runtime is None or runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None


class FastLaunch:
    """Wraps a `triton.jit` kernel whose constexpr parameters all follow its runtime ones; call as
    `launch(grid, args, constexprs, **options)` with every runtime argument positional (in order) and
    every constexpr by name."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        params = getattr(kernel, "params", None) or []  # (the interpreter's kernels: none, normal path)
        self.n_runtime = sum(not p.is_constexpr for p in params)
        self.constexpr_names = [p.name for p in params if p.is_constexpr]
        assert all(not p.is_constexpr for p in params[: self.n_runtime]), "constexprs must come last"
        self._compiled: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], **options: Any) -> None:
        if (not ENABLED or interpret_mode() or not self.n_runtime or len(args) != self.n_runtime
                or len(constexprs) != len(self.constexpr_names) or _hooks_set()):
            self.kernel[grid](*args, **constexprs, **options)
            return
        consts = tuple(constexprs[n] for n in self.constexpr_names)
        device = torch.cuda.current_device()
        key = (device, consts, tuple(options.items()), tuple(map(_arg_key, args)))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **constexprs, **options)
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            if hasattr(compiled, "_init_handles"):
                compiled._init_handles()
            # The launcher interface used below (Triton 3.x); without it this key keeps the normal path.
            usable = all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
            self._compiled[key] = compiled if usable else False
            return
        if compiled is False:
            self.kernel[grid](*args, **constexprs, **options)
            return
        g0, g1, g2 = (*grid, 1, 1)[:3]
        stream = driver.active.get_current_stream(device)
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *consts)
