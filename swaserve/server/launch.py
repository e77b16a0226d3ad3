"""Starting the server: uvicorn on a socket we bind ourselves, signal handling, and the CLI entry points
(`add_server_args`, `serve_main`) that `swaserve serve` calls.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import signal
import socket
import threading
from typing import TYPE_CHECKING, Any, cast

import uvicorn

if TYPE_CHECKING:
    from fastapi import FastAPI

DEFAULT_GRACEFUL_TIMEOUT = 10.0


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)  # connections arriving during startup wait in the backlog instead of failing
    sock.set_inheritable(True)
    return sock


def build_server(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int | None = None,
    graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT,
    log_level: str = "warning",
    access_log: bool = False,
) -> tuple[uvicorn.Server, socket.socket]:
    """A ready-to-run uvicorn server for `engine` and its bound socket (port 0 picks a free port).

    Run it with `server.run(sockets=[sock])` (any thread; signals are handled only in the main one).
    """
    from swaserve.server.app import DEFAULT_MAX_BODY_BYTES, create_app
    from swaserve.server.engine_client import EngineClient

    app = create_app(
        EngineClient(engine), served_model_name=served_model_name, api_key=api_key,
        max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
    )
    config = uvicorn.Config(
        app, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=math.ceil(graceful_timeout),
        lifespan="on", loop="asyncio", http="h11", ws="none", server_header=False,
    )
    return uvicorn.Server(config), bind_socket(host, port)


def run_server(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int | None = None,
    graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT,
    log_level: str = "warning",
    access_log: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM: stop accepting, let in-flight requests finish (up to
    `graceful_timeout` s, then cancel them), stop the engine thread, release the port, and return."""
    server, sock = build_server(
        engine, host, port, api_key, served_model_name, max_body_bytes, graceful_timeout, log_level, access_log
    )
    app = cast("FastAPI", server.config.app)
    print(f"swaserve: serving {app.state.model_name!r} on http://{host}:{sock.getsockname()[1]}", flush=True)

    def stop_serving(signum: int, frame: Any) -> None:
        server.should_exit = True

    main = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    if main:
        # uvicorn re-raises the signal it shut down for once it restored the previous handlers; with
        # this one, that re-raise ends run() normally instead of killing the process (SIGTERM) or
        # printing a KeyboardInterrupt traceback (SIGINT). It also covers a signal before uvicorn's own.
        previous = {sig: signal.signal(sig, stop_serving) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Normally stopped by the app's lifespan; this covers a forced exit that skipped it.
        app.state.engine_client.stop(timeout=5.0)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server's flags (the engine's own flags are the CLI's business)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    g.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    g.add_argument("--api-key", default=os.environ.get("SWASERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $SWASERVE_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="model name clients must use (default: the model's)")
    g.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get a 413")
    g.add_argument("--graceful-timeout", type=float, default=DEFAULT_GRACEFUL_TIMEOUT,
                   help="seconds in-flight requests get to finish on shutdown")
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    g.add_argument("--access-log", action="store_true", help="log every request")


def serve_main(args: argparse.Namespace, engine_options: dict[str, Any] | None = None, engine: Any = None) -> int:
    """`swaserve serve`: build the engine (unless given) and serve until SIGINT/SIGTERM; returns 0.

    Reads `args.model`, `args.device`, `args.dtype`, and the server flags `host`, `port`, `api_key`,
    `served_model_name`, `max_body_bytes` (or `max_body_mb`), `graceful_timeout`, `log_level`,
    `access_log`; any that are missing take their defaults. `engine_options` are extra Engine kwargs.
    """
    if engine is None:
        from swaserve.engine import Engine

        engine = Engine(
            getattr(args, "model", None), device=getattr(args, "device", None),
            dtype=getattr(args, "dtype", None), **(engine_options or {}),
        )
    max_body = getattr(args, "max_body_bytes", None)
    if max_body is None and getattr(args, "max_body_mb", None) is not None:
        max_body = int(args.max_body_mb) << 20
    run_server(
        engine, host=getattr(args, "host", "127.0.0.1"), port=getattr(args, "port", 8000),
        api_key=getattr(args, "api_key", None), served_model_name=getattr(args, "served_model_name", None),
        max_body_bytes=max_body,
        graceful_timeout=getattr(args, "graceful_timeout", DEFAULT_GRACEFUL_TIMEOUT),
        log_level=getattr(args, "log_level", "warning"), access_log=getattr(args, "access_log", False),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m swaserve.server`: the server alone, for benchmarks and scripts."""
    parser = argparse.ArgumentParser(prog="python -m swaserve.server", description="Run the OpenAI-compatible server.")
    parser.add_argument("--model", default=None, help="model path or name (default: the embedded model)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Engine keyword argument (value parsed as a Python literal)")
    add_server_args(parser)
    args = parser.parse_args(argv)
    return serve_main(args, dict(_parse_option(o) for o in args.engine_option))


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--engine-option expects KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value

