"""Programmatic dependent launch (PDL, Hopper and newer) for the decode step's kernels.

A decode step is ~10 launches per layer, each a few microseconds; the gap between one kernel's
end and the next one's start is a real part of the step (measured on an H100, Gemma 3 1B at 64
requests: 1.96 ms of graph replay for 1.96 ms of kernels with cuBLAS, which most likely launches
its GEMMs with PDL, but 2.06 ms for 1.98 ms of kernels once three of those GEMMs were Triton
kernels launched plainly). With PDL the next kernel is launched while this one runs and waits on the
device (`griddepcontrol.wait`) instead of on the launch.

The contract, kept by every kernel that takes `USE_PDL`: `pdl_enter(USE_PDL)` is its first
statement, before any global memory access. It waits for the previous kernel in the stream to
complete and flush (which, transitively, covers everything before it), then lets the next kernel
launch. Kernels launched without PDL keep plain stream order, so mixing is safe.

Experimental and OFF unless SWASERVE_PDL=1: written at the end of a session whose GPU time ran
out before it could be compiled or measured on the GPU (see benchmarks/NOTES.md). Also off in the
Triton interpreter, below compute capability 9, and with a Triton that lacks the launch option.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


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


def pdl_kwargs(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel taking `USE_PDL`, given a tensor on the launch's device."""
    if t.is_cuda and pdl_supported():
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """First statement of a PDL kernel: wait for the previous kernel, then release the next."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
