"""CPU graph runner (torch.compile per captured batch size) vs eager decode on the embedded model:
decode step time at a few batch sizes, plus the one-off compile time."""

from __future__ import annotations

import json
import time

import torch


def decode_ms(enable: bool, batch_sizes: list[int], steps: int = 16) -> tuple[dict[int, float], float]:
    from swaserve import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(device="cpu", enable_cpu_graph=enable, max_running_requests=max(batch_sizes))
    setup = time.perf_counter() - t
    e, out = llm.engine, {}
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


def main() -> None:
    sizes = [1, 4, 16]
    print(f"# CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, embedded Gemma 3 270M fp32")
    eager, t_e = decode_ms(False, sizes)
    graph, t_g = decode_ms(True, sizes)
    for bs in sizes:
        print(json.dumps(dict(bs=bs, eager_ms=round(eager[bs], 1), cpu_graph_ms=round(graph[bs], 1),
                              speedup=round(eager[bs] / graph[bs], 3))))
    print(f"engine setup: eager {t_e:.1f} s, with CPU graphs {t_g:.1f} s (compile + capture)")


if __name__ == "__main__":
    main()
