"""The serving benchmark: one request set through an OpenAI-compatible server, from a lean SSE load
generator in several client processes (so the number is the server's, not the client's), streaming and
not; and the same set through the engine in-process (the offline baseline, with the same arrival
times). Reports output tok/s, TTFT / ITL / TPOT / E2E p50 and p99, the served/offline ratio, the load
generator's CPU use and, for a server it launched, the server processes' CPU and where TTFT goes
(table + one JSON line per row).

    # the issue's H100 set: 256 requests, prompts 102-1024 token ids, 51-512 outputs, ignore_eos
    python benchmarks/serving_vs_offline.py --model /path/to/gemma3-1b-random --num-requests 256
    python benchmarks/serving_vs_offline.py --model DIR --request-rate 40          # Poisson arrivals
    # a server that is already running (any OpenAI-compatible one): served rows only
    python benchmarks/serving_vs_offline.py --base-url http://127.0.0.1:8000 --concurrency 64
    python benchmarks/serving_vs_offline.py --smoke        # tiny random model on the CPU (CI)
    python benchmarks/serving_vs_offline.py --make-random-model 1b DIR             # a random Gemma 3 dir
"""

from __future__ import annotations

import argparse
import gc
import json
import math
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

# No torch here (benchmarks.common imports it inside the functions): the load generator's processes
# import this module when they start, and must be up before the clock starts.
from benchmarks import ttft_breakdown  # noqa: E402
from benchmarks.load_client import Timing, run_served, warm_up  # noqa: E402
from benchmarks.ttft_breakdown import pct  # noqa: E402


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
    from benchmarks.common import empty_cache

    device = engine.device
    del engine
    gc.collect()
    empty_cache(device)
    return timings, duration


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
        of_offline = "-" if math.isnan(offline_tps) else f"{100 * r['output_tok_s'] / offline_tps:.0f}%"
        print(f"{r['path']:<30}{r['output_tok_s']:>10.0f}{of_offline:>9}"
              f"{pair('ttft'):>18}{pair('itl'):>16}{pair('tpot'):>16}{pair('e2e', 1000.0):>16}{cpu:>11}{server:>16}{r['failed']:>6}")


