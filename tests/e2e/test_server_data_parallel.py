"""Data parallelism (`--data-parallel-size N`): N engine-core replicas behind one frontend. Routing to the
least-loaded replica (n > 1 choices on one), aborts to the owning replica, per-replica metrics, a dead
replica failing the whole server, bad sizes as clear errors, and the real embedded model on 2 replicas."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from live_server import LiveServer, fake_spec, skip_to_first_event, start_server

from swaserve.core.engine_core import CoreSpec
from swaserve.server.core_pool import replica_specs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = {"model": "fake-model", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def dp_server() -> Iterator[LiveServer]:
    # 20 ms per step: a 480-token request runs ~10 s, so what runs where (and what was aborted) is visible.
    live = start_server(fake_spec(step_delay=0.02), max_body_bytes=1 << 20, data_parallel_size=2)
    yield live
    live.stop()


def _replica(m: dict[str, float], name: str, i: int, pool: str | None = None) -> float:
    labels = (f'pool="{pool}",' if pool else "") + f'replica="{i}"'
    return m[f"{name}{{{labels}}}"]


def _in_flight(live: LiveServer) -> list[float]:
    m = live.metrics()
    return [_replica(m, "swaserve_replica_requests_in_flight", i) for i in range(2)]


def _open_stream(stack: contextlib.ExitStack, http: httpx.Client, live: LiveServer, **body: object) -> Iterator[str]:
    """Start a streaming completion and read its first event (every choice is accepted by then); the
    stream stays open until `stack` closes it (a client disconnect: the server aborts it) or the
    returned line iterator is dropped (closing it closes the connection too)."""
    r = stack.enter_context(http.stream("POST", live.base_url + "/completions", json={**LONG, **body}))
    assert r.status_code == 200
    lines = r.iter_lines()
    while not (line := next(lines)).startswith("data: "):
        pass
    assert '"error"' not in line, line
    return lines


def _wait_for(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _replica_idle(live: LiveServer, i: int) -> bool:
    m = live.metrics()
    return (_replica(m, "swaserve_requests_running", i) == 0 and _replica(m, "swaserve_requests_waiting", i) == 0
            and _replica(m, "swaserve_kv_used_tokens", i, "full") == 0
            and _replica(m, "swaserve_kv_used_tokens", i, "swa") == 0
            and _replica(m, "swaserve_replica_requests_in_flight", i) == 0)


def test_least_loaded_routing_spreads_requests_and_keeps_choices_together(dp_server):
    live = dp_server
    live.wait_idle()
    before = live.metrics()
    with contextlib.ExitStack() as stack, httpx.Client(timeout=30) as http:
        streams = [_open_stream(stack, http, live, prompt="a" * 5)]  # [0, 0] -> replica 0 (tie: lowest)
        assert _in_flight(live) == [1, 0]
        streams.append(_open_stream(stack, http, live, prompt="b" * 7))  # -> replica 1
        assert _in_flight(live) == [1, 1]
        streams.append(_open_stream(stack, http, live, prompt="c" * 11, n=2))  # tie -> replica 0, both choices
        assert _in_flight(live) == [3, 1]
        streams.append(_open_stream(stack, http, live, prompt="d" * 13))  # -> replica 1
        assert _in_flight(live) == [3, 2]

        def running() -> list[float]:
            m = live.metrics()
            return [_replica(m, "swaserve_requests_running", i) for i in range(2)]

        _wait_for(lambda: running() == [3, 2], f"engine requests per replica: {running()}")
        m = live.metrics()
        assert m["swaserve_requests_running"] == 5  # the unlabelled sample is the sum
        for i in range(2):
            assert _replica(m, "swaserve_kv_used_tokens", i, "full") > 0
    _wait_for(lambda: _replica_idle(live, 0) and _replica_idle(live, 1), "replicas did not go idle after the aborts")
    after = live.metrics()

    def delta(name: str, i: int) -> float:
        return _replica(after, name, i) - _replica(before, name, i)

    # Prompt tokens say exactly which prompts each replica's engine received.
    assert delta("swaserve_prompt_tokens_total", 0) == 5 + 2 * 11
    assert delta("swaserve_prompt_tokens_total", 1) == 7 + 13
    assert delta("swaserve_generation_tokens_total", 0) > 0 and delta("swaserve_generation_tokens_total", 1) > 0
    for name in ("swaserve_prompt_tokens_total", "swaserve_generation_tokens_total"):
        assert after[name] == _replica(after, name, 0) + _replica(after, name, 1)


def test_n_choices_go_to_the_least_loaded_replica_together(dp_server):
    live = dp_server
    live.wait_idle()
    with contextlib.ExitStack() as stack, httpx.Client(timeout=30) as http:
        busy = _open_stream(stack, http, live, prompt="busy")  # replica 0
        before = live.metrics()
        r = http.post(live.base_url + "/completions", json={"model": live.model, "prompt": "x" * 9, "n": 3,
                                                            "max_tokens": 4, "temperature": 1.0, "seed": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        after = live.metrics()
        assert _in_flight(live) == [1, 0] and busy is not None
    prompt = [_replica(after, "swaserve_prompt_tokens_total", i) - _replica(before, "swaserve_prompt_tokens_total", i)
              for i in range(2)]
    assert prompt == [0, 3 * 9], prompt  # all three choices on replica 1 (0 had one in flight)
    _wait_for(lambda: _replica_idle(live, 0) and _replica_idle(live, 1), "replicas did not go idle")


def test_abort_reaches_the_owning_replica(dp_server):
    live = dp_server
    live.wait_idle()
    with contextlib.ExitStack() as keep, httpx.Client(timeout=30) as http:
        kept = _open_stream(keep, http, live, prompt="stays")  # replica 0
        with contextlib.ExitStack() as drop:
            dropped = _open_stream(drop, http, live, prompt="goes")  # replica 1
            assert _in_flight(live) == [1, 1]
            _wait_for(lambda: _replica(live.metrics(), "swaserve_kv_used_tokens", 1, "full") > 0, "replica 1 idle")
            before = live.metrics()
            del dropped
        t0 = time.monotonic()
        _wait_for(lambda: _replica_idle(live, 1), "the aborted request kept running on replica 1", timeout=3)
        assert time.monotonic() - t0 < 3
        m = live.metrics()
        assert _replica(m, "swaserve_generation_tokens_total", 1) - _replica(
            before, "swaserve_generation_tokens_total", 1) < 100
        assert _replica(m, "swaserve_requests_running", 0) == 1, "the other replica's request was touched"
        assert _in_flight(live) == [1, 0]
        assert m["swaserve_requests_aborted_total"] == before["swaserve_requests_aborted_total"] + 1
        assert kept is not None
    _wait_for(lambda: _replica_idle(live, 0) and _replica_idle(live, 1), "replica 0 did not free its pools")
    m = live.wait_idle()
    assert m['swaserve_kv_used_tokens{pool="full"}'] == 0 and m['swaserve_kv_used_tokens{pool="swa"}'] == 0


def test_metrics_exposition(dp_server, fake_server):
    text = httpx.get(dp_server.url + "/metrics").text
    for family in ("swaserve_requests_running", "swaserve_kv_used_tokens", "swaserve_replica_requests_in_flight"):
        assert text.count(f"# TYPE {family} ") == 1
    assert 'swaserve_kv_total_tokens{pool="swa",replica="1"} 4096' in text
    assert 'swaserve_kv_total_tokens{pool="swa"} 8192' in text  # the sum of the two replicas' pools
    # One replica: the engine families keep their unlabelled samples only.
    single = httpx.get(fake_server.url + "/metrics").text
    assert 'swaserve_replica_requests_in_flight{replica="0"}' in single
    assert "replica=" not in "\n".join(ln for ln in single.splitlines() if "in_flight" not in ln)


def test_dead_replica_fails_every_request_and_turns_unhealthy():
    live = start_server(fake_spec(step_delay=0.02), data_parallel_size=2)
    # Each core reports its counters once it runs, before any request: both replicas' pools are visible.
    _wait_for(lambda: live.metrics()['swaserve_kv_total_tokens{pool="full"}'] == 2 * 8192, "pool totals missing")
    client = live.client_state
    exit_server = client.on_fatal
    fatal = threading.Event()
    client.on_fatal = fatal.set  # hold the server up to look at it; exit below
    pids = client.core_pids
    results: dict[int, str] = {}
    opened = threading.Barrier(3, timeout=30)

    def stream(i: int) -> None:
        try:
            with httpx.Client(timeout=30) as http, http.stream(
                    "POST", live.base_url + "/completions", json={**LONG, "prompt": f"stream {i}"}) as r:
                lines = r.iter_lines()
                skip_to_first_event(lines)
                opened.wait()
                tail = [line for line in lines if line]
            results[i] = "error" if any('"engine_dead"' in t for t in tail) else f"no error: {tail[-2:]}"
        except Exception as e:  # noqa: BLE001
            results[i] = f"exception {type(e).__name__}: {e}"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    try:
        threads[0].start()
        _wait_for(lambda: _in_flight(live) == [1, 0], "the first stream did not open on replica 0")
        threads[1].start()
        _wait_for(lambda: _in_flight(live) == [1, 1], "the second stream did not open on replica 1")
        opened.wait()
        os.kill(pids[1], signal.SIGKILL)
        for t in threads:
            t.join(10)
        assert results == {0: "error", 1: "error"}  # the request on the live replica 0 too
        assert fatal.wait(5)
        assert httpx.get(live.url + "/health").status_code == 503
        r = httpx.post(live.base_url + "/completions", json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
    finally:
        exit_server()
        live.thread.join(30)
    assert not live.thread.is_alive()
    assert live.server.config.app.state.exit_code == 1
    _wait_for(lambda: _gone(pids[0]), "the surviving replica's core was not stopped")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _core_pids(server_pid: int, n: int) -> list[int]:
    pids: list[int] = []
    deadline = time.monotonic() + 10
    while len(pids) < n:
        assert time.monotonic() < deadline, f"expected {n} engine cores under the server, found {pids}"
        pids = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if parent == server_pid and b"swaserve.core" in f.read():
                        pids.append(int(entry))
        time.sleep(0.05)
    return pids


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_killed_replica_core_exits_the_server_nonzero_and_stops_the_other():
    from test_server_lifecycle import _spawn

    proc, port = _spawn("--step-delay", "0.02", "--data-parallel-size", "2")
    try:
        cores = _core_pids(proc.pid, 2)
        assert len(cores) == 2
        url = f"http://127.0.0.1:{port}"
        with contextlib.ExitStack() as stack, httpx.Client(timeout=30) as http:
            responses = []
            for i in range(2):  # one on each replica
                r = stack.enter_context(http.stream("POST", url + "/v1/completions", json={**LONG, "prompt": f"{i}"}))
                lines = r.iter_lines()
                skip_to_first_event(lines)
                responses.append(lines)
            os.kill(cores[1], signal.SIGKILL)
            for lines in responses:
                assert any('"engine_dead"' in line for line in lines)
        assert proc.wait(timeout=30) != 0
        assert "engine core died (replica" in proc.stderr.read()
        _wait_for(lambda: _gone(cores[0]), "orphaned engine core still running")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_sigterm_stops_every_replica():
    from test_server_lifecycle import _spawn

    proc, port = _spawn("--data-parallel-size", "3")
    try:
        cores = _core_pids(proc.pid, 3)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        for pid in cores:
            _wait_for(lambda pid=pid: _gone(pid), f"engine core {pid} outlived the server")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _my_cores() -> list[int]:
    me, found = os.getpid(), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if int(fields[1]) == me and fields[0] != "Z" and b"swaserve.core" in f.read():
                    found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_a_replica_failing_to_start_stops_the_others(tmp_path):
    before = set(_my_cores())  # the cores of other tests' live servers
    with pytest.raises(ValueError, match="this replica refuses to start"):
        start_server(fake_spec("fake_engine:one_replica_fails", marker=str(tmp_path / "first")), data_parallel_size=2)
    assert (tmp_path / "first").exists()  # one replica did start
    assert set(_my_cores()) == before, "a started replica's core outlived the failed start"


def test_replica_devices():
    spec = CoreSpec("swaserve.engine:Engine", {"model": None, "device": "cuda"})
    devices = [s.kwargs["device"] for s in replica_specs(spec, 3, gpu_count=lambda: 4)]
    assert devices == ["cuda:0", "cuda:1", "cuda:2"]
    offset = CoreSpec(spec.factory, {"device": "cuda:2"})
    assert [s.kwargs["device"] for s in replica_specs(offset, 2, gpu_count=lambda: 4)] == ["cuda:2", "cuda:3"]
    tp = CoreSpec(spec.factory, {"device": "cuda", "tensor_parallel_size": 2})
    assert [s.kwargs["device"] for s in replica_specs(tp, 2, gpu_count=lambda: 4)] == ["cuda:0", "cuda:2"]
    with pytest.raises(ValueError, match=r"needs GPUs cuda:0..cuda:5 \(2 per replica\), but 4 GPU"):
        replica_specs(tp, 3, gpu_count=lambda: 4)
    tp_cpu = CoreSpec(spec.factory, {"device": "cpu", "tensor_parallel_size": 2})
    assert [s.kwargs["device"] for s in replica_specs(tp_cpu, 2, gpu_count=lambda: 0)] == ["cpu", "cpu"]
    for multi_node in ({"nnodes": 2}, {"dist_init_addr": "10.0.0.1:5000"}):
        with pytest.raises(ValueError, match="does not combine with --nnodes > 1 or --dist-init-addr"):
            replica_specs(CoreSpec(spec.factory, {"device": "cpu", **multi_node}), 2, gpu_count=lambda: 0)
    default = CoreSpec(spec.factory, {"device": None})
    assert [s.kwargs["device"] for s in replica_specs(default, 2, gpu_count=lambda: 0)] == ["cpu", "cpu"]
    assert [s.kwargs["device"] for s in replica_specs(default, 2, gpu_count=lambda: 2)] == ["cuda:0", "cuda:1"]
    assert replica_specs(spec, 1, gpu_count=lambda: 0) == [spec]  # one replica: the spec as given
    assert replica_specs(fake_spec(), 2) == [fake_spec()] * 2  # no device keyword: as given
    with pytest.raises(ValueError, match=r"needs GPUs cuda:0..cuda:2 \(1 per replica\), but 2 GPU"):
        replica_specs(spec, 3, gpu_count=lambda: 2)
    with pytest.raises(ValueError, match="but 3 GPU"):
        replica_specs(offset, 2, gpu_count=lambda: 3)
    with pytest.raises(ValueError, match="must be >= 1"):
        replica_specs(spec, 0)


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("entry", [("-m", "swaserve", "serve"), ("-m", "swaserve.server")])
def test_bad_data_parallel_size_is_a_clear_error(entry):
    r = _cli(*entry, "--data-parallel-size", "0", "--port", "0")
    assert r.returncode == 2 and "data_parallel_size must be >= 1, got 0" in r.stderr, r.stderr


def test_more_replicas_than_gpus_is_a_clear_error():
    import torch

    if torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    r = _cli("-m", "swaserve", "serve", "--device", "cuda", "--data-parallel-size", "64", "--port", "0")
    assert r.returncode == 2, r.stderr
    assert "--data-parallel-size 64" in r.stderr and "GPU(s) are visible" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_real_model_on_two_replicas():
    """The embedded model on 2 CPU replicas: the same greedy prompt, sent again while the first runs, runs
    once on each replica and gives the same text; both replicas' engines count it and free their pools."""
    from swaserve.tokenizer import Tokenizer

    spec = fake_spec("swaserve.engine:Engine", model=None, device="cpu", max_context=256, max_running_requests=8,
                     kv_cache_bytes=128 << 20, max_prefill_tokens=256, detokenize=False)
    live = start_server(spec, Tokenizer.load(None), data_parallel_size=2)
    try:
        prompt = "The capital of France is"
        before = live.metrics()
        with httpx.Client(timeout=120) as http, http.stream("POST", live.base_url + "/completions", json={
                "model": live.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))  # on replica 0, in flight
            other = live.client().completions.create(model=live.model, prompt=prompt, max_tokens=8, temperature=0)
            events = [first] + [line for line in lines if line.startswith("data: {")]
        streamed = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events)
        assert streamed == other.choices[0].text and streamed.strip(), (streamed, other.choices[0].text)
        m = live.wait_idle(timeout=30)
        for i in range(2):
            generated = (_replica(m, "swaserve_generation_tokens_total", i)
                         - _replica(before, "swaserve_generation_tokens_total", i))
            assert generated == 8, f"replica {i} generated {generated}"
            assert _replica(m, "swaserve_kv_used_tokens", i, "full") == 0
    finally:
        live.stop()
