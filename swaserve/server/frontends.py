"""Several HTTP frontend processes behind one port (`--api-server-count N`, N > 1), for when one
frontend's CPU (tokenizing, detokenizing, SSE) is the limit at hundreds of streams.

Layout: this process, the supervisor, binds the port, spawns N frontend processes that each run
uvicorn on that listening socket (the kernel hands each new connection to one of them) with an
`EngineClient` of their own, and starts one engine core per data-parallel replica with every
frontend's (input, output) address pair plus a control input of its own. A frontend's requests carry
its index, and the core sends each frontend the outputs of its requests only (one message a step).

Faults: a core dies -> every frontend sees its pid gone, fails its open requests with a 500 and exits
1; the supervisor reaps the core at once, stops the rest and exits 1. A frontend dies -> the
supervisor stops the others and the cores and exits 1. The supervisor dies -> the cores (parent pid)
and the frontends (a watchdog thread) exit. SIGTERM/SIGINT -> every frontend stops accepting and
drains its requests (`--graceful-timeout`), then the cores get `Shutdown`; exit 0.

The engine counters in /metrics are the core's, the same on every frontend; the HTTP-side counters
and histograms (requests, TTFT, ITL) are those of the frontend that answered the scrape.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

from swaserve.config import ServerConfig
from swaserve.core.engine_core import CoreSpec
from swaserve.core.messages import Codec, Shutdown
from swaserve.core.process import CoreStartupError, core_command

logger = logging.getLogger(__name__)
POLL_S = 0.05  # how often the supervisor looks at its children
STARTUP_TIMEOUT_S = 1800.0
CORE_DEATH_GRACE_S = 10.0  # after a core died: how long the frontends get to fail their requests and exit


def run_frontends(core: CoreSpec, tokenizer: Any, cfg: ServerConfig) -> int:
    """Serve with `cfg.api_server_count` frontends until SIGINT/SIGTERM or a fault; the exit code (0, or
    1 when a core or a frontend died). ValueError: bad input (the engine refused it, too many replicas)."""
    from swaserve.server.core_pool import replica_specs
    from swaserve.server.http_server import bind_socket

    specs = replica_specs(core, cfg.data_parallel_size)
    sock = bind_socket(cfg.host, cfg.port)
    group = _Group(cfg, len(specs))
    stopping = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda s, f: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        group.start(core, specs, tokenizer, sock)
        model = group.wait_ready(stopping)
        if model is None:  # a signal during startup
            return group.shutdown(cfg.graceful_timeout)
        print(f"swaserve: serving {model!r} on http://{cfg.host}:{sock.getsockname()[1]} "
              f"({cfg.api_server_count} frontends)", flush=True)
        return group.serve(stopping)
    finally:
        group.close()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Group:
    """The supervisor's children: N frontend processes and one engine core per replica."""

    def __init__(self, cfg: ServerConfig, replicas: int):
        self.cfg, self.replicas = cfg, replicas
        self.dir = tempfile.mkdtemp(prefix="swaserve-frontends-")
        n = cfg.api_server_count
        # endpoints[i][j]: frontend i's (input, output) addresses to replica j's core
        self.endpoints = [[(f"ipc://{self.dir}/f{i}r{j}-in", f"ipc://{self.dir}/f{i}r{j}-out")
                           for j in range(replicas)] for i in range(n)]
        self.zmq = zmq.Context()
        self.controls: list[zmq.Socket] = []
        self.cores: list[subprocess.Popen] = []
        self.frontends: list[Any] = []
        self.events: Any = None

    def start(self, core: CoreSpec, specs: list[CoreSpec], tokenizer: Any, sock: socket.socket) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.events = ctx.Queue()
        for i in range(self.cfg.api_server_count):
            p = ctx.Process(target=_frontend_main, name=f"swaserve-frontend-{i}",
                            args=(i, core, tokenizer, self.cfg, self.endpoints[i], sock, self.events, os.getpid()))
            p.start()
            self.frontends.append(p)
        for j, spec in enumerate(specs):
            control = f"ipc://{self.dir}/r{j}-control"
            push = self.zmq.socket(zmq.PUSH)
            push.bind(control)
            self.controls.append(push)
            inputs = [ends[j][0] for ends in self.endpoints] + [control]
            cmd, env = core_command(spec, inputs, [ends[j][1] for ends in self.endpoints], os.getpid())
            self.cores.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))

    def wait_ready(self, stopping: threading.Event) -> str | None:
        """The model name once every frontend has its cores ready; None if a signal came first.
        Raises the first frontend's startup error (ValueError: bad input) after stopping everything."""
        ready: set[int] = set()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        model = ""
        while len(ready) < len(self.frontends):
            if stopping.is_set():
                return None
            try:
                kind, index, *rest = self.events.get(timeout=POLL_S)
            except queue.Empty:
                kind = None
            if kind == "ready":
                ready.add(index)
                model = rest[0]
            elif kind == "error":
                self.kill()
                raise (ValueError if rest[0] == "ValueError" else CoreStartupError)(rest[1])
            elif any(not p.is_alive() for p in self.frontends) or any(c.poll() is not None for c in self.cores):
                self.kill()
                raise CoreStartupError("a frontend or an engine core exited while the server was starting")
            if time.monotonic() > deadline:
                self.kill()
                raise CoreStartupError(f"the server was not ready within {STARTUP_TIMEOUT_S:.0f} s")
        return model

    def serve(self, stopping: threading.Event) -> int:
        while True:
            if stopping.wait(POLL_S):
                return self.shutdown(self.cfg.graceful_timeout)
            dead_core = next((j for j, c in enumerate(self.cores) if c.poll() is not None), None)  # poll reaps it
            if dead_core is not None:
                logger.error("engine core %d exited with code %s; stopping the server", dead_core,
                             self.cores[dead_core].returncode)
                self._wait_frontends(CORE_DEATH_GRACE_S)  # each fails its requests and exits by itself
                self.shutdown(0.0)
                return 1
            dead = next((p for p in self.frontends if not p.is_alive()), None)
            if dead is not None:
                logger.error("frontend %s exited with code %s; stopping the server", dead.name, dead.exitcode)
                self.shutdown(self.cfg.graceful_timeout)
                return 1

    def shutdown(self, graceful_timeout: float) -> int:
        """SIGTERM the frontends (each drains for up to `graceful_timeout` s), then stop the cores. The
        exit code: 0 when every frontend exited cleanly, else 1."""
        for p in self.frontends:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        self._wait_frontends(graceful_timeout + 15.0)
        codec = Codec()
        for control, c in zip(self.controls, self.cores):
            if c.poll() is None:
                control.send(codec.encode(Shutdown()), zmq.NOBLOCK)
        deadline = time.monotonic() + 30.0
        for c in self.cores:
            try:
                c.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait(30)
        return 0 if all(p.exitcode == 0 for p in self.frontends) else 1

    def _wait_frontends(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.frontends:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.frontends:
            if p.is_alive():
                p.kill()
                p.join(10)

    def kill(self) -> None:
        for p in self.frontends:
            if p.is_alive():
                p.kill()
                p.join(10)
        for c in self.cores:
            if c.poll() is None:
                c.kill()
                c.wait(30)

    def close(self) -> None:
        self.kill()  # nothing is left running, whatever happened
        for control in self.controls:
            control.close(linger=0)
        self.zmq.term()
        if self.events is not None:
            self.events.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _frontend_main(index: int, core: CoreSpec, tokenizer: Any, cfg: ServerConfig, endpoints: list[tuple[str, str]],
                   sock: socket.socket, events: Any, supervisor: int) -> None:
    """One frontend process: attach to the cores, report ready, serve on the shared socket."""
    from swaserve.core.engine_core import freeze_startup_objects
    from swaserve.server.http_server import make_server

    os.setpgrp()  # a terminal's Ctrl-C reaches the supervisor alone, which stops the frontends in order
    threading.Thread(target=_exit_with_parent, args=(supervisor,), daemon=True).start()
    try:
        server = make_server(core, tokenizer, cfg, frontend=index, endpoints=endpoints)
    except Exception as e:  # noqa: BLE001  (reported to the supervisor, which raises it)
        events.put(("error", index, type(e).__name__, str(e)))
        sys.exit(1)
    app = server.config.app

    def stop_serving(signum: int, frame: Any) -> None:
        server.should_exit = True

    # uvicorn re-raises the signal it stopped for once it restored the previous handler: with this one
    # that ends run() normally instead of killing the process (the supervisor reads the exit code).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_serving)
    events.put(("ready", index, app.state.model_name))
    freeze_startup_objects()
    try:
        server.run(sockets=[sock])
    finally:
        app.state.engine_client.stop_cores(5.0)  # closes this frontend's sockets; the cores are not its own
    sys.exit(int(app.state.exit_code))


def _exit_with_parent(supervisor: int) -> None:
    while os.getppid() == supervisor:
        time.sleep(0.5)
    os._exit(1)
