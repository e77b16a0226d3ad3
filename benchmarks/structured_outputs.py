"""Structured outputs: the cost of a JSON schema on a full batch. 256 concurrent requests (random
prompts, `--output-len` tokens each) run twice on a Gemma 3 shape with random weights
(`--load-format dummy`) and the embedded model's tokenizer: unconstrained (EOS ignored), then every
request under one JSON schema whose string field lets a random model write to its length. Reports output
tok/s of each run and their ratio (goal: constrained >= 90% of unconstrained), TTFT (p50/p99, from
submission to the step that returned the first token), the host time spent filling masks (mostly on the
fill worker's thread) and what of it the step loop waited for, the time it waited for the device to return
a step's tokens (near 0 where the host is the limit), the tokens a grammar refused (0, else the run fails),
and the schema's compile time cold (first compile; xgrammar's vocabulary table reported apart) and cached.
`--temperature T` times sampled runs (greedy by default). `--fill-threads 2,4,8` runs the
constrained set again at each most-threads setting of the mask fill (`grammar_threads`). `--repeat` rounds
run every mode in turn; the table shows each mode's median run (one run of each varied by up to a third
between rounds on one GPU host). The engine runs
as the server's engine core runs it (`detokenize=False`: its frontends turn tokens into text in their own
processes); `--detokenize` runs it as `LLM.generate` does (text built in the step loop).

    python benchmarks/structured_outputs.py [--shape 1b] [--num-requests 256] [--output-len 256]
    python benchmarks/structured_outputs.py --smoke     # tiny CPU run (CI)
    python benchmarks/structured_outputs.py --host-only [--num-requests 256]   # no model: accept + fill
                                                        # per row on this host (grammar_host.py)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, bench_dtype, hardware, model_dir, now, parse_args

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "text": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["id", "text", "tags"], "additionalProperties": False}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the timed runs' temperature (0: greedy); > 0 draws in the LM head, the masks applied there")
    ap.add_argument("--fill-threads", default="",
                    help="comma list: the constrained run again with each most-threads setting (grammar_threads)")
    ap.add_argument("--accept-in-loop", action="store_true",
                    help="also run the constrained set with xgrammar's accept in the step loop (as before 2026-11-29), "
                         "not on the mask worker")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads first (the host's intra-op pool beside the mask fill threads)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds of every mode in turn; the table shows each mode's median run")
    ap.add_argument("--detokenize", action="store_true",
                    help="build each sequence's text in the step loop (LLM.generate), not in frontends (served)")
    ap.add_argument("--profile", action="store_true",
                    help="also run each mode once more under cProfile and print its top host functions")
    ap.add_argument("--phases", action="store_true",
                    help="time each part of the step loop (wall and the loop thread's CPU, step_phases.py) in every "
                         "run; a table of the median runs' phases")
    ap.add_argument("--host-only", action="store_true", help="no model: the host's accept and mask fill per row")
    ap.add_argument("--steps", type=int, default=16, help="--host-only: steps timed per round")
    ap.add_argument("--rounds", type=int, default=3, help="--host-only: rounds (the best is reported)")
    a = parse_args(ap, argv, smoke=dict(shape="tiny", num_requests=4, input_len=12, output_len=6, steps=2, rounds=1,
                                        repeat=2))
    if a.host_only:
        from grammar_host import host_only, report

        report(host_only(SCHEMA, a.num_requests, a.steps, a.rounds, a.seed))
        return
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams
    from swaserve.structured_outputs import StructuredOutputs

    if a.torch_threads:
        import torch

        torch.set_num_threads(a.torch_threads)
    dev = bench_device(a.smoke)
    dtype = bench_dtype(dev)
    engine = Engine(model_dir(a.shape, tokenizer="embedded"), device=dev, dtype=dtype, load_format="dummy",
                    max_running_requests=a.num_requests, max_context=a.input_len + a.output_len + 8,
                    detokenize=a.detokenize)
    spec = StructuredOutputs(json=SCHEMA)
    t = time.perf_counter()
    engine._compile_constraint(SamplingParams(structured_outputs=spec))  # the schema, cold (+ vocab table)
    first = time.perf_counter() - t
    grammars = engine.grammars
    assert grammars is not None
    cold_ms, vocab_ms = grammars.last_compile_seconds * 1e3, grammars.vocab_seconds * 1e3
    t = time.perf_counter()
    engine._compile_constraint(SamplingParams(structured_outputs=spec))
    cached_ms = (time.perf_counter() - t) * 1e3
    compile_row = dict(kind="compile", schema_cold_ms=round(cold_ms, 2), vocab_table_ms=round(vocab_ms, 1),
                       first_request_ms=round(first * 1e3, 1), schema_cached_ms=round(cached_ms, 4))
    print(json.dumps(compile_row), flush=True)
    rng = random.Random(a.seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randint(10, min(200_000, vocab - 1)) for _ in range(a.input_len)] for _ in range(a.num_requests)]
    # First-use costs (kernels, graphs at the full batch, the mask path) out of the timed runs: the full
    # batch in each mode for a few tokens (with two requests only, round 0's unconstrained run on an H200
    # took 17.6 ms a step against 3.2-3.7 in the rounds after it, 2026-11-29)
    for so in (None, spec):
        run(engine, prompts, SamplingParams(temperature=a.temperature, max_tokens=8, ignore_eos=so is None,
                                            structured_outputs=so),
            "warm" if so is None else "warm-schema")
    modes = [("unconstrained", None, None, True), ("json_schema", spec, None, True)]
    modes += [(f"json_schema t={t}", spec, int(t), True) for t in a.fill_threads.split(",") if t]
    if a.accept_in_loop:
        modes.append(("json_schema loop accept", spec, None, False))
    runs: dict[str, list[dict]] = {m[0]: [] for m in modes}
    timer = None
    if a.phases:
        from step_phases import PhaseTimer

        timer = PhaseTimer(engine)
    for rep in range(a.repeat):  # the modes in turn, `--repeat` rounds: drift and first-run costs spread evenly
        for name, so, threads, on_worker in modes:
            engine.launcher.grammar_threads = threads  # None: the default
            engine.accept_on_worker = on_worker
            params = SamplingParams(temperature=a.temperature, max_tokens=a.output_len, ignore_eos=so is None,
                                    structured_outputs=so)
            row = measured_run(engine, prompts, params, name, a.shape, timer)
            runs[name].append(row)
            print(json.dumps({**row, "round": rep}), flush=True)
            if a.profile and rep == 0:  # a separate run: the profiler's own cost stays out of the numbers
                profile_run(engine, prompts, params, name)
    rows = [median_row(runs[m[0]]) for m in modes]  # each mode's run of median tok/s
    base, constrained = rows[:2]
    ratio = constrained["out_tok_per_s"] / base["out_tok_per_s"] if base["out_tok_per_s"] else 0.0
    print(json.dumps(dict(kind="summary", tok_per_s_ratio=round(ratio, 3), rounds=a.repeat,
                          ratios_by_round=[round(c["out_tok_per_s"] / b["out_tok_per_s"], 3)
                                           for b, c in zip(runs["unconstrained"], runs["json_schema"])],
                          hardware=hardware())), flush=True)
    where = "text built in the step loop (LLM.generate)" if a.detokenize else "engine core as served (frontends detokenize)"
    print(f"\nstructured outputs, {a.shape}, {a.num_requests} requests x {a.output_len} tokens, temperature "
          f"{a.temperature:g}, on {hardware()}, {where}:")
    print(f"  {'mode':<22} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tokens':>8} {'step ms':>8} "
          f"{'mask fill ms/step':>18} {'mask wait ms/step':>18} {'device wait ms/step':>20} {'refused':>8}")
    for r in rows:
        print(f"  {r['mode']:<22} {r['out_tok_per_s']:>10} {r['ttft_p50_ms']:>12} {r['ttft_p99_ms']:>12} "
              f"{r['output_tokens']:>8} {r['step_ms']:>8} {r['mask_fill_ms_per_step']:>18} "
              f"{r['mask_wait_ms_per_step']:>18} {r['device_wait_ms_per_step']:>20} {r['rejected_tokens']:>8}")
    print(f"  constrained / unconstrained: {ratio:.1%} (medians of {a.repeat} rounds of the modes in turn); schema compile {cold_ms:.1f} ms cold (vocabulary table "
          f"{vocab_ms:.0f} ms, once per process), {cached_ms * 1e3:.1f} us cached")
    if timer is not None:
        from step_phases import phase_table

        print("\nstep loop by phase, each mode's median run (own time of each part; wall above CPU: off the CPU):")
        print(phase_table({r["mode"]: r["phases"] for r in rows}))
    escaped = sum(r["rejected_tokens"] for rs in runs.values() for r in rs)
    if escaped:  # every token is drawn under its row's mask: a refused one is a bug (e.g. a mask read too early)
        raise SystemExit(f"{escaped} sampled tokens were refused by their grammar")


def measured_run(engine, prompts: list[list[int]], params, name: str, shape: str, timer=None) -> dict:
    """`run` with the engine's counters read around it: mask fill and waits per step; with a
    `step_phases.PhaseTimer`, the step loop's time by phase."""
    if timer is not None:
        timer.take(1)  # (what ran since the last run: warm-up, another mode)
    before = engine.counters()
    row = dict(kind="run", mode=name, shape=shape, **run(engine, prompts, params, name))
    after = engine.counters()
    fill_ms = after["grammar_mask_fill_ms_total"] - before["grammar_mask_fill_ms_total"]
    wait_ms = after["grammar_mask_wait_ms_total"] - before["grammar_mask_wait_ms_total"]
    masked = after["grammar_masked_rows_total"] - before["grammar_masked_rows_total"]
    rejected = after["grammar_rejected_tokens_total"] - before["grammar_rejected_tokens_total"]
    device_ms = after["step_wait_ms_total"] - before["step_wait_ms_total"]
    steps = max(row["steps"], 1)
    row.update(step_ms=round(row["seconds"] * 1e3 / steps, 2), mask_fill_ms_per_step=round(fill_ms / steps, 2),
               mask_fill_us_per_row=round(fill_ms * 1e3 / masked, 1) if masked else 0.0,
               mask_wait_ms_per_step=round(wait_ms / steps, 2), device_wait_ms_per_step=round(device_ms / steps, 2),
               rejected_tokens=rejected)
    if timer is not None:
        row["phases"] = timer.take(steps)
    return row


