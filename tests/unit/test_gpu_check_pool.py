"""scripts/gpu_check.py's job pool on fake jobs: every job runs once, at most one heavy job per GPU at a
time and never more than the slots, and a heavy job waiting for a GPU's heavy slot does not hold back
the light jobs queued behind it (it did: on 4x H100 the light jobs waited 200 s, then hit the deadline)."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_light_jobs_pass_a_heavy_job_waiting_for_its_slot(monkeypatch):
    gc = load_gpu_check()
    step = gc.Step("b_gpu_tests", [])
    jobs = [gc.Job(step, [], f"heavy{i}", 100 - i, True) for i in range(3)]
    jobs += [gc.Job(step, [], f"light{i}", 10 - i, False) for i in range(6)]
    lock, running, started, peak = threading.Lock(), [], {}, {"all": 0, "heavy": 0}

    def fake_run(job, gpus, deadline, nice=0):
        with lock:
            started[job.key] = time.monotonic()
            running.append(job)
            peak["all"] = max(peak["all"], len(running))
            peak["heavy"] = max(peak["heavy"], sum(j.heavy for j in running))
        time.sleep(0.3 if job.heavy else 0.05)
        with lock:
            running.remove(job)
        job.result = {"rc": 0}

    monkeypatch.setattr(gc, "run_job", fake_run)
    gc.run_pool(jobs, ["0"], slots=3, deadline=time.time() + 60)
    assert sorted(started) == sorted(j.key for j in jobs)
    assert peak == {"all": 3, "heavy": 1}
    # every light job ran while the first heavy one did, before the second heavy one started
    assert all(started[f"light{i}"] < started["heavy1"] for i in range(6))
