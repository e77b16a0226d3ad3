"""Offline throughput in the nano-vllm shape: 256 requests, prompt lengths uniform in 100-1024
(seeded), 512 output tokens each, EOS ignored, on a random-weight Gemma 3 shape. Reports output tok/s
and the fraction of the decode roofline over the run (sum over the steps that decode of the bytes each
must read ÷ copy bandwidth, over the wall time of the whole run, prefill included), and how the wall
time splits between prefill, mixed (decodes + prefill chunks) and decode steps (host time between
step() returns, by the step finished).

    python benchmarks/offline_throughput.py [--shape 1b] [--runs 2]
    python benchmarks/offline_throughput.py --shape gemma4-26b-a4b --max-running-requests 128 --tp 2 \
        [--enable-expert-parallel]                       # ranks load `--load-format dummy` from a config dir
    python benchmarks/offline_throughput.py --shape mimo-v2-flash --tp 4 --num-requests 0 \
        --decode-table 1,16,64 --table-context 1024     # decode steps at fixed batches, no throughput run
    python benchmarks/offline_throughput.py --smoke     # tiny CPU run (CI)

Under `--tp N` the roofline counts rank 0's bytes (its weights, its K/V heads) against one device's
bandwidth: the ranks read theirs at the same time. `--decode-table` adds, in the same engine, the decode
step at each fixed batch size (that many requests of `--table-context` prompt tokens, `--output-len`
tokens each, EOS ignored): mean time of the pure decode steps, and the fraction of its roofline (the
weights a step of that batch reads, MoE layers only the experts its tokens route to in expectation,
plus the K/V at the mean context).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_device, bench_dtype, copy_bandwidth, decode_step_bytes, hardware, model_dir, new_compiles, now,
    param_bytes, parse_args, random_model,
)

# --profile-bs: the decode steps profiled, after the first few.
PROFILE_AFTER, PROFILE_STEPS = 4, 16
# Step kinds that decode running requests: each reads every weight once for them.
DECODING_KINDS = ("decode", "mixed")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=1,
                    help="repeat the workload in one process (later runs: every kernel already compiled)")
    ap.add_argument("--max-prefill-tokens", type=int, default=16384, help="prefill tokens per step")
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                    help="overlap scheduling (auto: the engine's default, on for CUDA)")
    ap.add_argument("--max-running-requests", type=int, default=None, help="default: --num-requests")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one GPU each)")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="with --tp: each rank holds whole experts (1/N of them) instead of 1/N of every expert")
    ap.add_argument("--decode-table", default="", help="batch sizes, e.g. 1,16,64: the decode step at each")
    ap.add_argument("--table-context", type=int, default=1024, help="prompt tokens of each --decode-table request")
    ap.add_argument("--table-output-len", type=int, default=None,
                    help="output tokens of each --decode-table request (default: --output-len)")
    ap.add_argument("--profile-bs", type=int, default=0,
                    help="a --decode-table batch size whose decode steps are also profiled (rank 0's kernels: "
                         "by part of the step, device busy vs wall, by launch grid)")
    a = parse_args(ap, argv, smoke=dict(shape="tiny", num_requests=6, min_input=8, max_input=48, output_len=6,
                                        runs=2, overlap="on",
                                        max_prefill_tokens=64, decode_table="1,3", table_context=20,
                                        table_output_len=10, profile_bs=3))
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    dev = bench_device(a.smoke)
    dtype = bench_dtype(dev)
    bw = copy_bandwidth(dev)
    overlap = {"auto": None, "on": True, "off": False}[a.overlap]
    if a.tp > 1 or a.enable_expert_parallel:  # each rank builds its own shard: a config directory, dummy weights
        source: object = model_dir(a.shape)
        parallel = {"load_format": "dummy", "tensor_parallel_size": a.tp,
                    "enable_expert_parallel": a.enable_expert_parallel}
    else:
        source, parallel = random_model(a.shape, dev, dtype), {}
    table = [int(b) for b in a.decode_table.split(",") if b]
    running = max([a.max_running_requests or a.num_requests, *table])
    engine = Engine(source, device=dev, dtype=dtype, max_running_requests=running,
                    max_context=max(a.max_input + a.output_len, a.table_context + table_out(a)) + 8, max_prefill_tokens=a.max_prefill_tokens,
                    overlap_schedule=overlap, **parallel)
    rng = random.Random(a.seed)
    lens = [rng.randint(a.min_input, a.max_input) for _ in range(a.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    weights = param_bytes(engine.runner.model)  # rank 0's
    cfg = engine.model_config
    full_b, swa_b, W = cfg.full_group.bytes_per_token(dtype), cfg.swa_group.bytes_per_token(dtype), cfg.sliding_window or 0
    # warm-up (graphs are captured at start; this warms the prefill kernels)
    warm = list(range(10, 10 + min(290, a.max_input)))
    engine.add_request("warm", warm, SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    for run in range(a.runs if a.num_requests else 0):
        r = one_run(engine, a, lens, params, rng, dev, bw, weights, full_b, swa_b, W)
        layout = {"tp": a.tp, "expert_parallel": a.enable_expert_parallel,
                  "max_running_requests": a.max_running_requests or a.num_requests}
        print(json.dumps(dict(run=run, **layout, **r)))
        print(f"\noffline {a.shape} tp={a.tp}{' ep' if a.enable_expert_parallel else ''}: "
              f"{a.num_requests} reqs, in {a.min_input}-{a.max_input}, out {a.output_len}: "
              f"{r['out_tok_per_s']} out tok/s, {r['roofline_frac'] * 100:.1f}% of roofline over the run, "
              f"{r['seconds']:.1f} s (prefill steps {r['prefill_s']} s, mixed steps {r['mixed_s']} s, "
              f"decode steps {r['decode_s']} s); Triton compiles during the run: "
              f"{r['compiles_during_run'] or 'none'}", flush=True)
    if table:
        print_decode_table(engine, a, table, dev, dtype, bw)
    engine.close()


def table_out(a) -> int:
    return a.table_output_len or a.output_len


def print_decode_table(engine, a, batch_sizes: list[int], dev, dtype, bw: float) -> None:
    """The decode step at each fixed batch: mean wall time of the pure decode steps (every request
    decoding, none prefilling) and its fraction of the roofline (rank 0's bytes)."""
    from types import SimpleNamespace

    from swaserve.request import SamplingParams

    loaded = SimpleNamespace(model=engine.runner.model, config=engine.model_config)
    params = SamplingParams(temperature=0, max_tokens=table_out(a), ignore_eos=True)
    vocab, rng, tp = engine.model_config.vocab_size, random.Random(a.seed + 1), max(a.tp, 1)
    if a.profile_bs and a.profile_bs not in batch_sizes:
        raise SystemExit(f"--profile-bs {a.profile_bs} is not a --decode-table batch size")
    rows = []
    for bs in batch_sizes:
        for i in range(bs):
            engine.add_request(f"table-{bs}-{i}", [rng.randint(10, min(200000, vocab - 1))
                                                   for _ in range(a.table_context)], params)
        times = []
        prof = profiler(dev) if bs == a.profile_bs else None
        profiled: list[float] = []  # the profiled decode steps' wall times
        started = False
        while engine.has_unfinished():
            # Profile up to 16 pure decode steps, a few steps in (the first ones wait for the prefill).
            if prof is not None and not started and len(times) == PROFILE_AFTER:
                prof.start()
                started = True
            t = time.perf_counter()
            engine.step(finished_only=True)
            if engine.last_step is not None and engine.last_step[0] == "decode":
                times.append(time.perf_counter() - t)
                if started and prof is not None:
                    profiled.append(times[-1])
            if started and prof is not None and (len(profiled) == PROFILE_STEPS or not engine.has_unfinished()):
                prof.stop()
                print_profile(prof, a, bs, profiled)
                prof = None
        times = times[2:] or times  # the first decode steps after the prefill wait for it (overlap)
        if not times:
            raise SystemExit(f"decode table: no pure decode step at batch {bs} (raise --table-output-len)")
        step_s = sum(times) / len(times)
        ctx = a.table_context + table_out(a) // 2
        # Rank 0's share: its weights as held, its K/V heads (the heads split evenly over the ranks).
        weights = decode_step_bytes(loaded, bs, 0, dtype)
        kv = decode_step_bytes(loaded, bs, ctx, dtype) - weights
        roof_s = (weights + kv // tp) / bw
        rows.append((bs, step_s * 1e3, bs / step_s, roof_s / step_s))
        print(json.dumps({"decode_table": True, "shape": a.shape, "tp": a.tp, "bs": bs, "ctx": ctx,
                          "step_ms": round(step_s * 1e3, 3), "roofline_frac": round(roof_s / step_s, 3),
                          "steps": len(times), "hardware": hardware()}), flush=True)
    print(f"\ndecode steps, {a.shape} tp={a.tp}{' ep' if a.enable_expert_parallel else ''}, prompts of "
          f"{a.table_context} tokens, {table_out(a)} out ({dev}):")
    print(f"{'bs':>4} {'step ms':>9} {'tok/s':>9} {'of roofline':>12}")
    for bs, ms, tok_s, frac in rows:
        print(f"{bs:>4} {ms:>9.2f} {tok_s:>9.1f} {frac * 100:>11.1f}%")


def profiler(dev):
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU])


