"""Deterministic inference (issue 17): what the mode costs and whether it holds, in one call.

    PYTHONPATH=. python benchmarks/deterministic.py --model DIR [--batch-sizes 1,64,256] [--ctx 1024]
    PYTHONPATH=. python benchmarks/deterministic.py --model DIR --probes [--num-probes 64 --others 100]
    PYTHONPATH=. python benchmarks/deterministic.py --model gemma4-26b-a4b --tp 2 [--probes]   # 2 GPUs
    PYTHONPATH=. python benchmarks/deterministic.py --smoke [--probes --control]     # tiny CPU run (CI)

DIR is an HF directory (config.json is enough: weights are random, --load-format dummy) or a shape
name of benchmarks/common.py (1b, 4b, gemma4-26b-a4b). Cost (default): decode step time at each
batch size (bs requests of --ctx prompt tokens, prefilled untimed, then --steps whole-batch steps
through Engine.step) and offline throughput (--requests random requests), mode off then on, and
with --profile the top GPU kernels of a bs-64 decode step in each mode (where the time goes).
Probes: --num-probes prompts (some longer than the window) run alone, then together with --others
requests in a shuffled batch, greedy and seeded: prints k/N identical (mode on, and off as control).
JSON lines per point, a table at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import empty_cache, model_dir, parse_args, random_model  # noqa: E402
from probes import drain  # noqa: E402
from profiling import by_launch_shape  # noqa: E402


def load(model: str, device: torch.device, dtype: torch.dtype, tp: int = 1):
    """The model every engine of the run serves: loaded once (random weights), or under tensor
    parallelism a config directory each engine's ranks draw the same weights from (`.config` either way)."""
    from swaserve.loader import load_hf_config, load_model
    from swaserve.model_config import ModelConfig

    if tp > 1:
        path = model if Path(model).is_dir() else model_dir(model)
        return SimpleNamespace(path=path, config=ModelConfig.from_hf(load_hf_config(path)))
    if Path(model).is_dir():
        return load_model(model, device, dtype, load_format="dummy")
    return random_model(model, device, dtype)


