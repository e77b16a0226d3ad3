"""Served vs offline on one request set: the engine driven in-process (the offline baseline, with the same
arrival times), then `python -m swaserve.server` under a lean SSE load generator (several client
processes), streaming and not. Reports output tok/s, TTFT / ITL / TPOT / E2E p50 and p99, the
served/offline ratio, and the load generator's CPU use (table + one JSON line per row).

    # the issue's H100 set: 256 requests, prompts 102-1024 token ids, 51-512 outputs, ignore_eos
    python benchmarks/serving_vs_offline.py --model /path/to/gemma3-1b-random --num-requests 256
    python benchmarks/serving_vs_offline.py --model DIR --request-rate 40          # Poisson arrivals
    python benchmarks/serving_vs_offline.py --num-requests 8 --max-tokens 16 --input-len 16,64   # CPU smoke
    python benchmarks/serving_vs_offline.py --make-random-model 1b DIR             # a random Gemma 3 dir
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import ttft_breakdown  # noqa: E402
from benchmarks.ttft_breakdown import pct  # noqa: E402
from benchmarks.load_client import Timing, client_proc, one_request  # noqa: E402


def make_requests(args: argparse.Namespace) -> list[tuple[list[int], int, float]]:
    """(prompt ids, max_tokens, arrival offset s) per request; Poisson offsets when --request-rate is set."""
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.input_len.split(","))
    olo, ohi = (int(x) for x in args.output_len.split(","))
    tlo, thi = (int(x) for x in args.token_id_range.split(","))
    t, out = 0.0, []
    for _ in range(args.num_requests):
        n_in = rng.randint(lo, hi)
        n_out = args.max_tokens or rng.randint(olo, ohi)
        out.append(([rng.randrange(tlo, thi) for _ in range(n_in)], n_out, t))
        if args.request_rate != float("inf"):
            t += rng.expovariate(args.request_rate)
    return out


def run_offline(args: argparse.Namespace, reqs: list, engine_opts: dict,
                finished_only: bool = False) -> tuple[list[Timing], float]:
    """The engine in this process, requests added at their arrival times; every step's outputs read,
    or with `finished_only` only finished requests' (how `LLM.generate` steps: no per-token timings,
    the throughput the issue's offline number is)."""
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    engine = Engine(args.model, device=args.device, dtype=args.dtype, detokenize=False, **engine_opts)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # Warm-up on the set's own prompt lengths (a few of them): Triton compiles what those shapes need
    # here, not inside the timed run (the served runs then find the kernels in the on-disk cache).
    for i in range(min(8, len(reqs))):
        engine.add_request(f"warmup{i}", reqs[i][0], warm)
    while engine.has_unfinished():
        engine.step()
    timings = [Timing() for _ in reqs]
    trace_path = os.environ.get("SWASERVE_CORE_TRACE")
    trace = open(f"{trace_path}.offline", "a") if trace_path else None
    start = time.monotonic()
    pending = list(range(len(reqs)))
    while pending or engine.has_unfinished():
        now = time.monotonic()
        while pending and start + reqs[pending[0]][2] <= now:
            i = pending.pop(0)
            ids, n_out, _ = reqs[i]
            # Its scheduled time, as a client stamps it: a request that arrives while a step runs
            # waits for that step here as it does in the served core (stamping `now` hid that wait).
            timings[i].arrival, timings[i].added = start + reqs[i][2], now
            engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
        if not engine.has_unfinished():
            time.sleep(max(0.0, start + reqs[pending[0]][2] - time.monotonic()))
            continue
        t_step = time.monotonic()
        outs = engine.step(finished_only=finished_only)
        now = time.monotonic()
        if trace is not None:  # the engine core's trace format (scripts/core_trace.py)
            trace.write(f"[{t_step:.6f},{now - t_step:.6f},{json.dumps(engine.last_step)},{len(outs)}]\n")
        for out in outs:
            t = timings[int(out.request_id)]
            n = len(out.outputs[0].token_ids)
            if n > t.output_tokens:
                if not finished_only:  # finished-only outputs carry no per-token times
                    t.first = t.first or now
                    t.chunks.append(now)
                t.output_tokens = n
            if out.finished:
                t.end = now
    duration = time.monotonic() - start
    if trace is not None:
        trace.close()
    del engine
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
    return timings, duration


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """(main thread, whole process) CPU seconds of `pid` (Linux /proc; zeros elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def stat(path: str) -> float:
        try:
            fields = open(path).read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / tick

    return stat(f"/proc/{pid}/task/{pid}/stat"), stat(f"/proc/{pid}/stat")


def server_processes(server_pid: int) -> dict[str, int]:
    """{"frontend": pid, "core": pid} of a running `python -m swaserve.server` (the core is its child).
    With `--api-server-count N` the server process only supervises: "frontend", "frontend1", ... are
    its frontend children."""
    try:
        children = [int(c) for c in open(f"/proc/{server_pid}/task/{server_pid}/children").read().split()]
    except OSError:
        children = []
    procs, frontends = {"frontend": server_pid}, []
    for pid in children:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"swaserve.core" in cmd:
            procs.setdefault("core", pid)
        elif b"multiprocessing" in cmd and b"resource_tracker" not in cmd:
            frontends.append(pid)
    for i, pid in enumerate(frontends):
        procs["frontend" if i == 0 else f"frontend{i}"] = pid
    return procs


def warm_up(url: str, model: str, reqs: list, n: int) -> None:
    """`n` streaming requests at once on new connections, so every frontend process behind the port
    (the kernel spreads connections over them) has served one before the clock starts."""
    body = {"model": model, "max_tokens": 4, "ignore_eos": True, "temperature": 0, "stream": True}
    bodies = [json.dumps({**body, "prompt": reqs[i % len(reqs)][0][:32]}).encode() for i in range(n)]

    async def main() -> list[Timing]:
        return await asyncio.gather(*(one_request(url, b, True, time.monotonic()) for b in bodies))

    failed = [t.error for t in asyncio.run(main()) if t.error]
    if failed:
        raise SystemExit(f"warm-up request failed: {failed[0]}")


def run_served(args: argparse.Namespace, base: str, model: str, reqs: list, stream: bool,
               server: dict[str, int] | None = None) -> tuple[list[Timing], float, float, dict[str, float]]:
    """Every request through the server from `--clients` processes; (timings, duration, client CPU s,
    CPU % of one core used meanwhile by each process in `server`: main thread and whole process)."""
    server = server or {}
    cpu0 = {name: _cpu_seconds(pid) for name, pid in server.items()}
    wall0 = time.monotonic()
    ctx = mp.get_context("spawn")
    start = time.monotonic() + 1.0 + 0.2 * args.clients  # the clients' start-up happens before t0
    shares: list[list] = [[] for _ in range(args.clients)]
    for i, (ids, n, at) in enumerate(reqs):
        shares[i % args.clients].append((i, ids, n, at))
    pipes, procs = [], []
    for share in shares:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=client_proc, args=(base + "/completions", model, share, stream, start, child))
        p.start()
        pipes.append(parent)
        procs.append(p)
    timings: list[Timing] = [Timing() for _ in reqs]
    cpu = 0.0
    for share, pipe, p in zip(shares, pipes, procs):
        got, used = pipe.recv()
        cpu += used
        for (i, *_), t in zip(share, got):
            timings[i] = Timing(**t)
        p.join()
    wall = time.monotonic() - wall0
    server_cpu = {}
    for name, pid in server.items():
        (m0, t0), (m1, t1) = cpu0[name], _cpu_seconds(pid)
        server_cpu[f"{name}_main_cpu_pct"] = 100 * (m1 - m0) / wall
        server_cpu[f"{name}_cpu_pct"] = 100 * (t1 - t0) / wall
    duration = max(t.end for t in timings) - min(t.arrival for t in timings)
    return timings, duration, cpu, server_cpu


def summarize(name: str, timings: list[Timing], duration: float, client_cpu: float | None = None) -> dict:
    ok = [t for t in timings if not t.error]
    ttft = [t.first - t.arrival for t in ok if t.first]
    itl = [b - a for t in ok for a, b in zip(t.chunks, t.chunks[1:])]
    tpot = [(t.end - t.first) / (t.output_tokens - 1) for t in ok if t.first and t.output_tokens > 1]
    e2e = [t.end - t.arrival for t in ok]
    out = sum(t.output_tokens for t in ok)
    row = {"path": name, "completed": len(ok), "failed": len(timings) - len(ok), "duration_s": duration,
           "output_tok_s": out / duration, "output_tokens": out}
    for key, vals in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        row[f"{key}_p50_ms"], row[f"{key}_p99_ms"] = pct(vals, 0.5), pct(vals, 0.99)
    if client_cpu is not None:
        row["client_cpu_pct"] = 100 * client_cpu / duration  # of one core
    errors = [t.error for t in timings if t.error]
    row["first_error"] = errors[0] if errors else None
    return row


def print_table(rows: list[dict], offline_tps: float) -> None:
    head = (f"{'path':<30}{'tok/s':>10}{'of offl.':>9}{'TTFT p50/p99 ms':>18}{'ITL p50/p99':>16}"
            f"{'TPOT p50/p99':>16}{'E2E p50/p99 s':>16}{'client CPU':>11}{'front/core CPU':>16}{'fail':>6}")
    print(head)
    for r in rows:
        def pair(k: str, scale: float = 1.0) -> str:
            a, b = r[f"{k}_p50_ms"] / scale, r[f"{k}_p99_ms"] / scale
            return f"{a:.1f}/{b:.1f}" if scale == 1.0 else f"{a:.2f}/{b:.2f}"
        cpu = f"{r['client_cpu_pct']:.0f}%" if "client_cpu_pct" in r else "-"
        # main threads (the event loop; the busy loop): one near 100% is the bottleneck
        server = (f"{r['frontend_main_cpu_pct']:.0f}%/{r.get('core_main_cpu_pct', float('nan')):.0f}%"
                  if "frontend_main_cpu_pct" in r else "-")
        print(f"{r['path']:<30}{r['output_tok_s']:>10.0f}{100 * r['output_tok_s'] / offline_tps:>8.0f}%"
              f"{pair('ttft'):>18}{pair('itl'):>16}{pair('tpot'):>16}{pair('e2e', 1000.0):>16}{cpu:>11}{server:>16}{r['failed']:>6}")


def launch(args: argparse.Namespace, engine_flags: list[str], trace_prefix: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "swaserve.server", "--port", "0", "--stream-interval", str(args.stream_interval),
           "--api-server-count", str(args.api_server_count)]
    for flag in ("model", "device", "dtype"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "SWASERVE_REQUEST_TRACE": trace_prefix}  # first-token times per process, for the TTFT breakdown
    proc = subprocess.Popen(cmd + engine_flags, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline() if proc.stdout else ""
    m = re.search(r"(http://[^\s]+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, m.group(1)


def make_random_model(shape: str, path: str) -> None:
    """An HF directory of Gemma 3 `shape` with random weights (transformers' own init, bf16) and the
    embedded model's tokenizer, for `--model`."""
    import torch
    from transformers import Gemma3ForCausalLM

    from benchmarks.common import gemma3_hf_config
    from swaserve.tokenizer import Tokenizer

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(gemma3_hf_config(shape)).to(torch.bfloat16)
    model.save_pretrained(path)
    Tokenizer.load(None).hf.save_pretrained(path)
    print(f"wrote a random-weight Gemma 3 {shape} directory to {path}")


def main(argv: list[str] | None = None) -> int:
    from swaserve.options import add_engine_flags, engine_options

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", default="102,1024", help="LO,HI prompt token ids per request (uniform)")
    p.add_argument("--output-len", default="51,512", help="LO,HI output tokens per request (uniform)")
    p.add_argument("--max-tokens", type=int, default=None, help="fixed output length (overrides --output-len)")
    p.add_argument("--token-id-range", default="1000,20000")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals, req/s (default: all at once)")
    p.add_argument("--clients", type=int, default=4, help="load-generator processes")
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--api-server-count", type=int, default=1, help="frontend processes of the served runs")
    p.add_argument("--modes", default="generate,offline,stream,nonstream",
                   help="generate: offline with finished-only outputs (LLM.generate's way, the ratio's base); "
                        "offline: every step's outputs read (per-token timings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-cache", action="store_true",
                   help="keep the prefix cache on (off by default: each mode resends the same prompts, and this "
                        "benchmark measures serving overhead, not cache hits)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--make-random-model", nargs=2, metavar=("SHAPE", "DIR"), help="write a random Gemma 3 dir and exit")
    add_engine_flags(p)
    args = p.parse_args(argv)
    if args.make_random_model:
        make_random_model(*args.make_random_model)
        return 0
    opts = engine_options(args)
    engine_flags = [a for a in (argv if argv is not None else sys.argv[1:]) if a]  # forwarded: engine flags only
    engine_flags = _engine_flags_only(p, engine_flags)
    if not args.prefix_cache:
        opts["disable_prefix_cache"] = True
        engine_flags.append("--disable-prefix-cache")
    reqs = make_requests(args)
    modes = args.modes.split(",")
    rows: list[dict] = []
    if "generate" in modes:
        timings, duration = run_offline(args, reqs, opts, finished_only=True)
        rows.append(summarize("offline (finished only)", timings, duration))
    breakdowns: dict[str, dict] = {}  # row path -> TTFT stages
    if "offline" in modes:
        timings, duration = run_offline(args, reqs, opts)
        rows.append(summarize("offline (Engine.step)", timings, duration))
        breakdowns[rows[-1]["path"]] = ttft_breakdown.offline(timings)
    trace_dir = tempfile.TemporaryDirectory()
    trace_prefix = os.path.join(trace_dir.name, "requests")
    proc = None
    try:
        if {"stream", "nonstream"} & set(modes):
            import httpx

            proc, url = launch(args, engine_flags, trace_prefix)
            deadline = time.monotonic() + 1800
            while httpx.get(url + "/health", timeout=5).status_code != 200:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("server did not become healthy")
                time.sleep(0.2)
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            warm_up(url + "/v1/completions", model, reqs, 4 * args.api_server_count)  # as offline's warm-up
            for mode in ("stream", "nonstream"):
                if mode in modes:
                    timings, duration, cpu, server_cpu = run_served(
                        args, url + "/v1", model, reqs, mode == "stream", server_processes(proc.pid))
                    rows.append(summarize(f"served, {'streaming' if mode == 'stream' else 'non-streaming'}",
                                          timings, duration, cpu) | server_cpu)
                    if mode == "stream":
                        breakdowns[rows[-1]["path"]] = (timings, None)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    # The base: offline with finished-only outputs where run (LLM.generate's throughput), else per-token.
    offline_tps = rows[0]["output_tok_s"] if rows and rows[0]["path"].startswith("offline") else float("nan")
    config = {k: getattr(args, k) for k in ("model", "num_requests", "input_len", "output_len", "max_tokens",
                                            "clients", "stream_interval", "api_server_count", "seed")}
    config["request_rate"] = None if args.request_rate == float("inf") else args.request_rate
    config["engine_options"] = opts
    hardware = {"platform": platform.platform(), "cpus": os.cpu_count(), "device": _device_name(args.device)}
    print(f"serving_vs_offline: {hardware}\nconfig: {config}")
    print_table(rows, offline_tps)
    for path, stages in breakdowns.items():  # served: joined once the server has closed its traces
        if isinstance(stages, tuple):
            stages = ttft_breakdown.served(stages[0], trace_prefix)
        next(r for r in rows if r["path"] == path)["ttft_breakdown"] = ttft_breakdown.print_breakdown(path, stages)
    trace_dir.cleanup()
    for r in rows:
        line = json.dumps({"benchmark": "serving_vs_offline", "hardware": hardware, "config": config,
                           "of_offline": r["output_tok_s"] / offline_tps, **r})
        print(line)
        if args.output_json:
            with open(args.output_json, "a") as f:
                f.write(line + "\n")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _engine_flags_only(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The engine flags (and their values) out of this command line, to start the server with."""
    engine = {s for g in parser._action_groups if g.title == "engine" for a in g._group_actions for s in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in engine:
            out.append(argv[i])
            takes = parser._option_string_actions[flag].nargs != 0
            if takes and "=" not in argv[i] and i + 1 < len(argv):
                out.append(argv[i + 1])
                i += 1
        i += 1
    return out


def _device_name(device: str | None) -> str:
    import torch

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        return torch.cuda.get_device_name()
    return platform.processor() or "cpu"


if __name__ == "__main__":
    sys.exit(main())
