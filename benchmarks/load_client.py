"""A lean load generator for OpenAI completions over HTTP/1.1, so that the client measures the server,
not an HTTP library: request bodies are encoded before the clock starts, each request's connection
is opened shortly before its arrival time (as a client with a pooled connection has one ready), and
responses (SSE over chunked transfer encoding, or one JSON body) are read with asyncio streams.
Used by `serving_vs_offline.py`, several processes at once.
"""

from __future__ import annotations

import asyncio
import json
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


async def one_request(url: str, body: bytes, stream: bool, at: float) -> Timing:
    """POST `body` to `url` at monotonic time `at`; the client's view of its timings."""
    parts = urlsplit(url)
    await asyncio.sleep(max(0.0, at - PRE_CONNECT_S - time.monotonic()))
    t = Timing()
    writer = None
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
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


def client_proc(url: str, model: str, jobs: list, stream: bool, start: float, conn) -> None:
    """One load-generator process: its share of `jobs` ((index, prompt ids, max_tokens, arrival offset))
    on one event loop; sends ([Timing as dict], CPU seconds used) through `conn`."""
    bodies = []
    for _, ids, n_out, _ in jobs:
        body = {"model": model, "prompt": ids, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        bodies.append(json.dumps(body, separators=(",", ":")).encode())

    async def main() -> list[Timing]:
        return await asyncio.gather(*(one_request(url, b, stream, start + at)
                                      for b, (_, _, _, at) in zip(bodies, jobs)))

    cpu0 = time.process_time()
    timings = asyncio.run(main())
    conn.send(([asdict(t) for t in timings], time.process_time() - cpu0))
    conn.close()
