"""Starting the server: uvicorn on a socket we bind ourselves, signal handling, and the CLI entry points
(`add_server_args`, `serve_main`) that `swaserve serve` calls.
"""

from __future__ import annotations

import argparse
import math
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


def serve_main(args: argparse.Namespace, engine: Any = None) -> int:
    """`swaserve serve` / `python -m swaserve.server`: build the engine (unless given) from the flags of
    `swaserve.options.add_serve_flags` and serve until SIGINT/SIGTERM; returns 0."""
    from swaserve.options import engine_options, server_config
    from swaserve.tokenizer import load_chat_template

    cfg = server_config(args)
    if engine is None:
        from swaserve.engine import Engine

        engine = Engine(
            getattr(args, "model", None), device=getattr(args, "device", None),
            dtype=getattr(args, "dtype", None), chat_template=load_chat_template(cfg.chat_template),
            **engine_options(args),
        )
    run_server(
        engine, host=cfg.host, port=cfg.port, api_key=cfg.api_key, served_model_name=cfg.served_model_name,
        max_body_bytes=cfg.max_body_bytes, graceful_timeout=cfg.graceful_timeout, log_level=cfg.log_level,
        access_log=cfg.access_log,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m swaserve.server`: the server alone (the flags of `swaserve serve`)."""
    from swaserve.options import add_serve_flags

    parser = argparse.ArgumentParser(prog="python -m swaserve.server", description="Run the OpenAI-compatible server.")
    add_serve_flags(parser)
    return serve_main(parser.parse_args(argv))
