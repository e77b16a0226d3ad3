"""Client disconnects free memory across the process boundary; API keys; SIGTERM/SIGINT shut a server
process down cleanly; an idle engine core sleeps; an engine failure is a 500 the core survives."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from live_server import fake_spec, start_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = {"model": "fake-model", "prompt": "go on", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


def _wait_running(live, n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while live.metrics()["swaserve_requests_running"] < n:
        assert time.monotonic() < deadline, "request never started running"
        time.sleep(0.02)


def test_stream_disconnect_frees_memory(slow_server):
    before = slow_server.metrics()
    with httpx.Client(timeout=30) as http, http.stream(
        "POST", slow_server.base_url + "/completions", json={**LONG, "stream": True}
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or line == "" for line in got)
        assert slow_server.metrics()['swaserve_kv_used_tokens{pool="full"}'] > 0
    t0 = time.monotonic()
    m = slow_server.wait_idle(timeout=5)
    assert time.monotonic() - t0 < 3, "the aborted request kept running"
    assert m['swaserve_kv_used_tokens{pool="full"}'] == 0 and m['swaserve_kv_used_tokens{pool="swa"}'] == 0
    assert m["swaserve_requests_aborted_total"] == before["swaserve_requests_aborted_total"] + 1
    assert m["swaserve_generation_tokens_total"] - before["swaserve_generation_tokens_total"] < 200


def test_nonstream_disconnect_frees_memory(slow_server):
    before = slow_server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.base_url + "/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    m = slow_server.wait_idle(timeout=5)
    assert m['swaserve_kv_used_tokens{pool="full"}'] == 0 and m["swaserve_requests_running"] == 0
    assert m["swaserve_requests_aborted_total"] == before["swaserve_requests_aborted_total"] + 1
    assert m["swaserve_generation_tokens_total"] - before["swaserve_generation_tokens_total"] < 200


def test_openai_stream_close_aborts(slow_server):
    before = slow_server.metrics()
    client = slow_server.client()
    body = {k: v for k, v in LONG.items() if k != "ignore_eos"}
    stream = client.chat.completions.create(
        messages=[{"role": "user", "content": "x"}], stream=True, extra_body={"ignore_eos": True},
        **{k: v for k, v in body.items() if k != "prompt"},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    m = slow_server.wait_idle(timeout=5)
    assert m["swaserve_requests_running"] == 0
    assert m["swaserve_requests_aborted_total"] == before["swaserve_requests_aborted_total"] + 1


def test_api_key():
    live = start_server(fake_spec(), api_key="sekret")
    try:
        assert httpx.get(live.base_url + "/models").status_code == 401
        r = httpx.get(live.base_url + "/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "api key" in r.json()["error"]["message"].lower()
        r = httpx.post(live.base_url + "/completions", json={"prompt": "x"})
        assert r.status_code == 401
        assert httpx.get(live.url + "/health").status_code == 200
        assert httpx.get(live.url + "/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").models.list()
        ok = live.client(api_key="sekret").completions.create(model=live.model, prompt="x", max_tokens=2)
        assert ok.usage.prompt_tokens == 1
    finally:
        live.stop()


def _spawn(*extra: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "e2e", "fake_server.py"), "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )
    line = proc.stdout.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    if not m:
        proc.kill()
        raise AssertionError(f"no startup line: {line!r} {proc.stderr.read()}")
    port = int(m.group(1))
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "server did not come up"
        time.sleep(0.05)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shutdown_finishes_in_flight(sig):
    proc, port = _spawn("--step-delay", "0.01", "--graceful-timeout", "20")
    try:
        base = f"http://127.0.0.1:{port}/v1"
        result: dict[str, object] = {}

        def stream() -> None:
            client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=30)
            text, finish = "", None
            for ch in client.completions.create(model="fake-model", prompt="bye", max_tokens=100, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}):
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
                result.setdefault("first", True)
            result.update(text=text, finish=finish)

        t = threading.Thread(target=stream)
        t.start()
        while "first" not in result and t.is_alive():
            time.sleep(0.01)
        proc.send_signal(sig)
        t.join(30)
        assert result.get("finish") == "length" and len(result["text"]) == 100  # in-flight request finished
        rc = proc.wait(timeout=30)
        stderr = proc.stderr.read()
        assert rc == 0, stderr
        assert "Traceback" not in stderr, stderr
        assert _port_free(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shutdown_refuses_new_connections():
    proc, port = _spawn()
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of stat)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_idle_engine_core_sleeps(fake_server):
    fake_server.wait_idle()
    pid = fake_server.client_state.core_pids[0]
    assert pid is not None and pid != os.getpid()
    before = _cpu_ticks(pid)
    time.sleep(1.0)
    assert _cpu_ticks(pid) - before <= 3  # <= 30 ms of CPU in 1 s: no busy loop while idle


def test_http_does_not_wait_on_compute(slow_server):
    client = slow_server.client()
    done = threading.Event()

    def long_request() -> None:
        client.completions.create(model="fake-model", prompt="busy", max_tokens=100, extra_body={"ignore_eos": True})
        done.set()

    t = threading.Thread(target=long_request)
    t.start()
    _wait_running(slow_server, 1)
    for _ in range(5):
        t0 = time.monotonic()
        assert httpx.get(slow_server.url + "/health").status_code == 200
        assert httpx.get(slow_server.base_url + "/models").status_code == 200
        assert time.monotonic() - t0 < 0.5
    assert not done.is_set()
    t.join(30)


def test_engine_failure_is_a_500_and_the_server_survives():
    live = start_server(fake_spec("fake_engine:FailingEngine"))
    try:
        ok = live.client().completions.create(model=live.model, prompt="fine", max_tokens=3, temperature=0)
        r = httpx.post(live.base_url + "/completions", json={"prompt": "BOOM", "max_tokens": 5}, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        again = live.client().completions.create(model=live.model, prompt="fine", max_tokens=3, temperature=0)
        assert again.choices[0].text == ok.choices[0].text  # greedy both times: the failure changed nothing
        assert again.usage.completion_tokens == ok.usage.completion_tokens
        assert httpx.get(live.url + "/health").status_code == 200
        assert live.wait_idle()["swaserve_requests_running"] == 0
    finally:
        live.stop()
