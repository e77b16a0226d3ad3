"""One frontend's HTTP server: uvicorn over the app and its engine-core client (`make_server`), and the
listening socket we bind ourselves (`bind_socket`). Used by `launch.py` (one frontend) and by each
process of `frontends.py` (several on one socket)."""

from __future__ import annotations

import math
import socket
from typing import Any

import uvicorn

from swaserve.config import ServerConfig
from swaserve.core.engine_core import CoreSpec


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


def make_server(core: CoreSpec, tokenizer: Any, config: ServerConfig | None = None, frontend: int = 0,
                endpoints: list[tuple[str, str]] | None = None) -> uvicorn.Server:
    """A ready-to-run uvicorn server over the engine cores: started here (`config.data_parallel_size`
    replicas of `core`, waiting until all are ready), or, with `endpoints` ((input, output) per
    replica), cores another process started, this process being frontend number `frontend`. If a core
    dies, every open request fails, the server stops, and `server.config.app.state.exit_code` is 1.
    ValueError: more replicas than GPUs, or bad engine input."""
    from swaserve.server.app import create_app
    from swaserve.server.engine_client import EngineClient

    cfg = config or ServerConfig()
    holder: dict[str, uvicorn.Server] = {}

    def on_fatal() -> None:  # a core died: stop serving, exit non-zero
        app.state.exit_code = 1
        holder["server"].should_exit = True

    client = EngineClient(core, tokenizer, stream_interval=cfg.stream_interval, on_fatal=on_fatal,
                          data_parallel_size=cfg.data_parallel_size, frontend=frontend, endpoints=endpoints,
                          separate_reasoning=cfg.separate_reasoning)
    client.start_core()
    try:
        app = create_app(client, served_model_name=cfg.served_model_name, api_key=cfg.api_key,
                         max_body_bytes=cfg.max_body_bytes)
        app.state.exit_code = 0
        uv_config = uvicorn.Config(
            app, log_level=cfg.log_level, access_log=cfg.access_log,
            timeout_graceful_shutdown=math.ceil(cfg.graceful_timeout), lifespan="on", loop="auto", http="auto",
            ws="none", server_header=False,
        )
        holder["server"] = uvicorn.Server(uv_config)
        return holder["server"]
    except BaseException:
        client.stop_cores(5.0)
        raise