def make_engine(loaded, device, dtype, deterministic: bool, args):
    from swaserve.engine import Engine

    source = getattr(loaded, "path", loaded)
    parallel = {"load_format": "dummy", "tensor_parallel_size": args.tp} if args.tp > 1 else {}
    return Engine(source, device=device, dtype=dtype, enable_deterministic_inference=deterministic,
                  max_running_requests=args.max_running, max_prefill_tokens=args.chunk,
                  max_context=args.max_context, **parallel,
                  **({"kv_cache_bytes": args.kv_mb << 20} if args.kv_mb else {}))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step_ms(engine, vocab: int, bs: int, ctx: int, steps: int, rng: random.Random,
                   around=contextlib.nullcontext()) -> float:
    """Decode step time at batch bs (prompts prefilled untimed); `around` wraps the timed steps only.
    No request may finish before the timed steps end (the mixed policy decodes the first prompts
    while it prefills the others): max_tokens runs to the context limit, and every timed step is
    checked to be a decode of the whole batch."""
    from swaserve.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=engine.scheduler.max_context - ctx, ignore_eos=True)
    ids = [f"d{bs}-{i}" for i in range(bs)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(2, vocab) for _ in range(ctx)], params)
    while engine.scheduler.waiting or any(r.pending > 1 for r in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    sync(engine.device)
    with around:
        t0 = time.perf_counter()
        shapes = []
        for _ in range(steps):
            engine.step()
            shapes.append(engine.last_step)
        sync(engine.device)
        dt = (time.perf_counter() - t0) / steps
    assert all(sh == ("decode", bs, bs) for sh in shapes), f"not all timed steps decoded {bs}: {set(shapes)}"
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return dt * 1e3


def offline_tok_s(engine, vocab: int, n: int, rng: random.Random, max_context: int) -> float:
    """Greedy requests of 64-1024 prompt and 32-256 output tokens (shrunk to fit max_context)."""
    from swaserve.request import SamplingParams

    p_hi, o_hi = min(1024, max_context // 2), min(256, max_context // 4)
    reqs = [(f"o{i}", [rng.randrange(2, vocab) for _ in range(rng.randrange(min(64, p_hi - 1), p_hi))],
             SamplingParams(temperature=0, max_tokens=rng.randrange(min(32, o_hi - 1), o_hi), ignore_eos=True))
            for i in range(n)]
    sync(engine.device)
    t0 = time.perf_counter()
    out = drain(engine, reqs)
    sync(engine.device)
    return sum(len(t) for t in out.values()) / (time.perf_counter() - t0)


def profile_decode(engine, vocab: int, bs: int, ctx: int, rng: random.Random) -> str:
    from torch.profiler import ProfilerActivity, profile

    decode_step_ms(engine, vocab, bs, ctx, 4, rng)  # warm
    prof = profile(activities=[ProfilerActivity.CUDA])
    decode_step_ms(engine, vocab, bs, ctx, 8, rng, around=prof)  # the decode steps only, not the prefill
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=16) + "\n" + by_launch_shape(prof)


def profile_offline(engine, vocab: int, n: int, rng: random.Random, max_context: int) -> str:
    """Kernel time of an offline run of n requests (where its throughput goes: prefill and decode), by
    kernel name, then by launch grid (the 30 largest: a GEMM's grid follows the step's tokens)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        offline_tok_s(engine, vocab, n, rng, max_context)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=20) + "\n" + by_launch_shape(prof, 30)


def run_cost(args, loaded, device, dtype) -> None:
    vocab = loaded.config.vocab_size
    rows = []
    for det in (False, True):  # off first: the mode switches the model's layers in place
        engine = make_engine(loaded, device, dtype, det, args)
        rng = random.Random(args.seed)
        point = {"deterministic": det}
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            point[f"step_ms_bs{bs}"] = round(decode_step_ms(engine, vocab, bs, args.ctx, args.steps, rng), 3)
        point["offline_tok_s"] = round(offline_tok_s(engine, vocab, args.requests, rng, args.max_context), 1)
        if args.profile and device.type == "cuda":
            for bs in [int(b) for b in args.profile_bs.split(",")]:
                print(f"--- top kernels, 8 decode steps at bs {bs}, deterministic={det}\n"
                      f"{profile_decode(engine, vocab, bs, args.ctx, rng)}")
            if args.profile_offline:
                n = args.profile_offline
                print(f"--- top kernels, offline run of {n} requests, deterministic={det}\n"
                      f"{profile_offline(engine, vocab, n, rng, args.max_context)}")
        print(json.dumps(point), flush=True)
        rows.append(point)
        engine.close()
        del engine
        gc.collect()
        empty_cache(device)
    off, on = rows
    print(f"\n{'metric':<18} {'off':>10} {'on':>10} {'cost':>8}")
    for k in off:
        if k == "deterministic":
            continue
        worse = on[k] / off[k] if k.startswith("step") else off[k] / on[k]
        print(f"{k:<18} {off[k]:>10} {on[k]:>10} {100 * (worse - 1):>7.1f}%")


def run_probes(args, loaded, device, dtype) -> None:
    from swaserve.request import SamplingParams

    vocab, window = loaded.config.vocab_size, loaded.config.sliding_window or 0
    rng = random.Random(args.seed)
    hi = min(max(args.probe_max_len, window + 64), args.max_context - 160)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(16, hi))] for _ in range(args.num_probes)]
    others = [(f"x{j}", [rng.randrange(2, vocab) for _ in range(rng.randrange(16, hi))],
               SamplingParams(temperature=rng.choice([0.0, 1.0]), ignore_eos=True,
                              max_tokens=rng.randrange(8, args.others_max_tokens + 1),
                              seed=rng.randrange(1 << 30)))
              for j in range(args.others)]
    longer = sum(len(p) > window for p in prompts)
    print(f"{args.num_probes} probes ({longer} longer than the window {window}), {args.others} other requests")
    table = []
    for det in (False, True) if args.control else (True,):  # off first: the mode switches layers in place
        engine = make_engine(loaded, device, dtype, det, args)
        for kind in ("greedy", "seeded"):
            def params(i: int) -> SamplingParams:
                if kind == "greedy":
                    return SamplingParams(temperature=0, max_tokens=args.probe_tokens, ignore_eos=True)
                return SamplingParams(temperature=1.0, top_p=0.95, max_tokens=args.probe_tokens, ignore_eos=True,
                                      seed=1000 + i)
            probes = [(f"p{i}", p, params(i)) for i, p in enumerate(prompts)]
            alone = {}
            for req in probes:
                alone.update(drain(engine, [req]))
            mixed = probes + others
            rng.shuffle(mixed)
            loaded_out = drain(engine, mixed)
            same = sum(loaded_out[rid] == alone[rid] for rid, _, _ in probes)
            row = {"deterministic": det, "sampling": kind, "identical": same, "probes": len(probes)}
            print(json.dumps(row), flush=True)
            table.append(row)
        engine.close()
        del engine
        gc.collect()
    print(f"\n{'mode':<6} {'sampling':<8} identical alone vs under load")
    for r in table:
        print(f"{'on' if r['deterministic'] else 'off':<6} {r['sampling']:<8} {r['identical']}/{r['probes']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF directory (random weights) or a shape name (1b, 4b, ...)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--ctx", type=int, default=1024, help="prompt tokens per request of the decode points")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--requests", type=int, default=512, help="offline throughput requests")
    ap.add_argument("--profile", action="store_true", help="top GPU kernels of decode steps per mode")
    ap.add_argument("--profile-bs", default="64", help="batch sizes profiled with --profile")
    ap.add_argument("--profile-offline", type=int, default=0, metavar="N",
                    help="with --profile: also top kernels of an offline run of N requests per mode")
    ap.add_argument("--probes", action="store_true", help="run the probe check instead of the cost table")
    ap.add_argument("--num-probes", type=int, default=64)
    ap.add_argument("--others", type=int, default=100)
    ap.add_argument("--others-max-tokens", type=int, default=127, help="others' max_tokens: 8 to this")
    ap.add_argument("--probe-tokens", type=int, default=32)
    ap.add_argument("--probe-max-len", type=int, default=1500)
    ap.add_argument("--control", action="store_true", help="probes with the mode off too")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=2048, help="max_prefill_tokens")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--kv-mb", type=int, default=0, help="KV budget in MiB (0: the engine's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one GPU each; deterministic mode "
                    "sums their partials in rank order)")
    args = parse_args(ap, argv, smoke=dict(model="tiny", device="cpu", dtype="float32", batch_sizes="1,3",
                                           ctx=24, steps=2, requests=4, num_probes=3, others=4,
                                           others_max_tokens=10, probe_tokens=4, probe_max_len=48, max_running=8,
                                           chunk=64, max_context=256))
    if args.model is None:
        ap.error("--model is required")

    from swaserve.engine_setup import resolve_device_dtype

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, {args.model}, {dtype}, tp={args.tp}")
    loaded = load(args.model, device, dtype, args.tp)
    (run_probes if args.probes else run_cost)(args, loaded, device, dtype)


if __name__ == "__main__":
    main()
