"""Process faults: the engine core killed mid-stream (every client gets an error within seconds, the
server exits non-zero, nothing hangs); the frontend killed (its engine core exits too)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from live_server import skip_to_first_event
from test_server_lifecycle import _spawn

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")

LONG = {"model": "fake-model", "prompt": "go on", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _core_pid(server_pid: int) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in _children(server_pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"swaserve.core" in f.read():
                    return pid
        time.sleep(0.05)
    raise AssertionError("no engine core process under the server")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except OSError:
        return True


def test_core_killed_mid_stream_fails_every_request_and_the_server_exits():
    proc, port = _spawn("--step-delay", "0.02")
    base = f"http://127.0.0.1:{port}/v1"
    results: dict[int, tuple[str, float]] = {}
    started = threading.Barrier(5 + 1, timeout=30)

    def stream(i: int) -> None:
        try:
            with httpx.Client(timeout=60) as http, http.stream("POST", base + "/completions",
                                                                 json={**LONG, "stream": True}) as r:
                lines = r.iter_lines()
                skip_to_first_event(lines)
                started.wait()
                tail = [line for line in lines if line]
            results[i] = ("error" if any('"error"' in t for t in tail) else f"no error: {tail[-2:]}", time.monotonic())
        except Exception as e:  # noqa: BLE001  (a dropped connection is an answer too, but not the one we want)
            results[i] = (f"exception {type(e).__name__}: {e}", time.monotonic())

    def whole(i: int) -> None:
        try:
            with httpx.Client(timeout=60) as http:
                started.wait()
                r = http.post(base + "/completions", json=LONG)
            ok = r.status_code >= 500 and r.json()["error"]["code"] in ("engine_dead", "shutting_down")
            results[i] = ("error" if ok else f"status {r.status_code}: {r.text[:200]}", time.monotonic())
        except Exception as e:  # noqa: BLE001
            results[i] = (f"exception {type(e).__name__}: {e}", time.monotonic())

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=whole, args=(i,)) for i in range(3, 5)]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.3)  # the non-streaming requests are in the engine too
        core = _core_pid(proc.pid)
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert {i: r[0] for i, r in results.items()} == dict.fromkeys(range(5), "error")
        assert max(r[1] for r in results.values()) - killed < 5, "errors within seconds"
        rc = proc.wait(timeout=30)
        assert rc != 0, "the server exits non-zero when its engine core died"
        assert "engine core died" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_frontend_killed_takes_the_core_with_it():
    proc, port = _spawn()
    core = _core_pid(proc.pid)
    try:
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 5
        while not _gone(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(core), "orphaned engine core still running"
    finally:
        if not _gone(core):
            os.kill(core, signal.SIGKILL)