def launch(args: argparse.Namespace, engine_flags: list[str], trace_prefix: str) -> tuple[subprocess.Popen, str]:
    """`python -m swaserve.server` on a free port with this run's model and engine flags; (process, URL)."""
    cmd = [sys.executable, "-m", "swaserve.server", "--port", "0", "--stream-interval", str(args.stream_interval),
           "--api-server-count", str(args.api_server_count), "--data-parallel-size", str(args.data_parallel_size)]
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
    """An HF directory of `shape` (benchmarks/common.py) with random weights (transformers' own init, bf16)
    and the embedded model's tokenizer, for `--model`."""
    from benchmarks.common import hf_config, write_model_dir

    write_model_dir(path, hf_config(shape), weights=True, tokenizer="embedded")
    print(f"wrote a random-weight {shape} directory to {path}")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import model_dir, parse_args
    from swaserve.options import add_engine_flags, engine_options

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--base-url", default=None,
                   help="a running server (http://HOST:PORT or .../v1) instead of launching one; modes "
                        "default to stream, and the offline modes (if asked for) run --model here")
    p.add_argument("--api-key", default=os.environ.get("SWASERVE_API_KEY"), help="bearer token (--base-url)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", default="102,1024", help="LO,HI prompt token ids per request (uniform)")
    p.add_argument("--output-len", default="51,512", help="LO,HI output tokens per request (uniform)")
    p.add_argument("--max-tokens", type=int, default=None, help="fixed output length (overrides --output-len)")
    p.add_argument("--token-id-range", default="1000,20000")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals, req/s (default: all at once)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="served: at most this many requests in flight (split evenly over --clients; "
                        "default: no limit)")
    p.add_argument("--clients", type=int, default=4, help="load-generator processes")
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--api-server-count", type=int, default=1, help="frontend processes of the served runs")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas of the served runs (one engine core each; on CUDA replica i on GPU i)")
    p.add_argument("--modes", default=None,
                   help="of generate,offline,stream,nonstream (default: all; stream with --base-url). "
                        "generate: offline with finished-only outputs (LLM.generate's way, the ratio's "
                        "base); offline: every step's outputs read (per-token timings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-cache", action="store_true",
                   help="keep the prefix cache on (off by default: each mode resends the same prompts, and this "
                        "benchmark measures serving overhead, not cache hits)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--make-random-model", nargs=2, metavar=("SHAPE", "DIR"),
                   help="write a random-weight dir of a benchmarks/common.py shape (1b, 4b, ...) and exit")
    add_engine_flags(p)
    args = parse_args(p, argv, smoke=dict(device="cpu", load_format="dummy", num_requests=6, input_len="8,40",
                                          max_tokens=5, request_rate=50.0, concurrency=4, clients=2))
    if args.make_random_model:
        make_random_model(*args.make_random_model)
        return 0
    if args.smoke and args.model is None and args.base_url is None:
        args.model = model_dir("tiny", tokenizer="words")
    if args.concurrency is not None and args.concurrency < args.clients:
        p.error("--concurrency must be at least --clients")
    modes = (args.modes or ("stream" if args.base_url else "generate,offline,stream,nonstream")).split(",")
    opts = engine_options(args)
    engine_flags = _engine_flags(p, args)  # the launched server gets this run's engine flags
    if not args.prefix_cache:
        opts["disable_prefix_cache"] = True
        engine_flags.append("--disable-prefix-cache")
    reqs = make_requests(args)
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

            if args.base_url:
                url = re.sub(r"/(v1/?)?$", "", args.base_url)
            else:
                proc, url = launch(args, engine_flags, trace_prefix)
            deadline = time.monotonic() + 1800
            while httpx.get(url + "/health", timeout=5).status_code != 200:
                if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                    raise SystemExit("server did not become healthy")
                time.sleep(0.2)
            auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            listed = httpx.get(url + "/v1/models", headers=auth, timeout=10)
            if listed.status_code != 200:
                raise SystemExit(f"GET {url}/v1/models: HTTP {listed.status_code} {listed.text[:200]} "
                                 "(--api-key?)")
            model = listed.json()["data"][0]["id"]
            # as offline's warm-up
            warm_up(url + "/v1/completions", model, reqs, 4 * args.api_server_count, args.api_key)
            server = server_processes(proc.pid) if proc is not None else None
            for mode in ("stream", "nonstream"):
                if mode in modes:
                    timings, duration, cpu, server_cpu = run_served(
                        url + "/v1", model, reqs, mode == "stream", args.clients, server, args.api_key,
                        args.concurrency)
                    rows.append(summarize(f"served, {'streaming' if mode == 'stream' else 'non-streaming'}",
                                          timings, duration, cpu) | server_cpu)
                    if mode == "stream" and proc is not None:  # the request trace of the server it launched
                        breakdowns[rows[-1]["path"]] = (timings, None)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    # The base: offline with finished-only outputs where run (LLM.generate's throughput), else per-token.
    offline_tps = rows[0]["output_tok_s"] if rows and rows[0]["path"].startswith("offline") else float("nan")
    config = {k: getattr(args, k) for k in ("model", "base_url", "num_requests", "input_len", "output_len",
                                            "max_tokens", "concurrency", "clients", "stream_interval",
                                            "api_server_count", "seed")}
    config["request_rate"] = None if args.request_rate == float("inf") else args.request_rate
    remote_only = args.base_url and not {"generate", "offline"} & set(modes)
    config["engine_options"] = None if remote_only else opts  # a running server's are its own
    device = f"server at {args.base_url}" if remote_only else _device_name(args.device)
    hardware = {"platform": platform.platform(), "cpus": os.cpu_count(), "device": device}
    print(f"serving_vs_offline: {hardware}\nconfig: {config}")
    print_table(rows, offline_tps)
    for path, stages in breakdowns.items():  # served: joined once the server has closed its traces
        if isinstance(stages, tuple):
            stages = ttft_breakdown.served(stages[0], trace_prefix)
        next(r for r in rows if r["path"] == path)["ttft_breakdown"] = ttft_breakdown.print_breakdown(path, stages)
    trace_dir.cleanup()
    for r in rows:
        of_offline = None if math.isnan(offline_tps) else r["output_tok_s"] / offline_tps
        line = json.dumps({"benchmark": "serving_vs_offline", "hardware": hardware, "config": config,
                           "of_offline": of_offline, **r})
        print(line)
        if args.output_json:
            with open(args.output_json, "a") as f:
                f.write(line + "\n")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _engine_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The engine flags this run was given (on the command line or by --smoke), to start the server with."""
    out: list[str] = []
    seen: set[str] = set()
    for group in parser._action_groups:
        if group.title != "engine":
            continue
        for action in group._group_actions:
            value = getattr(args, action.dest, None)
            if value is None or action.dest in seen or not action.option_strings:
                continue
            seen.add(action.dest)  # a flag's aliases share its dest and come after it
            flag = action.option_strings[0]
            if isinstance(action, argparse.BooleanOptionalAction):
                out.append(flag if value else action.option_strings[1])
            elif action.nargs == 0:  # store_true
                out += [flag] if value else []
            else:
                out += [flag, str(value)]
    return out


def _device_name(device: str | None) -> str:
    import torch

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        return torch.cuda.get_device_name()
    return platform.processor() or "cpu"


if __name__ == "__main__":
    sys.exit(main())
