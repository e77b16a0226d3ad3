"""Where a decode step's time goes on the GPU: wall time per step split into scheduling, input
copies, graph replay, sampling and output processing, plus a torch.profiler table."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import random_model  # noqa: E402


def main() -> None:
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    shape, bs = (sys.argv[1] if len(sys.argv) > 1 else "1b"), int(sys.argv[2]) if len(sys.argv) > 2 else 1
    dev = torch.device("cuda")
    loaded = random_model(shape, dev, torch.bfloat16)
    e = Engine(loaded, device=dev, dtype=torch.bfloat16, max_running_requests=max(bs, 8), max_context=2048)
    print("graph runner:", type(e.runner.graph_runner).__name__, flush=True)
    for i in range(bs):
        e.add_request(str(i), list(range(10, 522)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    while e.scheduler.waiting:
        e.step()
    for _ in range(5):
        e.step()
    parts = {"schedule": 0.0, "to_forward_batch": 0.0, "forward": 0.0, "sample+sync": 0.0, "process": 0.0}
    n = 50
    sched, runner = e.scheduler, e.runner
    from swaserve.runner.sampler import SamplingBatch

    for _ in range(n):
        t0 = time.perf_counter()
        b = sched.schedule()
        t1 = time.perf_counter()
        fb = b.to_forward_batch(dev)
        t2 = time.perf_counter()
        logits = runner.forward(fb)
        t3 = time.perf_counter()
        reqs = b.reqs
        sb = SamplingBatch.build([r.params for r in reqs], [r.output_ids for r in reqs],
                                 [r.ids[: r.prompt_len] for r in reqs], logits.shape[-1], dev)
        toks = e.sampler(logits, sb).next_token_ids.tolist()
        t4 = time.perf_counter()
        sched.process_output(b, toks)
        t5 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            parts[k] += v / n * 1e3
    print(f"{shape} bs={bs}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in parts.items()), flush=True)
    from swaserve.runner.graph_buffers import padded_batch_size

    graph_bs = padded_batch_size(bs, runner.graph_runner.sizes)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        runner.graph_runner.graphs[graph_bs].replay()
    torch.cuda.synchronize()
    print(f"pure graph replay: {(time.perf_counter() - t) / n * 1e3:.3f} ms", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            e.step()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
