"""Quick GPU consistency check on a random-weight Gemma 3 shape: CUDA-graph decode vs eager Triton
vs the torch-native oracle, greedy tokens for prompts around the window. Prints agreement."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import random_model  # noqa: E402


def run(loaded, dtype, prompts, steps, **opts) -> list[list[int]]:
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    e = Engine(loaded, device="cuda", dtype=dtype, max_running_requests=16, max_context=2048,
               kv_cache_bytes=2 << 30, **opts)
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    done = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert e.memory_stats()["full_tokens_used"] == 0
    del e
    torch.cuda.empty_cache()
    return [done[str(i)] for i in range(len(prompts))]


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "1b"
    g = torch.Generator().manual_seed(0)
    lens = [5, 100, 511, 512, 513, 700, 1100]
    prompts = [torch.randint(10, 200000, (n,), generator=g).tolist() for n in lens]
    for dtype in (torch.float32, torch.bfloat16):
        loaded = random_model(shape, torch.device("cuda"), dtype)
        graph = run(loaded, dtype, prompts, 40)
        eager = run(loaded, dtype, prompts, 40, disable_cuda_graph=True)
        oracle = run(loaded, dtype, prompts, 40, attention_backend="torch_native", disable_cuda_graph=True)
        for n, a, b, c in zip(lens, graph, eager, oracle):
            first = lambda x, y: next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))  # noqa: E731
            print(json.dumps(dict(shape=shape, dtype=str(dtype), prompt=n, graph_vs_eager=first(a, b),
                                  eager_vs_oracle=first(b, c), steps=len(a))), flush=True)
        del loaded
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
