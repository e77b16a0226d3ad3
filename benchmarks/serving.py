"""Serving benchmark: drive an OpenAI-compatible server with the official async client and report request
throughput, output tok/s, TTFT, ITL, TPOT and end-to-end latency (table + one JSON line).

    python benchmarks/serving.py --launch --num-prompts 64 --concurrency 16 --input-len 128 --output-len 64
    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --request-rate 4 --num-prompts 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import openai


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0  # s, to the first chunk with text
    latency: float = 0.0  # s, to the last chunk
    itls: list[float] = field(default_factory=list)  # s between consecutive text chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def make_prompts(args: argparse.Namespace) -> list[tuple[list[int] | str, int]]:
    """(prompt, max_tokens) pairs; lengths uniform in [len * (1 - ratio), len] when ratio > 0."""
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.token_id_range.split(","))
    words = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he", "this", "are", "or", "his", "from"]

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - args.random_range_ratio)), n)) if args.random_range_ratio else n

    out: list[tuple[list[int] | str, int]] = []
    for _ in range(args.num_prompts):
        n_in, n_out = length(args.input_len), length(args.output_len)
        if args.prompt_mode == "ids":
            out.append(([rng.randrange(lo, hi) for _ in range(n_in)], n_out))
        else:
            out.append((" ".join(rng.choice(words) for _ in range(n_in)), n_out))
    return out


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: list[int] | str, max_tokens: int) -> Result:
    start = time.perf_counter()
    res = Result(ok=False)
    last = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.prompt_tokens, res.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                if last is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except Exception as e:  # noqa: BLE001  (a failed request is counted, not fatal)
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args: argparse.Namespace, base_url: str) -> dict:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=args.api_key or "none", max_retries=0,
                                timeout=args.timeout, http_client=httpx.AsyncClient(
                                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                                    timeout=args.timeout))
    model = args.model or (await client.models.list()).data[0].id
    prompts = make_prompts(args)
    for prompt, n_out in prompts[: args.warmup]:
        await one_request(client, model, prompt, min(n_out, 4))
    sem = asyncio.Semaphore(args.concurrency or len(prompts))
    rng = random.Random(args.seed + 1)

    async def bounded(prompt: list[int] | str, n_out: int) -> Result:
        async with sem:
            return await one_request(client, model, prompt, n_out)

    start = time.perf_counter()
    tasks = []
    for prompt, n_out in prompts:
        tasks.append(asyncio.create_task(bounded(prompt, n_out)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    await client.close()
    return summarize(results, duration, model)


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": statistics.fmean(values) * scale, "median": statistics.median(values) * scale, "p99": p99 * scale}


def summarize(results: list[Result], duration: float, model: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "model": model, "completed": len(ok), "failed": len(errors), "first_error": errors[0] if errors else None,
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "input_tok_s": sum(r.prompt_tokens for r in ok) / duration, "output_tok_s": out_tokens / duration,
        "mean_input_tokens": statistics.fmean([r.prompt_tokens for r in ok]) if ok else 0.0,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]), "itl_ms": _stats([x for r in ok for x in r.itls]),
        "tpot_ms": _stats(tpot), "e2e_ms": _stats([r.latency for r in ok]),
    }


def print_table(summary: dict) -> None:
    print(f"{'completed / failed':<28}{summary['completed']} / {summary['failed']}")
    print(f"{'duration (s)':<28}{summary['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<28}{summary['request_throughput']:.2f}")
    print(f"{'input tokens/s':<28}{summary['input_tok_s']:.1f}")
    print(f"{'output tokens/s':<28}{summary['output_tok_s']:.1f}")
    print(f"{'':<28}{'mean':>10}{'median':>10}{'p99':>10}")
    for key, label in (("ttft_ms", "TTFT (ms)"), ("itl_ms", "ITL (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2e_ms", "E2E (ms)")):
        s = summary[key]
        print(f"{label:<28}{s['mean']:>10.1f}{s['median']:>10.1f}{s['p99']:>10.1f}")
    if summary["first_error"]:
        print(f"first error: {summary['first_error']}")


def launch_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "swaserve.server", "--port", "0"]
    for flag in ("model", "device", "dtype"):
        if getattr(args, f"server_{flag}"):
            cmd += [f"--{flag}", getattr(args, f"server_{flag}")]
    cmd += shlex.split(args.server_args)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    line = proc.stdout.readline() if proc.stdout else ""
    m = re.search(r"(http://[^\s]+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    url = m.group(1)
    deadline = time.monotonic() + args.launch_timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url + "/v1"
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become healthy")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=os.environ.get("SWASERVE_API_KEY"))
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=None, help="max requests in flight (default: unbounded)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrival rate, req/s")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len]")
    p.add_argument("--prompt-mode", choices=["ids", "text"], default="ids", help="token-id prompts (exact length) or words")
    p.add_argument("--token-id-range", default="1000,20000", help="LO,HI for random prompt token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--output-json", default=None, help="also append the JSON line to this file")
    g = p.add_argument_group("--launch: start `python -m swaserve.server` for this run and stop it after")
    g.add_argument("--launch", action="store_true")
    g.add_argument("--server-model", default=None, help="default: the embedded model")
    g.add_argument("--server-device", default=None)
    g.add_argument("--server-dtype", default=None)
    g.add_argument("--server-args", default="", help="more flags for the server, e.g. '--max-running-requests 256 "
                   "--stream-interval 4' (the flags of `swaserve serve`)")
    g.add_argument("--launch-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.num_prompts < 1 or not 0 <= args.random_range_ratio < 1:
        p.error("need --num-prompts >= 1 and 0 <= --random-range-ratio < 1")

    proc = None
    base_url = args.base_url
    if args.launch:
        proc, base_url = launch_server(args)
    try:
        summary = asyncio.run(run(args, base_url))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    config = {k: getattr(args, k) for k in ("num_prompts", "concurrency", "request_rate", "input_len", "output_len",
                                            "random_range_ratio", "prompt_mode", "launch")}
    if config["request_rate"] == float("inf"):
        config["request_rate"] = None  # JSON has no Infinity; None: all requests at once
    hardware = {"platform": platform.platform(), "cpus": os.cpu_count()}
    print(f"serving benchmark: {base_url}  {hardware}")
    print(f"config: {config}")
    print_table(summary)
    line = json.dumps({"benchmark": "serving", "hardware": hardware, "config": config, **summary})
    print(line)
    if args.output_json:
        with open(args.output_json, "a") as f:
            f.write(line + "\n")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
