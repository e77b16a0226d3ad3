"""The server over a tensor-parallel engine (embedded Gemma 3 270M, CPU, two gloo ranks): completions
and streams answer with the same text as the one-rank server, and stopping the server leaves no rank
process behind."""

from __future__ import annotations

import psutil
import pytest
from live_server import fake_spec, skip_to_first_event, start_server


@pytest.fixture(scope="module")
def tp_server():
    from swaserve.tokenizer import Tokenizer

    spec = fake_spec("swaserve.engine:Engine", model=None, device="cpu", max_context=512, max_running_requests=16,
                     detokenize=False, tensor_parallel_size=2)
    live = start_server(spec, Tokenizer.load(None))
    yield live
    live.stop()


@pytest.mark.slow
def test_tp2_server_answers_like_one_rank(tp_server, real_server):
    kw = {"prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}
    one = real_server.client().completions.create(model=real_server.model, **kw).choices[0].text
    c = tp_server.client()
    two = c.completions.create(model=tp_server.model, **kw).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model=tp_server.model, stream=True, **kw))
    assert one and two == one and streamed == one
    seeded = {**kw, "temperature": 0.9, "seed": 11, "n": 2}
    a = [ch.text for ch in real_server.client().completions.create(model=real_server.model, **seeded).choices]
    b = [ch.text for ch in c.completions.create(model=tp_server.model, **seeded).choices]
    assert b == a, "rank 0 samples, every rank records the same tokens"
    m = tp_server.wait_idle(timeout=30)
    assert m['swaserve_kv_used_tokens{pool="full"}'] == 0 and m['swaserve_kv_used_tokens{pool="swa"}'] == 0


@pytest.mark.slow
def test_tp2_server_stop_leaves_no_rank(tmp_path):
    from swaserve.tokenizer import Tokenizer

    spec = fake_spec("swaserve.engine:Engine", model=None, device="cpu", max_context=256, max_running_requests=4,
                     detokenize=False, tensor_parallel_size=2)
    live = start_server(spec, Tokenizer.load(None))
    (pid,) = live.client_state.core_pids
    core = psutil.Process(pid)
    ranks = core.children(recursive=True)
    assert ranks, "the core spawned its second rank"
    live.stop()
    _gone, alive = psutil.wait_procs([core, *ranks], timeout=30)
    assert not alive, f"still running after stop: {alive}"


@pytest.mark.slow
def test_tp2_rank_killed_fails_requests_and_stops_the_server():
    import os
    import signal
    import time

    import httpx

    from swaserve.tokenizer import Tokenizer

    spec = fake_spec("swaserve.engine:Engine", model=None, device="cpu", max_context=256, max_running_requests=4,
                     detokenize=False, tensor_parallel_size=2)
    live = start_server(spec, Tokenizer.load(None))
    try:
        (pid,) = live.client_state.core_pids
        core = psutil.Process(pid)
        (rank,) = [p for p in core.children() if "spawn_main" in " ".join(p.cmdline())]  # not the resource tracker
        body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", live.base_url + "/completions", json=body) as r:
            lines = r.iter_lines()
            skip_to_first_event(lines)
            killed = time.monotonic()
            os.kill(rank.pid, signal.SIGKILL)
            tail = [line for line in lines if line]
        assert any('"error"' in t for t in tail), f"the open stream ends with an error, got {tail[-2:]}"
        assert time.monotonic() - killed < 20
        _gone, alive = psutil.wait_procs([core], timeout=20)
        assert not alive, "the core exits when one of its ranks died"
        live.wait_exit_code(1, 20)  # it stops after its engine died
    finally:
        live.stop()
