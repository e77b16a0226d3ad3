"""The engine's defaults against a sweep: offline output tok/s on one request set for each step token
budget (`--max-prefill-tokens`) and running-request limit (`--max-running-requests`), the defaults the
engine chooses (`auto`, `swaserve.sizing`) among them. The set is serving_vs_offline.py's: by default 256
requests, prompts of 102-1024 random token ids, 51-512 outputs, all arriving at once, prefix cache off.

    python benchmarks/defaults_sweep.py --shape 1b                      # GPU: random weights, real shape
    python benchmarks/defaults_sweep.py --shape gemma4-26b-a4b --budgets auto,2048 --running auto,64,128,256
    python benchmarks/defaults_sweep.py --smoke                         # CPU: a tiny shape, seconds

One engine per step budget, built with the default running limit (rebuilt for the sweep's largest
where that is larger: its request table and decode graphs must cover every limit); each limit then runs
the set on it (the scheduler's limit set between runs). A table and one JSON line per point; the last line says whether `auto` reaches 90% of the best.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, hf_config

# The released models' context lengths: what an out-of-the-box engine plans for.
MAX_POSITIONS = {"270m": 32768, "1b": 32768, "4b": 131072, "12b": 131072, "27b": 131072, "gemma4-26b-a4b": 262144}


def request_set(n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                ids: tuple[int, int] = (1000, 20000)) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(*ids) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(n)]


def tiny_config():
    """The smoke mode's model: two Gemma 3 layers (sliding, full), window 16, a 2k vocabulary."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def run_set(engine, reqs: list[tuple[list[int], int]], tag: str) -> dict:
    """Every request at once, stepped as `LLM.generate` does (finished outputs only); output tok/s."""
    from swaserve.request import SamplingParams

    retractions = engine.scheduler.retractions_total
    for i, (ids, n_out) in enumerate(reqs):
        engine.add_request(f"{tag}-{i}", ids, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
    peak, steps = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step(finished_only=True)
        peak = max(peak, len(engine.scheduler.running))
        steps += 1
    dt = time.perf_counter() - start
    tokens = sum(n for _, n in reqs)
    return {"output_tok_s": round(tokens / dt, 1), "seconds": round(dt, 2), "steps": steps, "peak_running": peak,
            "retractions": engine.scheduler.retractions_total - retractions}


def sweep_budget(model_dir: str, budget: str, running: list[str], reqs: list, device: str, dtype: str) -> list[dict]:
    from swaserve.engine import Engine

    limits = [int(r) for r in running if r != "auto"]
    opts = {"disable_prefix_cache": True, "load_format": "dummy"}
    if budget != "auto":
        opts["max_prefill_tokens"] = int(budget)
    # Built with the default limit; rebuilt for the sweep's largest where that is larger, so the request
    # table and the decode graphs cover every limit of the sweep.
    engine = Engine(model_dir, device=device, dtype=dtype, detokenize=False, **opts)
    auto = engine.scheduler.config.max_running_requests
    if max(limits, default=0) > auto:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        engine = Engine(model_dir, device=device, dtype=dtype, detokenize=False, **opts,
                        max_running_requests=max(limits))
    step_tokens = engine.scheduler.config.max_prefill_tokens
    print(f"== budget {budget} ({step_tokens} tokens): {engine.startup_line()}", flush=True)
    run_set(engine, reqs[:8], "warmup")  # compiles the set's prompt shapes outside the timing
    rows = []
    for r in running:
        n = auto if r == "auto" else int(r)
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_running_requests=n)
        row = {"budget": budget, "step_tokens": step_tokens, "running": r, "max_running_requests": n,
               **run_set(engine, reqs, f"b{budget}-n{r}")}
        print(json.dumps(row), flush=True)
        rows.append(row)
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", help="1b, 4b, 12b, gemma4-26b-a4b, ... (benchmarks/common.py)")
    ap.add_argument("--budgets", default="auto,2048,4096,8192", help="step token budgets; auto: the engine's default")
    ap.add_argument("--running", default="auto,64,128,256,512", help="running-request limits; auto: the default")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", default="102,1024")
    ap.add_argument("--output-len", default="51,512")
    ap.add_argument("--max-positions", type=int, default=None, help="model context (default: the released model's)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny: a 2-layer model, 6 requests, 2 budgets x 2 limits")
    a = ap.parse_args(argv)
    if a.smoke:
        a.shape, a.budgets, a.running, a.num_requests = "tiny", "auto,24", "auto,4", 6
        a.input_len, a.output_len, a.device = "8,40", "2,6", "cpu"
    reqs = request_set(a.num_requests, tuple(int(x) for x in a.input_len.split(",")),  # type: ignore[arg-type]
                       tuple(int(x) for x in a.output_len.split(",")), a.seed,  # type: ignore[arg-type]
                       (10, 2000) if a.smoke else (1000, 20000))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        cfg = tiny_config() if a.smoke else hf_config(a.shape, a.max_positions or MAX_POSITIONS.get(a.shape, 32768))
        cfg.save_pretrained(d)
        for budget in a.budgets.split(","):
            rows += sweep_budget(d, budget, a.running.split(","), reqs, a.device, a.dtype)
    hw = hardware()
    print(f"\ndefaults_sweep: {a.shape}, {a.num_requests} requests, prompts {a.input_len}, outputs {a.output_len}; {hw}")
    print(f"{'budget':>8} {'step':>6} {'running':>8} {'limit':>6} {'tok/s':>10} {'s':>7} {'peak':>5} {'retract':>7}")
    for r in rows:
        print(f"{r['budget']:>8} {r['step_tokens']:>6} {r['running']:>8} {r['max_running_requests']:>6} "
              f"{r['output_tok_s']:>10,.0f} {r['seconds']:>7.2f} {r['peak_running']:>5} {r['retractions']:>7}")
    best = max(rows, key=lambda r: r["output_tok_s"])
    default = next(r for r in rows if r["budget"] == "auto" and r["running"] == "auto")
    frac = default["output_tok_s"] / best["output_tok_s"]
    print(f"defaults (step {default['step_tokens']}, limit {default['max_running_requests']}): "
          f"{default['output_tok_s']:,.0f} tok/s = {frac:.0%} of the best (step {best['step_tokens']}, limit "
          f"{best['max_running_requests']}: {best['output_tok_s']:,.0f})")
    print(json.dumps({"benchmark": "defaults_sweep", "shape": a.shape, "hardware": hw, "rows": rows,
                      "default_of_best": round(frac, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
