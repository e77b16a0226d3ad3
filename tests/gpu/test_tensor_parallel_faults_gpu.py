"""A tensor-parallel rank SIGKILLed under load on two GPUs: the server (frontend in this process, its
engine core a process of its own, the core's second rank a process beside it, `--load-format dummy`
Gemma 3 270M shape, bf16, graphs on) has eight streams open; the rank is killed; every stream ends with
an error within seconds, the engine core exits, the server stops with exit code 1, and no process of
the engine is left to hold either GPU (an exited process's device memory is the driver's again)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from common import model_dir
from live_server import fake_spec, skip_to_first_event, start_server

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
STREAMS = 8


def test_rank_killed_under_load_fails_every_stream_and_frees_the_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import httpx

    from swaserve.tokenizer import Tokenizer

    path = model_dir("270m", tokenizer="words")
    spec = fake_spec("swaserve.engine:Engine", model=path, device="cuda", dtype="bfloat16", load_format="dummy",
                     max_context=2048, max_running_requests=16, kv_cache_bytes=2 << 30, tensor_parallel_size=2,
                     detokenize=False)
    live = start_server(spec, Tokenizer.load(path))
    try:
        (pid,) = live.client_state.core_pids
        core = psutil.Process(pid)
        (rank,) = [p for p in core.children() if "spawn_main" in " ".join(p.cmdline())]  # not the resource tracker
        body = {"prompt": " ".join(f"w{i}" for i in range(100, 400)), "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True, "stream": True}
        started = threading.Barrier(STREAMS + 1, timeout=120)
        ends: dict[int, str] = {}

        def stream(i: int) -> None:
            try:
                with httpx.Client(timeout=120) as http, \
                        http.stream("POST", live.base_url + "/completions", json=body) as r:
                    lines = r.iter_lines()
                    skip_to_first_event(lines)
                    started.wait()
                    tail = [line for line in lines if line]
                ends[i] = "error" if any('"error"' in t for t in tail) else f"no error: {tail[-2:]}"
            except Exception as e:  # noqa: BLE001  (a dropped connection is an answer, not the one we want)
                ends[i] = f"{type(e).__name__}: {e}"

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        started.wait()  # every stream has its first tokens: the engine is decoding all of them
        killed = time.monotonic()
        os.kill(rank.pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert ends == dict.fromkeys(range(STREAMS), "error"), ends
        assert time.monotonic() - killed < 30, "every stream failed within seconds"
        _, alive = psutil.wait_procs([core, rank], timeout=30)
        assert not alive, f"engine processes still running (and holding GPU memory): {alive}"
        live.wait_exit_code(1, 30)  # it stops after its engine died
    finally:
        live.stop()
