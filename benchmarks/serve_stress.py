"""Load test of a running (or launched) `swaserve serve`: N requests at a fixed concurrency with mixed
prompt lengths crossing the sliding window, streaming and not, some clients disconnecting mid-stream.
Passes when every request that was not cut off completes with exactly its max_tokens, and afterwards
no request is running and both KV pools are back to zero slots used (read from /metrics).

    python benchmarks/serve_stress.py --launch --model DIR --load-format dummy --num-requests 200 --concurrency 128
    python benchmarks/serve_stress.py --base-url http://127.0.0.1:8000 --window 512
    python benchmarks/serve_stress.py --smoke     # a tiny random model served on the CPU (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import model_dir, parse_args  # noqa: E402


def launch_server(flags: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    """`swaserve serve` on a free local port with `flags`; returns once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "swaserve", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    print("#", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server not healthy after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


@dataclass
class Outcome:
    kind: str  # "stream", "plain" or "disconnect"
    ok: bool
    tokens: int
    expected: int
    error: str = ""


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, kind: str,
              cut_after: int) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": kind != "plain"}
    if kind != "plain":
        body["stream_options"] = {"include_usage": True}
    try:
        if kind == "plain":
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return Outcome(kind, False, 0, max_tokens, f"HTTP {r.status_code}: {r.text[:200]}")
            n = r.json()["usage"]["completion_tokens"]
            return Outcome(kind, n == max_tokens, n, max_tokens, "" if n == max_tokens else "short")
        chunks, usage = 0, None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome(kind, False, 0, max_tokens, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Outcome(kind, False, chunks, max_tokens, str(event["error"])[:200])
                if event.get("usage") and not event.get("choices"):
                    usage = event["usage"]["completion_tokens"]
                    continue
                chunks += 1
                if kind == "disconnect" and chunks >= cut_after:
                    return Outcome(kind, True, chunks, max_tokens)  # leaving the block closes the stream
        # The final usage chunk counts the tokens (text chunks may merge tokens that end mid-character).
        ok = usage == max_tokens
        return Outcome(kind, ok, usage or 0, max_tokens, "" if ok else f"usage {usage} after {chunks} chunks")
    except Exception as e:  # a failure of this request, counted, never fatal for the others
        return Outcome(kind, False, 0, max_tokens, f"{type(e).__name__}: {e}")


async def drive(a: argparse.Namespace, base: str) -> list[Outcome]:
    rng = random.Random(a.seed)
    W = a.window
    jobs = []
    for i in range(a.num_requests):
        # Prompts from far below the window to 3x past it; outputs long enough to cross it again.
        plen = rng.choice([rng.randint(8, W // 2), rng.randint(W - 4, W + 4), rng.randint(W, 3 * W)])
        kind = "disconnect" if rng.random() < a.disconnect_fraction else ("plain" if rng.random() < 0.3 else "stream")
        prompt = [rng.randint(1000, a.max_token_id) for _ in range(plen)]
        jobs.append((prompt, rng.randint(8, a.max_tokens), kind, rng.randint(1, 8)))
    sem = asyncio.Semaphore(a.concurrency)
    limits = httpx.Limits(max_connections=a.concurrency + 8, max_keepalive_connections=a.concurrency + 8)
    async with httpx.AsyncClient(base_url=base, timeout=a.timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def run(job):
            async with sem:
                return await one(client, model, *job)

        return await asyncio.gather(*(run(j) for j in jobs))


def pool_usage(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    out = {}
    for m in re.finditer(r'^(swaserve_kv_used_tokens\{pool="(\w+)"\}|swaserve_requests_running) ([0-9.e+-]+)$', text, re.M):
        out[m.group(2) or "running"] = float(m.group(3))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: launch one with --launch)")
    p.add_argument("--launch", action="store_true", help="start `swaserve serve` with the flags after --")
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default=None)
    p.add_argument("--device", default=None, help="the launched server's device")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--window", type=int, default=1024, help="the model's sliding window (prompt lengths cross it)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--disconnect-fraction", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=600, help="per request, seconds")
    p.add_argument("--launch-timeout", type=float, default=900)
    p.add_argument("--max-token-id", type=int, default=200000, help="prompt token ids are 1000..this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("server_args", nargs="*", help="extra `swaserve serve` flags (after --)")
    a = parse_args(p, argv, smoke=dict(launch=True, load_format="dummy", device="cpu", num_requests=12,
                                       concurrency=6, window=32, max_tokens=8, max_token_id=20000,
                                       launch_timeout=300))
    if a.smoke and a.model is None:
        a.model = model_dir("tiny", tokenizer="words")
    proc = None
    base = a.base_url
    if a.launch:
        extra = list(a.server_args)
        if a.model:
            extra += ["--model", a.model]
        if a.load_format:
            extra += ["--load-format", a.load_format]
        if a.device:
            extra += ["--device", a.device]
        proc, base = launch_server(extra, a.launch_timeout)
    assert base, "--base-url or --launch"
    try:
        t0 = time.perf_counter()
        outcomes = asyncio.run(drive(a, base))
        wall = time.perf_counter() - t0
        deadline = time.time() + 30  # aborts of cut-off streams land within a step or two
        usage = pool_usage(base)
        while any(usage.values()) and time.time() < deadline:
            time.sleep(0.5)
            usage = pool_usage(base)
    finally:
        if proc is not None:
            stop_server(proc)
    failed = [o for o in outcomes if not o.ok]
    by_kind = {k: sum(o.kind == k for o in outcomes) for k in ("stream", "plain", "disconnect")}
    tokens = sum(o.tokens for o in outcomes if o.kind != "disconnect")
    result = dict(requests=len(outcomes), concurrency=a.concurrency, **by_kind, failures=len(failed), wall_s=round(wall, 1),
                  output_tok_per_s=round(tokens / wall, 1), after=usage)
    print(json.dumps(result))
    for o in failed[:10]:
        print("FAILED", o)
    clean = usage and all(v == 0 for v in usage.values())
    print(f"{len(outcomes)} requests ({by_kind}) at concurrency {a.concurrency}: {len(failed)} failures, "
          f"{wall:.1f} s; after: {usage} -> {'PASS' if not failed and clean else 'FAIL'}")
    return 0 if not failed and clean else 1


if __name__ == "__main__":
    sys.exit(main())
