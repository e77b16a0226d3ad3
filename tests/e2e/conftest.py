"""Live-server fixtures (each server runs its engine core in a process of its own): the FakeEngine
server (session), a slow FakeEngine server (session), and the real engine on the embedded model."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from live_server import LiveServer, fake_spec, start_server


@pytest.fixture(scope="session")
def fake_server() -> Iterator[LiveServer]:
    live = start_server(fake_spec(), max_body_bytes=1 << 20)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def slow_server() -> Iterator[LiveServer]:
    # 20 ms per step: a 480-token request takes ~10 s, so an abort is unmistakable.
    live = start_server(fake_spec(step_delay=0.02), max_body_bytes=1 << 20)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def real_server() -> Iterator[LiveServer]:
    """The real engine on the embedded model (CPU, 512-token context), no chat template."""
    from swaserve.tokenizer import Tokenizer

    spec = fake_spec("swaserve.engine:Engine", model=None, device="cpu", max_context=512, max_running_requests=64,
                     detokenize=False)
    live = start_server(spec, Tokenizer.load(None))
    yield live
    live.stop()
