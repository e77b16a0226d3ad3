"""CPU graph runner (torch.compile per captured batch size) vs eager decode on the embedded model:
decode step time at a few batch sizes, plus the one-off compile time.

    python benchmarks/cpu_graph.py [--batch-sizes 1,4,16] [--steps 16] [--model PATH]
    python benchmarks/cpu_graph.py --smoke     # tiny random model, dynamo's eager backend (CI)

`--compile-backend inductor` (the default) is the engine's own `--enable-cpu-graph`; another backend
(`eager`: dynamo's tracing only, no code generation, seconds instead of minutes) installs the same
graph runner with it, as the decode-graph tests do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_args, random_model  # noqa: E402


def decode_ms(model, enable: bool, batch_sizes: list[int], steps: int,
              backend: str) -> tuple[dict[int, float], float]:
    from swaserve import LLM, SamplingParams

    t = time.perf_counter()
    engine_graph = enable and backend == "inductor"
    llm = LLM(model=model, device="cpu", enable_cpu_graph=engine_graph, max_running_requests=max(batch_sizes))
    e, out = llm.engine, {}
    if enable and not engine_graph:
        from swaserve.runner.cpu_graph import CpuGraphRunner

        e.runner.graph_runner = CpuGraphRunner(e.runner, max(batch_sizes), compile_backend=backend)
    setup = time.perf_counter() - t
    for bs in batch_sizes:
        for i in range(bs):
            # Tokens to the context limit: no request may finish during the timed steps.
            params = SamplingParams(temperature=0, max_tokens=e.scheduler.max_context - 128, ignore_eos=True)
            e.add_request(f"{bs}-{i}", list(range(2 + i, 130 + i)), params)
        while e.scheduler.waiting or any(r.pending > 1 for r in e.scheduler.running):
            e.step()
        e.step()
        t = time.perf_counter()
        for _ in range(steps):
            e.step()
            assert e.last_step == ("decode", bs, bs), e.last_step
        out[bs] = (time.perf_counter() - t) / steps * 1e3
        for i in range(bs):
            e.abort(f"{bs}-{i}")
    return out, setup


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the graph runner")
    a = parse_args(ap, argv, smoke=dict(batch_sizes="1", steps=2, compile_backend="eager"))
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    model = a.model
    if a.smoke and a.model is None:
        model = random_model("tiny", torch.device("cpu"), torch.float32)
    name = "random tiny Gemma 3" if model is not a.model else (a.model or "embedded Gemma 3 270M")
    print(f"# CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, {name} fp32, "
          f"graphs compiled by {a.compile_backend}")
    eager, t_e = decode_ms(model, False, sizes, a.steps, a.compile_backend)
    graph, t_g = decode_ms(model, True, sizes, a.steps, a.compile_backend)
    for bs in sizes:
        print(json.dumps(dict(bs=bs, eager_ms=round(eager[bs], 1), cpu_graph_ms=round(graph[bs], 1),
                              speedup=round(eager[bs] / graph[bs], 3), backend=a.compile_backend)))
    print(f"engine setup: eager {t_e:.1f} s, with CPU graphs {t_g:.1f} s (compile + capture)")


if __name__ == "__main__":
    main()
