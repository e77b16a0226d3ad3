"""Shared test setup: Triton in interpreter mode on CPU, deterministic seeds, GPU tests skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in its CPU interpreter; this must be set before triton is imported.
if not torch.cuda.is_available() and os.environ.get("SWASERVE_KERNEL_TESTS_ON_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
