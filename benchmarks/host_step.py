"""Host cost of one engine step at many running requests, on any machine: the model is replaced by a
stub that returns zero logits, so what is timed is scheduling, input building, sampling, output
processing and output reporting — the Python work that must stay under the GPU step for overlap
scheduling to hide it. Requests have random prompt lengths (so SWA eviction is spread over steps)
and never finish during the timing.

`--schema`: every request under a JSON schema (structured outputs, the embedded tokenizer's 262k
vocabulary, overlap scheduling as on a GPU), the stub writing `{"text": "` then the same in-string token
forever (what the grammar allows: 0 refused, checked), beside the same requests unconstrained: the host
work a constrained step adds (accept, mask fill on the worker, masked sampling's bookkeeping) on this
machine's cores.

    python benchmarks/host_step.py [--requests 256] [--finished-only] [--steps 150] [--rounds 7]
    python benchmarks/host_step.py --schema [--profile]   # constrained vs not, overlap on
    python benchmarks/host_step.py [--schema] --phases    # the step loop's time by part (step_phases.py)
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


def tiny_gemma3(tokenizer=None):
    """A one-layer Gemma 3 with a 512-token vocabulary (the tokenizer's, given one): real engine plumbing,
    negligible compute."""
    from transformers import Gemma3TextConfig

    from swaserve.loader import LoadedModel
    from swaserve.model_config import ModelConfig
    from swaserve.models.registry import build_model

    vocab = 512 if tokenizer is None else 262144  # (the embedded tokenizer's logits width)
    hf = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=1,
                          num_key_value_heads=1, head_dim=32, intermediate_size=64, sliding_window=512,
                          layer_types=["sliding_attention", "full_attention"], max_position_embeddings=8192)
    hf.architectures = ["Gemma3ForCausalLM"]
    config = ModelConfig.from_hf(hf)
    model = build_model(config, torch.float32, "cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return LoadedModel(config, model, tokenizer, "tiny-gemma3")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--finished-only", action="store_true", help="step(finished_only=True), as LLM.generate")
    ap.add_argument("--steps", type=int, default=150, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-prompt", type=int, default=1024, help="prompt lengths uniform in 100..this")
    ap.add_argument("--schema", action="store_true", help="constrained (a JSON schema) against unconstrained")
    ap.add_argument("--profile", action="store_true", help="--schema: each mode once more under cProfile")
    ap.add_argument("--phases", action="store_true",
                    help="time each part of the step loop (wall and the loop thread's CPU, step_phases.py)")
    a = parse_args(ap, argv, smoke=dict(requests=8, steps=3, rounds=2, max_prompt=160))
    if a.schema:
        rows = [host_step(a, schema) for schema in (False, True)]
        print(f"host step, {a.requests} running requests, overlap on (medians of {a.rounds} rounds of {a.steps} "
              f"steps): unconstrained {rows[0]['median_ms']:.3f} ms, JSON schema {rows[1]['median_ms']:.3f} ms, of "
              f"which not waiting for masks {rows[1]['loop_own_median_ms']:.3f} ms")
        if a.phases:
            from step_phases import phase_table

            print(phase_table({("JSON schema" if r["schema"] else "unconstrained"): r["phases"] for r in rows}))
        return
    row = host_step(a, False)
    print(f"host step, {a.requests} running requests, finished_only={a.finished_only}: "
          f"median {row['median_ms']:.3f} ms, min {row['min_ms']:.3f} ms ({a.rounds} rounds of {a.steps} steps)")
    if a.phases:
        from step_phases import phase_table

        print(phase_table({"step": row["phases"]}))


SCRIPT = [14937, 1005, 1083, 623]  # '{"text": "' in the embedded tokenizer
IN_STRING = 50354  # 'aaaa'


def host_step(a: argparse.Namespace, schema: bool) -> dict:
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    tokenizer = None
    if schema:
        from swaserve.structured_outputs import StructuredOutputs
        from swaserve.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(None)
    steps = a.steps * (a.rounds + 1) + 32
    prompt_len = 100 if schema else None  # (one prefill step: every row then at the same place in the script)
    engine = Engine(tiny_gemma3(tokenizer), device="cpu", dtype=torch.float32, max_running_requests=a.requests,
                    max_context=a.max_prompt + steps + 64, max_prefill_tokens=max(16384, 100 * a.requests),
                    overlap_schedule=True if a.schema else None, detokenize=False)
    rng = random.Random(0)
    so = StructuredOutputs(json={"type": "object", "properties": {"text": {"type": "string"}},
                                 "required": ["text"]}) if schema else None
    hidden = torch.zeros(a.requests, 8)
    calls = [0]

    def greedy(h, masks=None):  # the scripted tokens (constrained), or zeros
        k = calls[0]
        calls[0] += 1
        tok = (SCRIPT[k] if k < len(SCRIPT) else IN_STRING) if schema else 0
        return torch.full((h.shape[0],), tok, dtype=torch.int64)

    engine.runner.forward_hidden = lambda fb, token_indices=None: hidden[: fb.batch_size]  # stubs: host work only
    engine.runner.greedy_tokens = greedy
    # --schema steps as the server's engine core does (`step_deltas`: what each step added)
    step = engine.step_deltas if a.schema else lambda: engine.step(finished_only=a.finished_only)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, structured_outputs=so)
    for i in range(a.requests):
        n = prompt_len or rng.randint(100, a.max_prompt)
        engine.add_request(str(i), [rng.randint(10, 500) for _ in range(n)], params)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(5):
        step()
    timer = None
    if a.phases:
        from step_phases import PhaseTimer

        timer = PhaseTimer(engine)
        step = engine.step_deltas if a.schema else lambda: engine.step(finished_only=a.finished_only)  # (wrapped)
    times, waits = [], []
    for _ in range(a.rounds):
        w0 = engine.launcher.mask_wait_seconds
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
        times.append((time.perf_counter() - t) / a.steps * 1e3)
        waits.append((engine.launcher.mask_wait_seconds - w0) / a.steps * 1e3)
    phases = timer.take(a.steps * a.rounds) if timer is not None else None
    if timer is not None:
        timer.close()
    if a.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.steps):
            step()
        prof.disable()
        print(f"== host profile, {'JSON schema' if schema else 'unconstrained'} (tottime)")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(20)
    own = sorted(t - w for t, w in zip(times, waits))  # the loop's own time: not waiting for the mask fill
    times.sort()
    counters = engine.counters()
    assert len(engine.scheduler.running) == a.requests, "requests finished during the timing"
    assert counters["grammar_rejected_tokens_total"] == 0, "a scripted token was refused"
    row = dict(requests=a.requests, schema=schema, finished_only=a.finished_only, rounds=a.rounds, steps=a.steps,
               median_ms=round(times[len(times) // 2], 3), min_ms=round(times[0], 3),
               loop_own_median_ms=round(own[len(own) // 2], 3),
               masked_rows=counters["grammar_masked_rows_total"])
    if phases is not None:
        row["phases"] = phases
    print(json.dumps(row), flush=True)
    engine.close()
    return row


if __name__ == "__main__":
    main()
