"""A lean load generator for OpenAI completions over HTTP/1.1, so that the client measures the server,
not an HTTP library: request bodies are encoded before the clock starts, each request's connection
is opened shortly before its arrival time (as a client with a pooled connection has one ready), and
responses (SSE over chunked transfer encoding, or one JSON body) are read with asyncio streams, from
several processes at once (`run_served`). Used by `serving_vs_offline.py`, the serving benchmark.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

PRE_CONNECT_S = 0.05  # open the connection this long before the request's arrival time


@dataclass
class Timing:
    """One request: absolute monotonic times (comparable across processes on Linux)."""

    arrival: float = 0.0
    first: float = 0.0  # first token (offline) / first chunk with text (served)
    chunks: list[float] = field(default_factory=list)  # every token (offline) / text chunk (served)
    end: float = 0.0
    output_tokens: int = 0
    error: str = ""
    added: float = 0.0  # offline: when the engine got it (the next step boundary after its arrival)
    rid: str = ""  # served: the response id (joins the server's request trace)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    headers = {}
    for line in head[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The response body as it arrives (chunked transfer encoding or Content-Length)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readline()
                return
            piece = await reader.readexactly(size + 2)
            yield piece[:-2]
    else:
        yield await reader.readexactly(int(headers.get("content-length", "0")))


async def one_request(url: str, body: bytes, stream: bool, at: float, api_key: str | None = None,
                      slots: asyncio.Semaphore | None = None) -> Timing:
    """POST `body` to `url` at monotonic time `at` (with `slots`, once one of them is free too: a
    request that waits for one is sent, and its clock starts, when it gets it); the client's view of
    its timings."""
    if slots is not None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        async with slots:
            return await one_request(url, body, stream, time.monotonic(), api_key)
    parts = urlsplit(url)
    await asyncio.sleep(max(0.0, at - PRE_CONNECT_S - time.monotonic()))
    t = Timing()
    writer = None
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                f"{auth}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        t.arrival = time.monotonic()
        writer.write(head + body)
        status, headers = await _read_head(reader)
        if not stream or status != 200:
            data = b"".join([p async for p in _body_pieces(reader, headers)])
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
            t.end = time.monotonic()
            got = json.loads(data)
            t.output_tokens, t.rid = got["usage"]["completion_tokens"], got["id"]
            return t
        buf = b""
        async for piece in _body_pieces(reader, headers):
            now = time.monotonic()
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                if b'"usage":{' in event:  # the final chunk (only it carries a usage object)
                    t.output_tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                elif b'"text":""' not in event:
                    if not t.first:
                        t.first = now
                        t.rid = json.loads(event[6:])["id"]
                    t.chunks.append(now)
        t.end = time.monotonic()
    except Exception as e:  # noqa: BLE001  (a failed request is counted, not fatal)
        t.error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    return t


def client_proc(url: str, model: str, jobs: list, stream: bool, start: float, conn,
                api_key: str | None = None, concurrency: int | None = None) -> None:
    """One load-generator process: its share of `jobs` ((index, prompt ids, max_tokens, arrival offset))
    on one event loop, at most `concurrency` of them in flight; sends ([Timing as dict], CPU seconds
    used) through `conn`."""
    bodies = []
    for _, ids, n_out, _ in jobs:
        body = {"model": model, "prompt": ids, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        bodies.append(json.dumps(body, separators=(",", ":")).encode())

    async def main() -> list[Timing]:
        slots = asyncio.Semaphore(concurrency) if concurrency else None
        return await asyncio.gather(*(one_request(url, b, stream, start + at, api_key, slots)
                                      for b, (_, _, _, at) in zip(bodies, jobs)))

    cpu0 = time.process_time()
    timings = asyncio.run(main())
    conn.send(([asdict(t) for t in timings], time.process_time() - cpu0))
    conn.close()


def warm_up(url: str, model: str, reqs: list, n: int, api_key: str | None = None) -> None:
    """`n` streaming requests at once on new connections, so every frontend process behind the port
    (the kernel spreads connections over them) has served one before the clock starts."""
    body = {"model": model, "max_tokens": 4, "ignore_eos": True, "temperature": 0, "stream": True}
    bodies = [json.dumps({**body, "prompt": reqs[i % len(reqs)][0][:32]}).encode() for i in range(n)]

    async def main() -> list[Timing]:
        return await asyncio.gather(*(one_request(url, b, True, time.monotonic(), api_key) for b in bodies))

    failed = [t.error for t in asyncio.run(main()) if t.error]
    if failed:
        raise SystemExit(f"warm-up request failed: {failed[0]}")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(main thread, whole process) CPU seconds of `pid` (Linux /proc; zeros elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def stat(path: str) -> float:
        try:
            fields = open(path).read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / tick

    return stat(f"/proc/{pid}/task/{pid}/stat"), stat(f"/proc/{pid}/stat")


def run_served(base: str, model: str, reqs: list, stream: bool, clients: int,
               server: dict[str, int] | None = None, api_key: str | None = None,
               concurrency: int | None = None) -> tuple[list[Timing], float, float, dict[str, float]]:
    """Every request of `reqs` ((prompt ids, max_tokens, arrival offset s)) through the server at `base`
    (".../v1") from `clients` processes, round-robin, at most `concurrency` in flight (split evenly over
    the processes); (timings, duration, client CPU s, CPU % of one core used meanwhile by each process in
    `server` ({name: pid}): main thread and whole process)."""
    server = server or {}
    cpu0 = {name: cpu_seconds(pid) for name, pid in server.items()}
    wall0 = time.monotonic()
    ctx = mp.get_context("spawn")
    start = time.monotonic() + 1.0 + 0.2 * clients  # the clients' start-up happens before t0
    shares: list[list] = [[] for _ in range(clients)]
    for i, (ids, n, at) in enumerate(reqs):
        shares[i % clients].append((i, ids, n, at))
    per_client = -(-concurrency // clients) if concurrency else None
    pipes, procs = [], []
    for share in shares:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=client_proc,
                        args=(base + "/completions", model, share, stream, start, child, api_key, per_client))
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
        (m0, t0), (m1, t1) = cpu0[name], cpu_seconds(pid)
        server_cpu[f"{name}_main_cpu_pct"] = 100 * (m1 - m0) / wall
        server_cpu[f"{name}_cpu_pct"] = 100 * (t1 - t0) / wall
    ok = [t for t in timings if not t.error]
    duration = max(t.end for t in ok) - min(t.arrival for t in ok) if ok else wall
    return timings, duration, cpu, server_cpu
