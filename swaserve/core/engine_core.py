"""EngineCore: the engine-core process's busy loop (poll inputs, step, send one message per step), and its
entry point `python -m swaserve.core`. One core per engine; a tensor-parallel engine runs one per rank.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import signal
import sys
import time
from typing import Any

import msgspec
import zmq

from swaserve.core.messages import (
    AbortRequests,
    AddRequest,
    Codec,
    Ready,
    Rejected,
    RequestDelta,
    Shutdown,
    StartupFailed,
    StepOutputs,
)
from swaserve.core.request_trace import RequestTrace

logger = logging.getLogger(__name__)
TRACE_ENV = "SWASERVE_CORE_TRACE"  # a file: one JSON line per engine step (time, batch, tokens reported)
IDLE_POLL_MS = 500  # an idle core wakes this often to check that its frontend is alive
NAP_MS = 5  # work that cannot be scheduled yet: wait this long for an input instead of spinning


class CoreSpec(msgspec.Struct, frozen=True):
    """What the engine-core process builds: `factory` ("module:callable") called with `kwargs` (JSON
    values). The default is the real Engine; tests name a fake engine with the same contract."""

    factory: str = "swaserve.engine:Engine"
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)

    def build(self) -> Any:
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)(**self.kwargs)


class EngineCore:
    """Drives one engine: the only thread that touches it.

    Loop: take every input that arrived (without waiting while there is work), step the engine once
    (`step_deltas()`: what the step added, no cumulative outputs), send each frontend one
    `StepOutputs` with the new token ids of its requests (detokenizing is the frontend's job).
    Engine requests are single sequences (the frontend splits n). Invariant: `_live` maps the
    requests added and not yet finished, aborted or failed to the frontend that sent them (an index
    into `outboxes`); nothing is reported for a request outside it. The loop ends on `Shutdown`, or
    when the parent (`parent_pid`: the frontend, or the process that started the frontends) is gone,
    so no orphan core keeps holding the device.
    """

    def __init__(self, engine: Any, inbox: zmq.Socket, outboxes: list[zmq.Socket], parent_pid: int | None):
        self.engine = engine
        self.inbox, self.outboxes = inbox, outboxes
        self.parent_pid = parent_pid
        self.codec = Codec()
        self._live: dict[str, int] = {}  # request -> its frontend, from add to finish, abort or failure
        self._accepted: list[tuple[int, str]] = []  # (frontend, request) since the last message
        self._rejected: list[tuple[int, Rejected]] = []
        self._failed: list[tuple[int, str]] = []
        self._changed = False
        # First-token times per request (off unless SWASERVE_REQUEST_TRACE is set).
        self.requests = RequestTrace(f"core{os.getpid()}")

    def run(self) -> None:
        trace_path = os.environ.get(TRACE_ENV)
        trace = open(trace_path, "a") if trace_path else None
        try:
            self._loop(trace)
        finally:
            if trace is not None:
                trace.close()
            self.requests.close()

    def _loop(self, trace: Any) -> None:
        self._send([])  # the counters before any step: /metrics shows every replica's pools from the start
        poll_ms = 0
        last_parent_check = time.monotonic()
        while True:
            busy = self.engine.has_unfinished()
            if self.inbox.poll(poll_ms if busy else IDLE_POLL_MS) and not self._drain():
                return
            now = time.monotonic()
            if now - last_parent_check > IDLE_POLL_MS / 1000:
                last_parent_check = now
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.warning("engine core: its parent (the frontend or their supervisor) is gone; exiting")
                    return
            deltas: list[tuple[int, RequestDelta]] = []
            poll_ms = 0
            if self.engine.has_unfinished():
                t0 = time.monotonic()
                try:
                    deltas = self._deltas(self.engine.step_deltas())
                except Exception:
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all()
                t1 = time.monotonic()
                if not deltas and t1 - t0 < 1e-3:
                    poll_ms = NAP_MS
                if trace is not None:  # (start, seconds, [kind, requests, tokens] launched, tokens reported)
                    trace.write(f"[{t0:.6f},{t1 - t0:.6f},{msgspec.json.encode(self.engine.last_step).decode()},"
                                f"{len(deltas)}]\n")
                self._changed = True
            if self._changed:
                self._send(deltas)

    def _drain(self) -> bool:
        """Apply every queued input; False on Shutdown."""
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            msg = self.codec.decode_to_core(data)
            self._changed = True
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    self._live.pop(rid, None)
                    self.requests.forget(rid)
                    self.engine.abort(rid)
            elif isinstance(msg, Shutdown):
                return False

    def _add(self, msg: AddRequest) -> None:
        from swaserve.request import SamplingParams

        frontend = msg.frontend if 0 <= msg.frontend < len(self.outboxes) else 0
        try:
            self.engine.add_request(msg.request_id, msg.prompt_ids, SamplingParams(**msg.sampling))
        except ValueError as e:
            self._rejected.append((frontend, Rejected(msg.request_id, 400, str(e))))
            return
        except Exception:
            logger.exception("add_request failed")
            self._rejected.append((frontend, Rejected(msg.request_id, 500, "internal engine error")))
            return
        self._live[msg.request_id] = frontend
        self._accepted.append((frontend, msg.request_id))
        self.requests.arrived(msg.request_id, time.monotonic())

    def _deltas(self, seqs: list[Any]) -> list[tuple[int, RequestDelta]]:
        """The step's `SeqDelta`s as messages with their frontends, without those of requests aborted
        while it ran."""
        live = self._live
        deltas = []
        for d in seqs:
            frontend = live.get(d.request_id)
            if frontend is None:
                continue
            if d.finish_reason is not None:
                del live[d.request_id]
            deltas.append((frontend, RequestDelta(d.request_id, d.token_ids, d.logprobs, d.finish_reason,
                                                  d.cached_tokens, d.seed, d.spec, d.prompt_logprobs)))
        return deltas

    def _fail_all(self) -> None:
        for rid, frontend in list(self._live.items()):
            self._failed.append((frontend, rid))
            self.requests.forget(rid)
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
        self._live.clear()

    def _send(self, deltas: list[tuple[int, RequestDelta]]) -> None:
        """One `StepOutputs` to every frontend: its requests' news and the engine's counters."""
        snap = counters(self.engine)
        if len(self.outboxes) == 1:
            msgs = [StepOutputs([d for _, d in deltas], [r for _, r in self._accepted],
                                [r for _, r in self._rejected], [r for _, r in self._failed], snap)]
        else:
            msgs = [StepOutputs([], [], [], [], snap) for _ in self.outboxes]
            for f, d in deltas:
                msgs[f].deltas.append(d)
            for f, rid in self._accepted:
                msgs[f].accepted.append(rid)
            for f, rej in self._rejected:
                msgs[f].rejected.append(rej)
            for f, rid in self._failed:
                msgs[f].failed.append(rid)
        self._accepted, self._rejected, self._failed = [], [], []
        self._changed = False
        if self.requests.enabled:
            now = time.monotonic()
            for _, d in deltas:
                if d.token_ids:
                    self.requests.first_token(d.request_id, now)
        for outbox, msg in zip(self.outboxes, msgs):
            outbox.send(self.codec.encode(msg))


def freeze_startup_objects() -> None:
    """Move what a process built at startup out of the cyclic collector's view, so no full
    collection walks it between two steps or two SSE chunks (an inter-token latency spike). Called
    by the processes that serve until exit (engine core, frontends), just before they serve."""
    gc.collect()
    gc.freeze()


def counters(engine: Any) -> dict[str, int]:
    """The engine's counters (`Engine.counters()`, or memory_stats + stats for engines without it)."""
    if hasattr(engine, "counters"):
        return {k: int(v) for k, v in engine.counters().items()}
    snap = {k: int(v) for k, v in engine.memory_stats().items() if isinstance(v, (int, float))}
    for key in ("prompt_tokens_total", "generation_tokens_total", "retractions_total"):
        snap[key] = int(getattr(engine.stats, key, 0))
    return snap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swaserve.core", description="Run one engine core.")
    parser.add_argument("--spec", required=True, help="CoreSpec as JSON")
    parser.add_argument("--input", required=True, action="append",
                        help="ZeroMQ address a frontend (or the supervisor) pushes inputs to (repeatable)")
    parser.add_argument("--output", required=True, action="append",
                        help="ZeroMQ address the core pushes outputs to, one per frontend, in frontend order")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    # Ctrl-C, and a SIGTERM sent to the whole process group (`timeout`, systemd's default stop), reach
    # the core too: the frontend decides when it stops (Shutdown, after draining its requests), and
    # it exits by itself when its parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.dup2(2, 1)  # stdout belongs to the frontend (its startup line); anything printed here goes to stderr
    logging.basicConfig(level=logging.WARNING, format="swaserve core: %(levelname)s %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    for addr in args.input:
        inbox.connect(addr)  # inputs from every frontend, fair-queued
    outboxes = [ctx.socket(zmq.PUSH) for _ in args.output]
    for outbox, addr in zip(outboxes, args.output):
        outbox.connect(addr)
    codec = Codec()

    def tell_all(msg: Any) -> None:
        for outbox in outboxes:
            outbox.send(codec.encode(msg))

    try:
        engine = msgspec.json.decode(args.spec, type=CoreSpec).build()
    except Exception as e:
        if not isinstance(e, ValueError):
            logger.exception("engine core failed to start")
        tell_all(StartupFailed(type(e).__name__, str(e)))
        for outbox in outboxes:
            outbox.close(linger=2000)
        return 1
    name = getattr(engine, "model_name", None) or "swaserve"
    if hasattr(engine, "warm_grammars"):
        engine.warm_grammars()  # the structured-outputs vocabulary table, before any request can wait on it
    freeze_startup_objects()  # the model, graphs, tokenizer tables: alive until exit
    tell_all(Ready(name, int(engine.model_config.max_context), os.getpid()))
    if hasattr(engine, "startup_line"):
        print(f"swaserve: engine: {engine.startup_line()}", flush=True)  # stdout is stderr here (above)
    try:
        EngineCore(engine, inbox, outboxes, args.parent_pid).run()
    finally:
        if hasattr(engine, "close"):
            engine.close()  # the other tensor-parallel ranks, if any
    inbox.close(linger=0)
    for outbox in outboxes:
        outbox.close(linger=1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
