"""LiveServer: the server on 127.0.0.1 (free port): its engine core in a process of its own, uvicorn in a
background thread of the test process; and /metrics parsing."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from swaserve.config import ServerConfig
from swaserve.core.engine_core import CoreSpec
from swaserve.server.launch import build_server

FAKE_ENGINE = "fake_engine:FakeEngine"


@dataclass
class LiveServer:
    url: str
    spec: CoreSpec
    server: Any
    thread: threading.Thread
    model: str

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=kw.pop("timeout", 60), **kw)

    def async_client(self, **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=kw.pop("api_key", "none"), max_retries=0,
                                  timeout=kw.pop("timeout", 120), **kw)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and both pools are empty; return the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["swaserve_requests_running"] == 0 and m["swaserve_requests_waiting"] == 0
                    and m['swaserve_kv_used_tokens{pool="full"}'] == 0
                    and m['swaserve_kv_used_tokens{pool="swa"}'] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def wait_exit_code(self, code: int, timeout: float) -> None:
        """Wait until the server set its exit code to `code` (1: it stops because its engine died)."""
        deadline = time.monotonic() + timeout
        while self.server.config.app.state.exit_code != code:
            assert time.monotonic() < deadline, f"the server did not set exit code {code} within {timeout} s"
            time.sleep(0.05)

    @property
    def client_state(self) -> Any:
        return self.server.config.app.state.engine_client

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server thread did not exit"


def fake_spec(factory: str = FAKE_ENGINE, **kwargs: Any) -> CoreSpec:
    return CoreSpec(factory, kwargs)


def start_server(spec: CoreSpec, tokenizer: Any = None, **kw: Any) -> LiveServer:
    """`tokenizer` None: the fake engine's toy tokenizer."""
    if tokenizer is None:
        from fake_engine import FakeTokenizer

        tokenizer = FakeTokenizer()
    server, sock = build_server(spec, tokenizer, ServerConfig(host="127.0.0.1", port=0, **kw))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    return LiveServer(f"http://127.0.0.1:{port}", spec, server, thread, server.config.app.state.model_name)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def skip_to_first_event(lines: Iterator[str]) -> None:
    """Advance a streaming response's lines past its first `data:` event (the stream has started)."""
    while not next(lines).startswith("data: "):
        pass


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, f"bad exposition line: {line!r}"
            out[m.group(1)] = float(m.group(2))
    return out
