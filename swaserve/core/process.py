"""CoreProcess: the frontend's handle on one engine-core process: starts it (`python -m swaserve.core`),
owns the two ZeroMQ sockets to it, waits for it to be ready, and stops or kills it. With several frontend
processes (`--api-server-count`) another process starts the core (`core_command`) and each frontend
holds an attached handle: its own sockets, no say over the core's life."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq

from swaserve.core.engine_core import CoreSpec
from swaserve.core.messages import Codec, Ready, Shutdown, StartupFailed, ToCore


INPUT_CONNECT_TIMEOUT_MS = 30_000


class CoreStartupError(RuntimeError):
    """The engine core exited or failed before it was ready."""


def core_command(spec: CoreSpec, inputs: list[str], outputs: list[str], parent_pid: int) -> tuple[list[str], dict]:
    """The engine-core process's command line and environment: it pulls inputs from every address in
    `inputs`, pushes frontend i's outputs to `outputs[i]`, and exits when `parent_pid` is gone."""
    # The core must import what this process can (e.g. a test's fake engine next to the test).
    path = os.pathsep.join(p for p in sys.path if p)
    env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "swaserve.core", "--spec", msgspec.json.encode(spec).decode(),
           *(a for addr in inputs for a in ("--input", addr)), *(a for addr in outputs for a in ("--output", addr)),
           "--parent-pid", str(parent_pid)]
    return cmd, env


def pid_alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie not yet reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: kill(0) said it exists


class CoreProcess:
    """One engine core and its IPC endpoints (ipc:// sockets in a private temp directory, or the
    `endpoint` (input, output) addresses another process gave the core it started: an attached handle).

    Inputs go out on a PUSH socket, outputs come back on a PULL socket (`outputs`, which the caller
    may shadow with an asyncio socket once the core is ready). Sending never blocks: the queue
    toward the core is unbounded. The core exits on `Shutdown` or when its parent dies; an attached
    handle never stops it (its starter does) and knows it is alive by its pid (from `Ready`).
    """

    def __init__(self, spec: CoreSpec, endpoint: tuple[str, str] | None = None):
        self.spec = spec
        self.attached = endpoint is not None
        self._dir = None if endpoint is not None else tempfile.mkdtemp(prefix="swaserve-core-")
        self.input_addr, self.output_addr = endpoint or (f"ipc://{self._dir}/in", f"ipc://{self._dir}/out")
        self._pid: int | None = None
        self._ctx = zmq.Context()
        self._inputs = self._ctx.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.bind(self.input_addr)
        self.outputs = self._ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.RCVHWM, 0)
        self.outputs.bind(self.output_addr)
        self.codec = Codec()
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self._pid

    @property
    def alive(self) -> bool:
        if self.attached:
            return self._pid is not None and pid_alive(self._pid)
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def start(self, timeout: float = 1800.0) -> Ready:
        """Start the core and wait until its engine is built; raises ValueError for bad input (a model
        path that does not exist, ...) and CoreStartupError for anything else."""
        self.launch()
        deadline = time.monotonic() + timeout
        while (ready := self.poll_ready(100)) is None:
            if time.monotonic() > deadline:
                self.kill()
                raise CoreStartupError(f"the engine core was not ready within {timeout:.0f} s")
        return ready

    def launch(self) -> None:
        """Start the core process without waiting for it (then `poll_ready` until it answers)."""
        assert not self.attached, "an attached handle's core is started by another process"
        cmd, env = core_command(self.spec, [self.input_addr], [self.output_addr], os.getpid())
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

    def poll_ready(self, timeout_ms: int) -> Ready | None:
        """The core's `Ready` if it came within `timeout_ms`, else None; raises ValueError (bad input)
        or CoreStartupError when the core failed or exited while starting."""
        assert self.proc is not None or self.attached, "launch() first"
        if self.outputs.poll(timeout_ms):
            msg = self.codec.decode_from_core(self.outputs.recv())
            if isinstance(msg, Ready):
                # The core connects to our input socket asynchronously (it may have tried before we
                # bound it): until that pipe is up, a send would fail. Ready is when both are.
                if not self._inputs.poll(INPUT_CONNECT_TIMEOUT_MS, zmq.POLLOUT):
                    raise CoreStartupError("the engine core is ready but never connected to its input socket")
                self._pid = msg.pid
                return msg
            if isinstance(msg, StartupFailed):
                if self.proc is not None:
                    self.proc.wait(30)
                raise (ValueError if msg.error_type == "ValueError" else CoreStartupError)(msg.message)
        if self.proc is not None and self.proc.poll() is not None:
            raise CoreStartupError(f"the engine core exited with code {self.proc.returncode} while starting")
        return None

    def send(self, msg: ToCore) -> None:
        self._inputs.send(self.codec.encode(msg), zmq.NOBLOCK)

    def request_stop(self) -> None:
        """Ask the core to exit (`Shutdown`) without waiting for it (an attached handle: nothing)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.send(Shutdown())
            except zmq.ZMQError:
                pass

    def stop(self, timeout: float = 30.0) -> int | None:
        """Ask the core to exit, wait up to `timeout` s (then kill it); its exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self.request_stop()
            try:
                self.proc.wait(max(0.0, timeout))
            except subprocess.TimeoutExpired:
                self.kill()
        self.close()
        return self.proc.returncode if self.proc is not None else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def close(self) -> None:
        self._inputs.close(linger=0)
        self.outputs.close(linger=0)
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
