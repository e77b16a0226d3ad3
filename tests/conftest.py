"""Shared test setup: Triton in interpreter mode on CPU, deterministic seeds, GPU tests skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in its CPU interpreter; this must be set before triton is imported.
if not torch.cuda.is_available() and os.environ.get("SWASERVE_KERNEL_TESTS_ON_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_patch import install

    install()  # the interpreter without its per-helper-call re-patching (the same values, 12-15% less CPU time)


def _cpus() -> int:
    """The CPUs this process may run on (hyperthreads included: the interpreted kernels are one Python
    thread each, and a container's CPU set is respected, unlike a count of the host's cores)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, unknown to pytest without it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (the README's test command): one worker per CPU, or $PYTEST_XDIST_AUTO_NUM_WORKERS."""
    return int(os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or _cpus())


# Under pytest-xdist every worker takes its share of the CPUs for torch's intra-op threads (unless
# $OMP_NUM_THREADS says otherwise; the processes its tests start inherit it), so N workers on N cores
# do not oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, _cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", str(_share))))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
