"""Starting the server: the engine core process(es), uvicorn on a socket we bind ourselves
(`http_server.py`), one frontend or several (`frontends.py`), signal handling, and the entry points
`serve_main` (`swaserve serve`) and `main` (`python -m swaserve.server`).
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading
from typing import TYPE_CHECKING, Any, cast

import uvicorn

from swaserve.config import ServerConfig
from swaserve.core.engine_core import CoreSpec, freeze_startup_objects
from swaserve.server.http_server import bind_socket, make_server

if TYPE_CHECKING:
    from fastapi import FastAPI


def build_server(core: CoreSpec, tokenizer: Any, config: ServerConfig | None = None) -> tuple[uvicorn.Server, socket.socket]:
    """`make_server` (starting the engine cores) and its bound socket (port 0 picks a free port). Run it
    with `server.run(sockets=[sock])` (any thread; signals are handled only in the main one)."""
    cfg = config or ServerConfig()
    server = make_server(core, tokenizer, cfg)
    try:
        return server, bind_socket(cfg.host, cfg.port)
    except BaseException:
        server.config.app.state.engine_client.stop_cores(5.0)
        raise


def run_server(core: CoreSpec, tokenizer: Any, config: ServerConfig | None = None) -> int:
    """Serve until SIGINT/SIGTERM: stop accepting, let in-flight requests finish (up to the graceful
    timeout, then cancel them), stop the engine cores, release the port. Returns the exit code: 0, or 1
    when an engine core died."""
    cfg = config or ServerConfig()
    if cfg.api_server_count > 1:
        from swaserve.chat import chat_for
        from swaserve.server.frontends import run_frontends

        chat_for(tokenizer)  # a chat format that cannot load (GPT-OSS without its vocabulary) fails here, once
        return run_frontends(core, tokenizer, cfg)
    server, sock = build_server(core, tokenizer, cfg)
    app = cast("FastAPI", server.config.app)
    print(f"swaserve: serving {app.state.model_name!r} on http://{cfg.host}:{sock.getsockname()[1]}", flush=True)

    def stop_serving(signum: int, frame: Any) -> None:
        server.should_exit = True

    main = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    if main:
        # uvicorn re-raises the signal it shut down for once it restored the previous handlers; with
        # this one, that re-raise ends run() normally instead of killing the process (SIGTERM) or
        # printing a KeyboardInterrupt traceback (SIGINT). It also covers a signal before uvicorn's own.
        previous = {sig: signal.signal(sig, stop_serving) for sig in (signal.SIGINT, signal.SIGTERM)}
    freeze_startup_objects()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Normally the app's lifespan stopped the cores; this covers a forced exit.
        app.state.engine_client.stop_cores(5.0)
    return int(app.state.exit_code)


def core_spec(args: argparse.Namespace, cfg: ServerConfig, chat_template: str | None) -> CoreSpec:
    """The real engine's CoreSpec from the flags of `swaserve.options.add_serve_flags`."""
    from swaserve.options import engine_options

    kwargs = {"model": args.model, "device": args.device, "dtype": args.dtype, "chat_template": chat_template,
              "detokenize": False, **engine_options(args)}
    return CoreSpec("swaserve.engine:Engine", kwargs)


def serve_main(args: argparse.Namespace) -> int:
    """`swaserve serve` / `python -m swaserve.server`: an HTTP frontend (this process) and one engine-core
    process per data-parallel replica, serving until SIGINT/SIGTERM. Returns the exit code (1: an engine
    core died)."""
    from swaserve.options import engine_options, server_config
    from swaserve.tokenizer import Tokenizer, load_chat_template

    if (getattr(args, "node_rank", None) or 0) > 0:  # a node other than 0 runs tensor-parallel ranks only
        return serve_ranks(args.model, args.device, args.dtype, engine_options(args))
    cfg = server_config(args)
    template = load_chat_template(cfg.chat_template)
    tokenizer = Tokenizer.load(args.model).with_chat_template(template)  # also checks the model path
    return run_server(core_spec(args, cfg, template), tokenizer, cfg)


def serve_ranks(model: str | None, device: str | None, dtype: str | None, options: dict) -> int:
    """`--node-rank N` (N > 0): this node's tensor-parallel ranks, until node 0's engine stops them."""
    from swaserve.config import split_engine_options
    from swaserve.distributed.worker import serve_node
    from swaserve.engine_setup import resolve_device_dtype

    par = split_engine_options(options)[3]
    dev, dt = resolve_device_dtype(device, dtype)
    return serve_node(par, model, dev, dt, options)


def main(argv: list[str] | None = None) -> int:
    """`python -m swaserve.server`: the server alone (the flags of `swaserve serve`)."""
    from swaserve.options import add_serve_flags

    parser = argparse.ArgumentParser(prog="python -m swaserve.server", description="Run the OpenAI-compatible server.")
    add_serve_flags(parser)
    try:
        return serve_main(parser.parse_args(argv))
    except ValueError as e:
        parser.exit(2, f"python -m swaserve.server: error: {e}\n")
        return 2