def print_profile(prof, a, bs: int, step_times: list[float]) -> None:
    """Rank 0's decode step at batch bs: kernel time by part of the step against the wall time, then
    the largest kernels by launch grid."""
    from profiling import by_launch_shape, kernel_events, step_breakdown

    events = kernel_events(prof)
    print(f"\nprofile: {a.shape} tp={a.tp}{' ep' if a.enable_expert_parallel else ''}, decode bs {bs}, rank 0")
    print(step_breakdown(events, len(step_times), sum(step_times)))
    print(by_launch_shape(prof, 20, events), flush=True)


def one_run(engine, a, lens, params, rng, dev, bw, weights, full_b, swa_b, W) -> dict:
    """Submit every request, step until all finish; the run's numbers."""
    from swaserve.kernels.common import compiled_variants

    retractions_before = engine.stats.retractions_total
    vocab = engine.model_config.vocab_size
    for i, n in enumerate(lens):
        prompt = [rng.randint(10, min(200000, vocab - 1)) for _ in range(n)]
        engine.add_request(f"{rng.random()}-{i}", prompt, params)
    compiled_before = compiled_variants()
    steps = 0
    kinds: dict[str, int] = defaultdict(int)  # steps launched, by kind (decode, extend, mixed)
    by_kind: dict[str, float] = defaultdict(float)  # time between step() returns, by the step finished
    launched_before = None
    t0 = t_prev = now(dev)
    while engine.has_unfinished():
        # No per-step sync (with overlap the host runs a step ahead); only finished outputs, as
        # LLM.generate asks for.
        engine.step(finished_only=True)
        steps += 1
        if engine.last_step is not None:
            kinds[engine.last_step[0]] += 1
        # With overlap a call returns once the step launched by the previous call is done.
        finished = launched_before if engine.overlap else engine.last_step
        launched_before = engine.last_step
        t = time.perf_counter()
        if finished is not None:
            by_kind[finished[0]] += t - t_prev
        t_prev = t
    dt = now(dev) - t0
    # The roofline of the decode work done: every step that decodes reads all weights once, and each
    # decoded token reads its request's K/V (positions n .. n+out-2 of a prompt of n decode; the
    # first output token comes from the prefill).
    decode_steps = sum(kinds[k] for k in DECODING_KINDS)
    kv = sum(full_b * (pos + 1) + swa_b * min(pos + 1, W) for n in lens for pos in range(n, n + a.output_len - 1))
    roof_s = (decode_steps * weights + kv) / bw
    decoding_s = sum(by_kind[k] for k in DECODING_KINDS)
    total_out = a.num_requests * a.output_len
    return dict(shape=a.shape, requests=a.num_requests, output_tokens=total_out, seconds=round(dt, 2),
                out_tok_per_s=round(total_out / dt, 1), roofline_frac=round(roof_s / dt, 3), steps=steps,
                steps_by_kind=dict(kinds), decode_steps=decode_steps, prefill_s=round(by_kind["extend"], 2),
                mixed_s=round(by_kind["mixed"], 2), decode_s=round(by_kind["decode"], 2),
                # over the time of the steps that decode (mixed ones include their prefill chunks' work)
                decode_roofline_frac=round(roof_s / decoding_s, 3) if decoding_s else None,
                retractions=engine.stats.retractions_total - retractions_before,
                compiles_during_run=new_compiles(compiled_before, compiled_variants()), hardware=hardware())


if __name__ == "__main__":
    main()
