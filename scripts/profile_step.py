"""Where a decode step's time goes on the GPU: Engine.step() wall time with and without overlap,
the host parts of a waiting step (schedule, launch, wait, process), pure graph replay, and a
torch.profiler table of GPU kernels.

    python scripts/profile_step.py [shape] [batch size] [context] [engine options as JSON]
    e.g. 1b 64 512, or 4b 64 8192 '{"kv_cache_dtype": "fp8_e4m3", "enable_deterministic_inference": true}'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import fast_paths, random_model


def per_step_ms(engine, n: int, deltas: bool = False) -> float:
    """Wall time of `engine.step()` (or `step_deltas()`, the engine core's: no RequestOutput built)."""
    step = engine.step_deltas if deltas else engine.step
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    from swaserve.engine import Engine
    from swaserve.kernels.pdl import pdl_supported
    from swaserve.request import SamplingParams
    from swaserve.runner.graph_buffers import padded_batch_size

    shape = sys.argv[1] if len(sys.argv) > 1 else "1b"
    bs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    dev = torch.device("cuda")
    e = Engine(random_model(shape, dev, torch.bfloat16), device=dev, dtype=torch.bfloat16,
               max_running_requests=max(bs, 8), max_context=ctx + 1024, max_prefill_tokens=16384, **options)
    for i in range(bs):
        e.add_request(str(i), list(range(10 + i, 10 + i + ctx)),
                      SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
    while e.scheduler.waiting:
        e.step()
    for _ in range(5):
        e.step()
    n = 100
    overlap_ms = per_step_ms(e, n)
    deltas_ms = per_step_ms(e, n, deltas=True)
    e.step()  # drain: with overlap off every step waits for itself
    e.overlap = False
    if e._inflight is not None:
        e._process(e._inflight)
        e._inflight = None
    sync_ms = per_step_ms(e, n)

    parts = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "process": 0.0}
    for _ in range(n):
        t0 = time.perf_counter()
        b = e.scheduler.schedule()
        t1 = time.perf_counter()
        step = e.launcher.launch(b)
        t2 = time.perf_counter()
        tokens, lps = step.wait()
        t3 = time.perf_counter()
        e.scheduler.process_output(b, tokens, lps)
        t4 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[k] += v / n * 1e3
    import cProfile
    import pstats

    prof_host = cProfile.Profile()
    prof_host.enable()
    per_step_ms(e, 50, deltas=True)
    prof_host.disable()
    print("host functions over 50 steps as the engine core steps (step_deltas; tottime):", flush=True)
    pstats.Stats(prof_host).sort_stats("tottime").print_stats(14)
    gr = e.runner.graph_runner
    graph_bs = padded_batch_size(bs, gr.sizes)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        gr.graphs[graph_bs].replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - t) / n * 1e3
    print(f"{shape} bs={bs} ctx={ctx} {options or ''}: step {overlap_ms:.3f} ms with overlap ({deltas_ms:.3f} ms as the engine core "
          f"steps, step_deltas), {sync_ms:.3f} ms waiting; "
          f"pure graph replay {replay_ms:.3f} ms", flush=True)
    print(f"  {fast_paths()}", flush=True)
    print("  waiting step: " + ", ".join(f"{k} {v:.3f} ms" for k, v in parts.items()), flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            gr.graphs[graph_bs].replay()
        torch.cuda.synchronize()
    prof_graph_events = prof.key_averages()
    counts = {ev.key: ev.count / 5 for ev in prof_graph_events}
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60)
    print(table, flush=True)
    kernel_us = sum(getattr(ev, "self_device_time_total", 0) for ev in prof.key_averages()) / 5
    print(f"kernel time per replay {kernel_us / 1e3:.3f} ms vs replay {replay_ms:.3f} ms: "
          f"{(replay_ms - kernel_us / 1e3) * 1e3:.0f} us between kernels"
          + (" (PDL on: kernels start before their predecessor ends and wait on the device, so their"
             " times overlap)" if pdl_supported() else ""), flush=True)

    # The whole step (overlap on, as served): what runs on the GPU besides the graph replay
    # (input copies, the LM head and sampling, token bookkeeping), and how long the GPU idles per step.
    e.overlap = True
    for _ in range(3):
        e.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            e.step()
        torch.cuda.synchronize()
    busy_ms = sum(getattr(ev, "self_device_time_total", 0) for ev in prof.key_averages()) / 5 / 1e3
    host_ms = sync_ms - parts["wait"]  # a waiting step's host work: what overlap must hide
    print(f"whole step with overlap {overlap_ms:.3f} ms: GPU busy {busy_ms:.3f} ms ({busy_ms - kernel_us / 1e3:.3f} ms "
          f"outside the graph), so idle {overlap_ms - busy_ms:.3f} ms; host work per step {host_ms:.3f} ms "
          f"({'host' if host_ms > busy_ms else 'GPU'}-bound)", flush=True)
    graph_names = {ev.key for ev in prof_graph_events}
    # kernels not in the graph, or run more often per step than per replay (their whole time shown)
    outside = [ev for ev in prof.key_averages() if ev.key not in graph_names or ev.count / 5 > counts[ev.key]]
    outside.sort(key=lambda ev: -getattr(ev, "self_device_time_total", 0))
    for ev in [ev for ev in outside if getattr(ev, "self_device_time_total", 0) > 0][:12]:
        print(f"  {getattr(ev, 'self_device_time_total', 0) / 5:8.1f} us/step  {ev.count / 5:5.1f}x  {ev.key[:90]}")


if __name__ == "__main__":
    main()
