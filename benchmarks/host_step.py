"""Host cost of one engine step at many running requests, on any machine: the model is replaced by a
stub that returns zero logits, so what is timed is scheduling, input building, sampling, output
processing and output reporting — the Python work that must stay under the GPU step for overlap
scheduling to hide it. Requests have random prompt lengths (so SWA eviction is spread over steps)
and never finish during the timing.

    python benchmarks/host_step.py [--requests 256] [--finished-only] [--steps 150] [--rounds 7]
    python benchmarks/host_step.py --smoke     # tiny run (CI)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_args  # noqa: E402


def tiny_gemma3():
    """A one-layer Gemma 3 with a 512-token vocabulary: real engine plumbing, negligible compute."""
    from transformers import Gemma3TextConfig

    from swaserve.loader import LoadedModel
    from swaserve.model_config import ModelConfig
    from swaserve.models.registry import build_model

    hf = Gemma3TextConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=1,
                          num_key_value_heads=1, head_dim=32, intermediate_size=64, sliding_window=512,
                          layer_types=["sliding_attention", "full_attention"], max_position_embeddings=8192)
    hf.architectures = ["Gemma3ForCausalLM"]
    config = ModelConfig.from_hf(hf)
    model = build_model(config, torch.float32, "cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return LoadedModel(config, model, None, "tiny-gemma3")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--finished-only", action="store_true", help="step(finished_only=True), as LLM.generate")
    ap.add_argument("--steps", type=int, default=150, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-prompt", type=int, default=1024, help="prompt lengths uniform in 100..this")
    a = parse_args(ap, argv, smoke=dict(requests=8, steps=3, rounds=2, max_prompt=160))
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    engine = Engine(tiny_gemma3(), device="cpu", dtype=torch.float32, max_running_requests=a.requests,
                    max_context=a.max_prompt + a.steps * (a.rounds + 1) + 64, max_prefill_tokens=16384)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=a.steps * (a.rounds + 1) + 32, ignore_eos=True)
    for i in range(a.requests):
        prompt = [rng.randint(10, 500) for _ in range(rng.randint(100, a.max_prompt))]
        engine.add_request(str(i), prompt, params)
    while engine.scheduler.waiting:
        engine.step()
    hidden = torch.zeros(a.requests, 8)
    tokens = torch.zeros(a.requests, dtype=torch.int64)
    engine.runner.forward_hidden = lambda fb, token_indices=None: hidden[: fb.batch_size]  # the stubs: host work only
    engine.runner.greedy_tokens = lambda h: tokens[: h.shape[0]]
    for _ in range(5):
        engine.step(finished_only=a.finished_only)
    times = []
    for _ in range(a.rounds):
        t = time.perf_counter()
        for _ in range(a.steps):
            engine.step(finished_only=a.finished_only)
        times.append((time.perf_counter() - t) / a.steps * 1e3)
    times.sort()
    assert len(engine.scheduler.running) == a.requests, "requests finished during the timing"
    print(json.dumps(dict(requests=a.requests, finished_only=a.finished_only, rounds=a.rounds, steps=a.steps,
                          median_ms=round(times[len(times) // 2], 3), min_ms=round(times[0], 3))))
    print(f"host step, {a.requests} running requests, finished_only={a.finished_only}: "
          f"median {times[len(times) // 2]:.3f} ms, min {times[0]:.3f} ms ({a.rounds} rounds of {a.steps} steps)")


if __name__ == "__main__":
    main()
