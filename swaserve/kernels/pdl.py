"""Programmatic dependent launch (PDL, Hopper and newer) for the decode step's kernels.

A decode step is ~10 kernels per layer, and each pays a fixed cost (launch, first loads in
flight, the tail) that does not shrink with its work: at one row on an H100 a 2.4 MB projection
takes 3-4 us, a norm 2.7 us (benchmarks/NOTES.md). With PDL the next kernel launches while this one
runs and waits on the device (`griddepcontrol.wait`), and a weight-streaming GEMM can issue its
first weight loads before that wait, so its ramp overlaps the kernel before it.

The contract, kept by every kernel that takes `USE_PDL`: it starts with `pdl_release(USE_PDL)`
(the next kernel may launch now) and calls `pdl_wait(USE_PDL)` (the previous kernel has completed
and flushed, which transitively covers everything before it) before it reads anything a kernel
writes or writes anything; `pdl_enter` is the two back to back. Between the two a kernel may read
only what no kernel of the step writes (weights), so a GEMM can start streaming its weights while
the kernels before it still run. Kernels launched without PDL keep plain stream order, so mixing
is safe.

OFF unless SWASERVE_PDL=1 (benchmarks/NOTES.md has the A/B numbers). Also off in the Triton
interpreter, below compute capability 9, and with a Triton that lacks the launch option.

SWASERVE_PDL_MAX_ROWS=n (with SWASERVE_PDL=1) keeps PDL to steps of at most n rows: the runner states a
step's rows while it runs it eagerly or captures its graph (`swaserve.step_rows`); kernels launched
outside such a step (piecewise graphs' pieces, tests) take none. On an H200 PDL made batch 1 3-7% faster beside the
one-row GEMV but Gemma 3 1B's batch-64 step 26% slower (benchmarks/NOTES.md, tenth session): small grids
gain from the overlap, a step whose kernels fill the GPU can lose to it. Not yet measured with the limit.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from swaserve import step_rows


@functools.cache
def pdl_supported() -> bool:
    if os.environ.get("SWASERVE_PDL") != "1" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


_MAX_ROWS = int(os.environ["SWASERVE_PDL_MAX_ROWS"]) if os.environ.get("SWASERVE_PDL_MAX_ROWS") else None


def _within_row_limit() -> bool:
    if _MAX_ROWS is None:
        return True
    rows = step_rows.current()
    return rows is not None and rows <= _MAX_ROWS


def pdl_kwargs(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel taking `USE_PDL`, given a tensor on the launch's device."""
    if t.is_cuda and pdl_supported() and _within_row_limit():
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Let the next kernel in the stream launch; it waits on the device for this one to finish."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """First statement of a PDL kernel that reads nothing before the wait: release, then wait."""
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
