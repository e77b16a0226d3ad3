"""Kernel tests: run the Triton kernels in the CPU interpreter (TRITON_INTERPRET=1) by default.

The env var must be set before triton is first imported, hence here at import time. Set
SWASERVE_KERNEL_TESTS_ON_GPU=1 to run the same tests natively on a CUDA device instead.
SWASERVE_KERNEL_TEST_SEED pins the otherwise fresh-per-run base seed (printed in the header).
"""

from __future__ import annotations

import os
import random
import zlib

if os.environ.get("SWASERVE_KERNEL_TESTS_ON_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    from interpreter_patch import install

    install()  # see tests/interpreter_patch.py

import pytest

BASE_SEED = int(os.environ.get("SWASERVE_KERNEL_TEST_SEED", random.SystemRandom().randrange(1 << 30)))


def pytest_report_header(config: pytest.Config) -> str:
    mode = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "TRITON_INTERPRET=1 (cpu)"
    return f"swaserve kernel tests: {mode}, SWASERVE_KERNEL_TEST_SEED={BASE_SEED}"


@pytest.fixture
def device() -> str:
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A fresh seed per test and run, reproducible from the header's base seed and the test id."""
    return (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % (1 << 31)
