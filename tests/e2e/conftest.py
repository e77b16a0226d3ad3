"""Live-server fixtures: the FakeEngine server (session) and the real engine on the embedded model."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fake_engine import FakeEngine
from live_server import LiveServer, start_server


@pytest.fixture(scope="session")
def fake_server() -> Iterator[LiveServer]:
    live = start_server(FakeEngine(), max_body_bytes=1 << 20)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def real_server() -> Iterator[LiveServer]:
    """The real engine on the embedded model (CPU, 512-token context)."""
    engine_module = pytest.importorskip("swaserve.engine")
    engine = engine_module.Engine(None, device="cpu", max_context=512, max_running_requests=64)
    live = start_server(engine)
    yield live
    live.stop()
