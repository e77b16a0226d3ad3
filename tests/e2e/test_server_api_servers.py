"""Several frontend processes behind one port (`--api-server-count 2`) over one engine core (FakeEngine):
requests from many clients at once all complete and the pools come back to zero, disconnects free memory
across the processes, the engine core killed mid-stream gives every client an error and the server
exits non-zero, a frontend killed stops the whole server, the supervisor killed leaves no orphan, SIGTERM
drains in-flight requests."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from live_server import parse_metrics, skip_to_first_event
from test_server_faults import _children, _gone
from test_server_lifecycle import _port_free, _spawn

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")


def _layout(pid: int) -> tuple[list[int], list[int]]:
    """(frontend pids, engine-core pids) under the supervisor `pid`."""
    deadline = time.monotonic() + 10
    while True:
        frontends, cores = [], []
        for child in _children(pid):
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read()
            if b"swaserve.core" in cmd:
                cores.append(child)
            elif b"multiprocessing" in cmd and b"resource_tracker" not in cmd:
                frontends.append(child)
        if (len(frontends), len(cores)) == (2, 1) or time.monotonic() > deadline:
            return frontends, cores
        time.sleep(0.05)


def _metrics(port: int) -> dict[str, float]:
    return parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)


def _wait_idle(port: int, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(port)
        if (m["swaserve_requests_running"] == 0 and m['swaserve_kv_used_tokens{pool="full"}'] == 0
                and m["swaserve_requests_waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@contextlib.contextmanager
def _first_chunk(port: int, max_tokens: int) -> Iterator[Iterator[str]]:
    """A streamed completion once its first SSE chunk has come: the rest of its lines; leaving the
    block hangs up."""
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "fake-model", "prompt": "go", "max_tokens": max_tokens, "stream": True,
                  "ignore_eos": True}) as r:
        lines = r.iter_lines()
        skip_to_first_event(lines)
        yield lines


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_two_frontends_serve_many_clients():
    proc, port = _spawn("--api-server-count", "2", "--step-delay", "0.005")
    try:
        frontends, cores = _layout(proc.pid)
        assert (len(frontends), len(cores)) == (2, 1), (frontends, cores)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)

        def one(i: int) -> tuple[str, str | None]:
            n = 5 + i % 7
            if i % 2:
                text = "".join(c.choices[0].text for c in client.completions.create(
                    model="fake-model", prompt=f"p{i}", max_tokens=n, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}))
                return text, None
            r = client.completions.create(model="fake-model", prompt=f"p{i}", max_tokens=n, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text, r.choices[0].finish_reason

        with ThreadPoolExecutor(24) as pool:
            results = list(pool.map(one, range(48)))
        for i, (text, finish) in enumerate(results):
            assert len(text) == 5 + i % 7, (i, text)
            assert finish in (None, "length")
        m = _wait_idle(port)
        assert m["swaserve_requests_running"] == 0 and m['swaserve_kv_used_tokens{pool="full"}'] == 0

        # a client that goes away mid-stream frees its memory in the core, whichever frontend it used
        for _ in range(4):
            with _first_chunk(port, 400):
                pass
        m = _wait_idle(port)
        assert m["swaserve_requests_running"] == 0 and m['swaserve_kv_used_tokens{pool="full"}'] == 0
    finally:
        _stop(proc)


def test_core_killed_fails_every_request_on_every_frontend():
    proc, port = _spawn("--api-server-count", "2", "--step-delay", "0.02")
    results: list[str] = []
    started = threading.Barrier(6 + 1, timeout=30)

    def stream() -> None:
        try:
            with _first_chunk(port, 480) as lines:
                started.wait()
                tail = [line for line in lines if line]
            results.append("error" if any('"error"' in t for t in tail) else f"no error: {tail[-2:]}")
        except Exception as e:  # noqa: BLE001
            results.append(f"exception {type(e).__name__}: {e}")

    try:
        frontends, cores = _layout(proc.pid)
        threads = [threading.Thread(target=stream) for _ in range(6)]
        for t in threads:
            t.start()
        started.wait()
        killed = time.monotonic()
        os.kill(cores[0], signal.SIGKILL)
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert results == ["error"] * 6, results
        assert time.monotonic() - killed < 10
        assert proc.wait(timeout=30) != 0, "the server exits non-zero when its engine core died"
        assert all(_gone(p) for p in frontends)
    finally:
        _stop(proc)


def test_frontend_killed_stops_the_server():
    proc, _ = _spawn("--api-server-count", "2")
    try:
        frontends, cores = _layout(proc.pid)
        os.kill(frontends[0], signal.SIGKILL)
        assert proc.wait(timeout=60) != 0
        assert all(_gone(p) for p in frontends + cores), "no orphan frontend or engine core"
    finally:
        _stop(proc)


def test_sigterm_drains_every_frontend():
    proc, port = _spawn("--api-server-count", "2", "--step-delay", "0.01", "--graceful-timeout", "20")
    try:
        frontends, cores = _layout(proc.pid)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        texts: list[str] = []
        first = threading.Barrier(4 + 1, timeout=30)

        def stream() -> None:
            text = ""
            for i, ch in enumerate(client.completions.create(model="fake-model", prompt="bye", max_tokens=100,
                                                             temperature=0, stream=True,
                                                             extra_body={"ignore_eos": True})):
                if i == 0:
                    first.wait()
                text += ch.choices[0].text
            texts.append(text)

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        first.wait()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert [len(t) for t in texts] == [100] * 4, "every in-flight request finished"
        rc = proc.wait(timeout=60)
        stderr = proc.stderr.read()
        assert rc == 0, stderr
        assert "Traceback" not in stderr, stderr
        assert all(_gone(p) for p in frontends + cores)
        assert _port_free(port)
    finally:
        _stop(proc)


def test_supervisor_killed_leaves_no_orphans():
    proc, _ = _spawn("--api-server-count", "2")
    frontends, cores = [], []
    try:
        frontends, cores = _layout(proc.pid)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in frontends + cores) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(p) for p in frontends + cores), "orphaned frontend or engine core"
    finally:
        _stop(proc)
        for p in frontends + cores:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)