def median_row(rows: list[dict]) -> dict:
    """The run of median output tok/s (the lower middle one of an even count)."""
    return sorted(rows, key=lambda r: r["out_tok_per_s"])[(len(rows) - 1) // 2]


def profile_run(engine, prompts: list[list[int]], params, tag: str) -> None:
    """`run` under cProfile: the host functions that took the most time of their own (the profiler
    inflates Python-heavy ones, so compare modes with each other, not with the timed rows)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run(engine, prompts, params, f"{tag}-profiled")
    prof.disable()
    print(f"== host profile, {tag} (tottime)", flush=True)
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(22)


def run(engine, prompts: list[list[int]], params, tag: str) -> dict:
    """Submit every prompt at once, step to the end; output tok/s and TTFT. Stepped as the server's engine
    core steps (`step_deltas`: what each step added, O(1) a sequence), not through `step()`, whose
    cumulative outputs of all 256 requests every step made the unconstrained run host-bound by themselves."""
    dev = engine.device
    t0 = now(dev)
    submitted = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished():
        deltas = engine.step_deltas()
        steps += 1
        t = time.perf_counter()
        for d in deltas:
            if d.token_ids and d.request_id not in first:
                first[d.request_id] = t - submitted
            tokens[d.request_id] = tokens.get(d.request_id, 0) + len(d.token_ids)
    dt = now(dev) - t0
    total = sum(tokens.values())
    ttft = sorted(first.values()) or [0.0]
    return dict(requests=len(prompts), output_tokens=total, seconds=round(dt, 3), steps=steps,
                out_tok_per_s=round(total / dt, 1) if dt else 0.0,
                ttft_p50_ms=round(statistics.median(ttft) * 1e3, 1),
                ttft_p99_ms=round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3, 1))


if __name__ == "__main__":
    main()
